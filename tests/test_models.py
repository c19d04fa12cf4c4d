"""Model pieces checked by hand: configs, span enumeration, the marginal loss, input limits."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jit_init

from realm_jax.models import (BertModel, RealmConfig, RealmEmbedder, RealmRetriever,
                              marginal_mlm_loss, span_candidates, tiny_config)
from realm_jax.models.reader import SpanScorer


def test_config_reads_hf_json_and_refuses_bad_values(tmp_path):
  cfg = RealmConfig.from_dict({"hidden_size": 64, "num_attention_heads": 4, "dtype": "float16",
                               "model_type": "realm", "num_candidates": 8})
  assert cfg.hidden_size == 64 and cfg.dtype == "float32"
  assert cfg.projection_layer_norm_eps == 1e-12
  assert cfg.replace(retriever_layer_norm_eps=1e-3).projection_layer_norm_eps == 1e-3
  with pytest.raises(ValueError, match="hidden_size=30 is not divisible by num_attention_heads=4"):
    RealmConfig(hidden_size=30, num_attention_heads=4)
  with pytest.raises(ValueError, match="hidden_act='swish' is not supported"):
    RealmConfig(hidden_act="swish")
  with pytest.raises(ValueError, match="dtype='float16' is not supported"):
    RealmConfig(dtype="float16")
  (tmp_path / "bad.json").write_text("{nope")
  with pytest.raises(ValueError, match="bad.json is not valid JSON"):
    RealmConfig.from_json_file(tmp_path / "bad.json")
  with pytest.raises(FileNotFoundError, match="missing.json does not exist"):
    RealmConfig.from_json_file(tmp_path / "missing.json")
  assert RealmConfig.from_dict({"position_embedding_type": "absolute"}) == RealmConfig()
  with pytest.raises(ValueError, match="position_embedding_type='relative_key' is not supported"):
    RealmConfig.from_dict({"position_embedding_type": "relative_key"})


def test_span_candidates_by_hand():
  starts, ends = span_candidates(4, 2)
  np.testing.assert_array_equal(starts, [0, 1, 2, 3, 0, 1, 2])
  np.testing.assert_array_equal(ends, [0, 1, 2, 3, 1, 2, 3])
  starts, _ = span_candidates(320, 10)
  assert len(starts) == sum(320 - w + 1 for w in range(1, 11))


def test_spans_crossing_a_hole_in_the_block_mask_are_invalid():
  """[CLS] q [SEP] title [SEP] body [SEP]: the [SEP] between title and body is a hole in the block
  mask; a span from the title into the body is invalid though both its ends are in the block."""
  config = tiny_config(max_span_width=4)
  block_mask = np.array([[0, 0, 1, 1, 0, 1, 1, 1, 0, 0]])  # title at 2-3, body at 5-7
  hidden = jax.random.normal(jax.random.key(0), (1, 10, config.hidden_size))
  scorer = SpanScorer(config)
  params = scorer.init(jax.random.key(1), hidden, block_mask)
  logits, valid, starts, ends = scorer.apply(params, hidden, block_mask)
  valid = np.asarray(valid[0])
  got = {(int(s), int(e)) for s, e, v in zip(starts, ends, valid) if v}
  want = {(s, e) for s in range(10) for e in range(s, min(s + 4, 10))
          if block_mask[0, s:e + 1].all()}
  assert got == want
  assert {(2, 3), (5, 7), (3, 3)} <= got and not {(3, 5), (2, 5), (3, 6)} & got
  assert (np.asarray(logits[0])[~valid] == np.finfo(np.float32).min).all()


def test_marginal_loss_by_hand():
  # B=1, K=2 candidates, M=2 masked tokens (the second is padding), V=3.
  logits = jnp.log(jnp.array([[[[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]]],
                              [[[0.1, 0.8, 0.1], [1 / 3, 1 / 3, 1 / 3]]]]).transpose(1, 0, 2, 3))
  targets, mask = jnp.array([[1, 0]]), jnp.array([[1, 0]])
  retriever = jnp.log(jnp.array([[0.75, 0.25]]))
  loss, aux = marginal_mlm_loss(logits, targets, mask, retriever)
  want = -np.log(0.75 * 0.25 + 0.25 * 0.8)
  np.testing.assert_allclose(float(loss), want, rtol=1e-6)
  np.testing.assert_allclose(np.exp(aux["candidate_log_probs"][0, :, 0]), [0.25, 0.8], rtol=1e-6)
  np.testing.assert_allclose(np.exp(aux["retrieval_log_probs"][0]), [0.75, 0.25], rtol=1e-6)


def test_inputs_longer_than_positions_are_refused():
  config = tiny_config(max_position_embeddings=16)
  ids = jnp.ones((1, 17), jnp.int32)
  with pytest.raises(ValueError, match="Input length 17 exceeds max_position_embeddings=16"):
    BertModel(config).init(jax.random.key(0), ids)


@pytest.mark.slow
def test_separate_towers_differ_and_shared_towers_agree():
  config = tiny_config()
  ids = jnp.array([[2, 5, 6, 3, 0, 0]])
  mask = (ids > 0).astype(jnp.int32)
  q = dict(input_ids=ids, attention_mask=mask, token_type_ids=jnp.zeros_like(ids))
  c = {k: v[:, None, :] for k, v in q.items()}
  for shared in (True, False):
    model = RealmRetriever(config, share_embedders=shared)
    params = jit_init(model, 1, q, c)
    scores, q_emb, c_emb = model.apply({"params": params}, q, c)
    assert ("query_embedder" in params) == (not shared)
    assert np.allclose(q_emb, c_emb[:, 0]) == shared
    np.testing.assert_allclose(scores, jnp.sum(q_emb * c_emb[:, 0], -1)[:, None], rtol=1e-6)


def test_unknown_pooling_is_refused():
  with pytest.raises(ValueError, match="pooling='max' is not supported"):
    RealmEmbedder(tiny_config(), pooling="max").init(
        jax.random.key(0), jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4)), jnp.zeros((1, 4), jnp.int32))


@pytest.mark.slow
def test_query_ignore_id_treats_the_token_as_padding_in_the_query_tower_only():
  """RealmRetriever(query_ignore_id=t): queries are embedded as if every t were padding (no
  attention to it, not pooled); queries without t and all documents are unchanged."""
  config = tiny_config()
  ids = jnp.array([[2, 5, 9, 9, 6, 3, 0], [2, 5, 7, 6, 3, 0, 0]])   # 9 plays [MASK]
  mask = (ids > 0).astype(jnp.int32)
  q = dict(input_ids=ids, attention_mask=mask, token_type_ids=jnp.zeros_like(ids))
  c = {k: v[:, None, :] for k, v in q.items()}
  for pooling in ("mean", "projected_cls"):
    plain = RealmRetriever(config, share_embedders=False, pooling=pooling)
    hiding = RealmRetriever(config, share_embedders=False, pooling=pooling, query_ignore_id=9)
    params = jit_init(plain, 1, q, c)
    _, q_plain, c_plain = plain.apply({"params": params}, q, c)
    _, q_hide, c_hide = hiding.apply({"params": params}, q, c)
    padded = dict(q, attention_mask=mask * (ids != 9))
    _, q_padded, _ = plain.apply({"params": params}, padded, c)
    # Two programs (the mask made inside the model, or given): equal up to float32 rounding,
    # which XLA's fusions may order differently on another CPU.
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    close(q_hide, q_padded)
    close(c_hide, c_plain)
    close(q_hide[1], q_plain[1])       # no 9 in the second query
    assert np.abs(q_hide[0] - q_plain[0]).max() > 1e-3


def test_bf16_compute_keeps_the_softmax_probabilities_in_bf16_for_the_backward():
  """With bfloat16 compute, BERT's attention softmax is the float32 softmax going forward; its
  gradient, by hand, is y * (g - sum(g * y)) with y rounded to bfloat16; in float32 compute the
  softmax is jax's own (its gradient with y in float32)."""
  import jax
  import jax.numpy as jnp
  from realm_jax.models import bert
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 3, 5, 7)) * 3, jnp.float32)
  g = jnp.asarray(rng.normal(size=(2, 3, 5, 7)), jnp.float32)
  y, vjp = jax.vjp(bert.softmax_bf16_backward, x)
  np.testing.assert_array_equal(y, jax.nn.softmax(x, axis=-1))
  yb = np.asarray(np.asarray(y).astype(jnp.bfloat16), np.float64)
  want = yb * (np.asarray(g, np.float64) - (np.asarray(g, np.float64) * yb).sum(-1, keepdims=True))
  np.testing.assert_allclose(vjp(g)[0], want, rtol=1e-5, atol=1e-6)
  exact = jax.vjp(lambda t: jax.nn.softmax(t, axis=-1), x)[1](g)[0]
  assert not np.allclose(vjp(g)[0], exact, rtol=1e-6, atol=0)  # (the rounding is there)
  np.testing.assert_allclose(vjp(g)[0], exact, rtol=0.05, atol=5e-3)
  # Which softmax a layer takes: bfloat16 compute the one above, float32 jax's.
  from realm_jax.models.config import tiny_config
  ids = jnp.asarray(rng.integers(1, 100, (2, 16)), jnp.int32)
  for dtype in ("float32", "bfloat16"):
    model = bert.BertModel(tiny_config(dtype=dtype))
    params = jax.jit(model.init)(jax.random.key(0), ids)["params"]
    text = str(jax.make_jaxpr(lambda p: model.apply({"params": p}, ids))(params))
    assert ("softmax_bf16_backward" in text) == (dtype == "bfloat16"), dtype


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weight_products_have_dot_generals_values_and_gradients(dtype):
  """models/matmul.py's `linear` and `attend` (a backward written out so that XLA:CPU runs the
  weight gradient fast) against lax.dot_general and its own autodiff: values, input and weight
  gradients, their dtypes; a Dense built with it equals flax's default."""
  from jax import lax

  from realm_jax.models import matmul
  rng = np.random.default_rng(0)
  dt = jnp.dtype(dtype)
  x = jnp.asarray(rng.normal(size=(3, 5, 8)), dt)
  w = jnp.asarray(rng.normal(size=(8, 6)), dt)
  table = jnp.asarray(rng.normal(size=(11, 8)), dt)
  g = jnp.asarray(rng.normal(size=(3, 5, 6)), dt)
  gv = jnp.asarray(rng.normal(size=(3, 5, 11)), dt)
  tol = dict(rtol=1e-6, atol=1e-6) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
  cases = ((matmul.linear, w, g, lambda a, b: lax.dot_general(a, b, (((2,), (0,)), ((), ())))),
           (matmul.attend, table, gv, lambda a, b: lax.dot_general(a, b, (((2,), (1,)), ((), ())))))
  for ours, weight, cot, reference in cases:
    y, vjp = jax.vjp(ours, x, weight)
    want, want_vjp = jax.vjp(reference, x, weight)
    assert y.dtype == want.dtype and y.shape == want.shape
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want, np.float32), **tol)
    for got, ref in zip(vjp(cot), want_vjp(cot)):
      assert got.dtype == ref.dtype and got.shape == ref.shape
      np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), **tol)
  # nn.Dense with it: the same parameters, outputs and gradients as flax's own product.
  ours = matmul.Dense(6, dtype=dt)
  plain = nn.Dense(6, dtype=dt)
  params = plain.init(jax.random.key(0), x)
  loss = lambda m: lambda p: (m.apply(p, x).astype(jnp.float32) ** 2).sum()
  got, ref = jax.grad(loss(ours))(params), jax.grad(loss(plain))(params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)
  # Any other product goes to lax.dot_general as given.
  batched = (((2,), (2,)), ((0,), (0,)))
  other = jnp.asarray(rng.normal(size=(3, 4, 8)), dt)
  np.testing.assert_array_equal(matmul.dense_dot_general(x, other, batched),
                                lax.dot_general(x, other, batched))
