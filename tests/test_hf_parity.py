"""realm_jax models against the Hugging Face PyTorch REALM port on the same perturbed weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import perturbed, random_inputs

torch = pytest.importorskip("torch")
realm_hf = pytest.importorskip("transformers.models.deprecated.realm.modeling_realm")

from realm_jax.checkpoints import from_hf_state_dict, to_hf_state_dict  # noqa: E402
from realm_jax.models import (KnowledgeAugEncoder, RealmEmbedder, RealmReader,  # noqa: E402
                              RealmRetriever, correct_spans, marginal_mlm_loss, reader_losses)

ATOL = 1e-5
MAX_ERRORS = {}  # model -> max abs error, printed at the end of the session (see test report)


def _record(name, a, b):
  err = float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
  MAX_ERRORS[name] = max(err, MAX_ERRORS.get(name, 0.0))
  return err


def _t(x):
  return torch.as_tensor(np.asarray(x))


def test_embedder_matches_hf(hf_config, jax_config):
  hf = perturbed(realm_hf.RealmEmbedder(hf_config), seed=1)
  params, _ = from_hf_state_dict(hf.state_dict(), "embedder", jax_config)
  ids, mask, types = random_inputs(np.random.default_rng(0), (5,), 12, hf_config.vocab_size)
  with torch.no_grad():
    want = hf(_t(ids), attention_mask=_t(mask), token_type_ids=_t(types)).projected_score.numpy()
  got = RealmEmbedder(jax_config).apply({"params": params}, ids, mask, types)
  assert got.shape == (5, hf_config.retriever_proj_size)
  assert _record("embedder", got, want) <= ATOL


@pytest.mark.parametrize("shared", [True, False])
def test_relevance_scores_match_hf_scorer(hf_config, jax_config, shared):
  query_embedder = None if shared else perturbed(realm_hf.RealmEmbedder(hf_config), seed=7)
  hf = realm_hf.RealmScorer(hf_config, query_embedder=query_embedder)
  perturbed(hf.embedder, seed=2)
  params, _ = from_hf_state_dict(hf.state_dict(), "retriever", jax_config)
  assert ("query_embedder" in params) == (not shared)
  rng = np.random.default_rng(1)
  k = hf_config.num_candidates
  q = random_inputs(rng, (2,), 10, hf_config.vocab_size)
  c = random_inputs(rng, (2, k), 14, hf_config.vocab_size)
  with torch.no_grad():
    out = hf(_t(q[0]), attention_mask=_t(q[1]), token_type_ids=_t(q[2]),
             candidate_input_ids=_t(c[0]), candidate_attention_mask=_t(c[1]),
             candidate_token_type_ids=_t(c[2]))
  names = ("input_ids", "attention_mask", "token_type_ids")
  scores, q_emb, c_emb = RealmRetriever(jax_config, share_embedders=shared).apply(
      {"params": params}, dict(zip(names, q)), dict(zip(names, c)))
  assert scores.shape == (2, k)
  assert _record("retriever", scores, out.relevance_score.numpy()) <= ATOL
  assert _record("retriever", q_emb, out.query_score.numpy()) <= ATOL
  assert _record("retriever", c_emb, out.candidate_score.numpy()) <= ATOL


def _encoder_case(hf_config, seed=3):
  rng = np.random.default_rng(seed)
  b, k, l = 2, hf_config.num_candidates, 16
  ids, mask, types = random_inputs(rng, (b, k), l, hf_config.vocab_size, min_len=8)
  # Masked positions are shared by the K candidates (the query comes first in [CLS] x [SEP] z).
  labels = np.full((b, l), -100)
  labels[0, [1, 2, 5]] = rng.integers(1, hf_config.vocab_size, 3)
  labels[1, [3]] = rng.integers(1, hf_config.vocab_size, 1)
  relevance = rng.normal(size=(b, k)).astype(np.float32) * 2
  return ids, mask, types, labels, relevance


def _hf_encoder_loss(hf, ids, mask, types, labels, relevance):
  return hf(_t(ids), attention_mask=_t(mask), token_type_ids=_t(types),
            relevance_score=_t(relevance), labels=_t(labels), mlm_mask=_t(labels != -100))


def _positions(labels):
  """[B, L] labels with -100 -> ([B, M] positions, [B, M] targets, [B, M] mask), M = max count."""
  m = max(int((row != -100).sum()) for row in labels)
  pos = np.zeros((len(labels), m), np.int32)
  tgt = np.zeros((len(labels), m), np.int32)
  msk = np.zeros((len(labels), m), np.int32)
  for i, row in enumerate(labels):
    where = np.nonzero(row != -100)[0]
    pos[i, :len(where)], tgt[i, :len(where)], msk[i, :len(where)] = where, row[where], 1
  return pos, tgt, msk


@pytest.fixture(scope="module")
def encoder_pair(hf_config, jax_config):
  hf = perturbed(realm_hf.RealmKnowledgeAugEncoder(hf_config), seed=4)
  params, _ = from_hf_state_dict(hf.state_dict(), "encoder", jax_config)
  return hf, params


def _jax_encoder_loss(params, jax_config, ids, mask, types, labels, relevance, gather=True):
  pos, tgt, msk = _positions(labels)
  model = KnowledgeAugEncoder(jax_config)
  if gather:
    logits = model.apply({"params": params}, ids, mask, types, mlm_positions=jnp.asarray(pos))
  else:  # full [B, K, L, V] logits, then pick the masked positions
    full = model.apply({"params": params}, ids, mask, types)
    logits = jnp.take_along_axis(full, jnp.asarray(pos)[:, None, :, None], axis=2)
  return marginal_mlm_loss(logits, tgt, msk, relevance)


@pytest.mark.parametrize("gather", [True, False])
def test_encoder_loss_and_candidate_log_probs_match_hf(encoder_pair, hf_config, jax_config, gather):
  hf, params = encoder_pair
  ids, mask, types, labels, relevance = _encoder_case(hf_config)
  with torch.no_grad():
    out = _hf_encoder_loss(hf, ids, mask, types, labels, relevance)
  loss, aux = _jax_encoder_loss(params, jax_config, ids, mask, types, labels, relevance, gather)
  assert _record("encoder", loss, out.loss.item()) <= ATOL

  # log p(y_t | x, z_c) from HF's own MLM logits, at the masked positions.
  b, k, l = ids.shape
  hf_logp = torch.log_softmax(out.logits.view(b, k, l, -1), -1).numpy()
  pos, tgt, msk = _positions(labels)
  for i in range(b):
    for j in np.nonzero(msk[i])[0]:
      want = hf_logp[i, :, pos[i, j], tgt[i, j]]
      assert _record("encoder", aux["candidate_log_probs"][i, :, j], want) <= ATOL


@pytest.mark.slow
def test_encoder_loss_gradients_match_hf(encoder_pair, hf_config, jax_config):
  hf, params = encoder_pair
  ids, mask, types, labels, relevance = _encoder_case(hf_config, seed=5)
  rel_t = _t(relevance).requires_grad_(True)
  hf.zero_grad()
  out = hf(_t(ids), attention_mask=_t(mask), token_type_ids=_t(types), relevance_score=rel_t,
           labels=_t(labels), mlm_mask=_t(labels != -100))
  out.loss.backward()

  def loss_fn(p, rel):
    return _jax_encoder_loss(p, jax_config, ids, mask, types, labels, rel)[0]

  grads, rel_grad = jax.jit(jax.grad(loss_fn, argnums=(0, 1)))(params, jnp.asarray(relevance))
  assert _record("encoder grad", rel_grad, rel_t.grad.numpy()) <= 1e-4
  ours = to_hf_state_dict(grads, "encoder")
  checked = 0
  for name, p in hf.named_parameters():
    mine = ours[name]
    if p.grad is None:  # the pooler does not take part in the MLM loss
      assert name.startswith("realm.pooler") and not np.any(mine), name
      checked += 1
      continue
    g = p.grad.numpy()
    if name == "realm.embeddings.word_embeddings.weight":
      # HF's nn.Embedding(padding_idx=0) freezes the lookup gradient of the [PAD] row.
      g, mine = np.delete(g, hf_config.pad_token_id, 0), np.delete(mine, hf_config.pad_token_id, 0)
    assert np.abs(g).max() > 0, name
    assert _record("encoder grad", mine, g) <= 1e-4, name
    checked += 1
  assert checked == len(list(hf.parameters()))


@pytest.mark.slow
def test_reader_span_logits_and_losses_match_hf(hf_config, jax_config):
  hf = perturbed(realm_hf.RealmReader(hf_config), seed=6)
  params, _ = from_hf_state_dict(hf.state_dict(), "reader", jax_config)
  rng = np.random.default_rng(7)
  r, z, l = hf_config.reader_beam_size, hf_config.searcher_beam_size, 14
  ids, mask, types = random_inputs(rng, (z,), l, hf_config.vocab_size, min_len=10)
  block_mask = (types == 1).astype(np.int64)  # the block is the second segment
  block_mask[np.arange(z), mask.sum(-1) - 1] = 0  # not its final [SEP]
  relevance = rng.normal(size=(z,)).astype(np.float32)
  has_answers = np.array([False, True, False, True])
  starts = np.array([[5, 7], [8, -1], [6, -1], [9, 9]])
  ends = np.array([[6, 7], [9, -1], [6, -1], [9, 10]])
  with torch.no_grad():
    out = hf(_t(ids[:r]), attention_mask=_t(mask[:r]), token_type_ids=_t(types[:r]),
             relevance_score=_t(relevance), block_mask=_t(block_mask.astype(bool)),
             start_positions=_t(starts), end_positions=_t(ends), has_answers=_t(has_answers))
    seq = hf.realm(_t(ids[:r]), attention_mask=_t(mask[:r]), token_type_ids=_t(types[:r]))[0]
    hf_logits, _, _ = hf.qa_outputs(seq, _t(block_mask[:r].astype(bool)))
    hf_logits = (hf_logits + _t(relevance[:r])[:, None]).numpy()

  res = RealmReader(jax_config).apply({"params": params}, ids[None, :r], mask[None, :r],
                                      types[None, :r], block_mask[None, :r], relevance[None, :r])
  valid = np.asarray(res["span_valid"][0])
  assert valid.any() and not valid.all()
  np.testing.assert_array_equal(valid, hf_logits > np.finfo(np.float32).min / 2)
  assert _record("reader", res["span_logits"][0][valid], hf_logits[valid]) <= ATOL

  correct = correct_spans(res["starts"], res["ends"], starts[None, :r], ends[None, :r])
  losses = reader_losses(relevance[None], has_answers[None], res["span_logits"], correct)
  assert _record("reader", losses["retriever_loss"][0], out.retriever_loss.item()) <= ATOL
  assert _record("reader", losses["reader_loss"][0], out.reader_loss.item()) <= ATOL
  assert _record("reader", losses["loss"], out.loss.item()) <= ATOL


def test_reader_losses_are_zero_without_a_correct_answer():
  logits = jnp.array([[1.0, 2.0, -3.0]])
  nothing = jnp.zeros((1, 3), bool)
  out = reader_losses(logits, nothing, logits[:, None, :], nothing[:, None, :])
  assert float(out["retriever_loss"][0]) == 0.0 and float(out["reader_loss"][0]) == 0.0
  g = jax.grad(lambda x: reader_losses(x, nothing, x[:, None, :], nothing[:, None, :])["loss"])(logits)
  assert np.all(np.isfinite(g)) and np.all(g == 0)
  # One correct candidate: -log softmax(logits)[1], by hand.
  one = jnp.array([[False, True, False]])
  want = -(2.0 - np.log(np.exp(1.0) + np.exp(2.0) + np.exp(-3.0)))
  got = reader_losses(logits, one, logits[:, None, :], one[:, None, :])["retriever_loss"][0]
  np.testing.assert_allclose(float(got), want, rtol=1e-6)


def test_report_max_errors():
  """Prints the measured parity figures (run with -s to see them)."""
  assert MAX_ERRORS, "parity tests did not run"
  for name, err in sorted(MAX_ERRORS.items()):
    print(f"parity max abs error {name:14s} {err:.2e}")
