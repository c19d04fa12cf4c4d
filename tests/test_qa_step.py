"""The open-QA fine-tuning step: a batch equals the sum of its questions, sharded == single device,
only the question tower and the reader move, and the retriever loss is the marginal NLL."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MESH_3D, laid_out, random_inputs, split_arrays

from realm_jax import sharding
from realm_jax.models import RealmConfig, RealmEmbedder, RealmReader, RealmRetriever
from realm_jax.models.open_qa import QaModels, qa_beam_logits, qa_params
from realm_jax.train.init import _init
from realm_jax.train.optimizer import bert_adamw
from realm_jax.train.qa_step import TrainState, qa_loss, qa_train_step, summarize_qa

# One layer, as test_train_step.CFG (why: there).
CFG = RealmConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=37, max_position_embeddings=64, retriever_proj_size=16,
                  span_hidden_size=12, max_span_width=3)
NAMES = ("input_ids", "attention_mask", "token_type_ids")
MODELS = QaModels(RealmEmbedder(CFG), RealmReader(CFG), score_scale=3.0)


def make_batch(seed=0, b=8, z=6, r=3, lq=8, l=16, a=2):
  """Question 0 has no answer in its beam, question 1 one only outside the read blocks, question
  2 a short beam (masked slots, one of them read); the others a gold span in some read blocks."""
  rng = np.random.default_rng(seed)
  as32 = lambda t: {n: x.astype(np.int32) for n, x in zip(NAMES, t)}
  question = as32(random_inputs(rng, (b,), lq, CFG.vocab_size, min_len=4))
  reader = as32(random_inputs(rng, (b, r), l, CFG.vocab_size, min_len=12))
  block_mask = ((np.arange(l) >= 5) & (reader["attention_mask"] > 0)).astype(np.int32)
  beam_mask = np.ones((b, z), np.int32)
  beam_mask[2, r - 1:] = 0
  has_answer = (rng.random((b, z)) < 0.4).astype(np.int32)
  has_answer[:, 0] = 1
  has_answer[0] = 0
  has_answer[1] = 0
  has_answer[1, -1] = 1
  gold_starts = np.full((b, r, a), -1, np.int32)
  gold_ends = np.full((b, r, a), -1, np.int32)
  for i in range(b):
    for k in range(r):
      if has_answer[i, k] and beam_mask[i, k]:
        s = rng.integers(5, 9)
        gold_starts[i, k, 0], gold_ends[i, k, 0] = s, s + rng.integers(0, CFG.max_span_width)
  return {"question": question,
          "beam_embeddings": rng.normal(size=(b, z, CFG.retriever_proj_size)).astype(np.float32),
          "beam_mask": beam_mask, "beam_has_answer": has_answer, "reader": reader,
          "block_mask": block_mask, "gold_starts": gold_starts, "gold_ends": gold_ends}


def retriever_params(seed=0):
  return _init(RealmRetriever(CFG, share_embedders=True), CFG, jax.random.key(seed))


def reader_params(seed=0):
  ids = jnp.zeros((1, 2, 8), jnp.int32)
  init = lambda r: MODELS.reader.init(r, ids, ids, ids, ids, jnp.zeros((1, 2)))["params"]
  return jax.jit(init)(jax.random.key(seed))


def make_params(seed=0):
  return qa_params(retriever_params(seed), reader_params(seed + 1))


@pytest.mark.slow
def test_batch_equals_sum_of_single_questions():
  params, batch = make_params(), make_batch()
  grad_fn = jax.jit(jax.value_and_grad(lambda p, b: qa_loss(p, b, MODELS), has_aux=True))
  (loss, sums), grads = grad_fn(params, batch)
  assert 0 < float(sums["has_answer"]) < float(sums["questions"])
  assert float(sums["retriever_loss_sum"]) > 0 and float(sums["reader_loss_sum"]) > 0
  single_loss, single_grads = 0.0, jax.tree.map(np.zeros_like, params)
  for i in range(8):
    (l_i, _), g_i = grad_fn(params, jax.tree.map(lambda x: x[i:i + 1], batch))
    single_loss += float(l_i)
    single_grads = jax.tree.map(lambda s, g: s + np.asarray(g), single_grads, g_i)
  np.testing.assert_allclose(float(loss), single_loss, rtol=1e-5)
  flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
  g, s = flat(grads), flat(single_grads)
  assert np.linalg.norm(g - s) <= 1e-5 * np.linalg.norm(s)
  # Each leaf relative to its own size (float32 sums of 8 questions: the largest leaves, ~2e3,
  # differ by ~1.5e-6 of their size on a Zen 3), plus a floor relative to the whole gradient for
  # the leaves whose true gradient is 0 (attention key biases cancel in the softmax), where both
  # sides are float32 noise.
  for (path, g_leaf), s_leaf in zip(jax.tree_util.tree_leaves_with_path(grads),
                                    jax.tree.leaves(single_grads)):
    bound = 1e-5 * np.abs(s_leaf).max() + 1e-6 * np.abs(s).max()
    assert np.abs(np.asarray(g_leaf) - s_leaf).max() <= bound, jax.tree_util.keystr(path)


@pytest.mark.slow
def test_retriever_loss_is_hand_computed_marginal_nll():
  params, batch = make_params(seed=1), make_batch(seed=1, b=4)
  q = np.asarray(MODELS.query_tower.apply(
      {"params": params["query_tower"]}, *(batch["question"][n] for n in NAMES)))   # [B, D]
  logits = MODELS.score_scale * np.einsum("bd,bzd->bz", q.astype(np.float64),
                                          batch["beam_embeddings"].astype(np.float64))
  want = 0.0
  for i in range(4):
    real = batch["beam_mask"][i] > 0
    gold = real & (batch["beam_has_answer"][i] > 0)
    if gold.any():
      want += np.log(np.exp(logits[i, real]).sum()) - np.log(np.exp(logits[i, gold]).sum())
  _, sums = jax.jit(lambda p, b: qa_loss(p, b, MODELS))(params, batch)
  np.testing.assert_allclose(float(sums["retriever_loss_sum"]), want, rtol=1e-5)
  masked = np.asarray(qa_beam_logits(params, batch, MODELS))
  np.testing.assert_allclose(masked[batch["beam_mask"] > 0], logits[batch["beam_mask"] > 0],
                             rtol=1e-5, atol=1e-5)
  assert (masked[batch["beam_mask"] == 0] <= -1e8).all()


def run_steps(mesh, n_steps=2):
  tx = bert_adamw(1e-4, 10, warmup_steps=1)
  states, data, rep = laid_out(mesh, jax.eval_shape(make_params), tx)

  @chex.assert_max_traces(n=1)
  def step(state, batch, rng):
    return qa_train_step(state, batch, rng, models=MODELS, dropout=True)

  fn = jax.jit(sharding.traced_on(rep.mesh, step), in_shardings=(states, data, rep),
               out_shardings=(states, rep), donate_argnums=0)  # with the activation hints
  state = jax.device_put(TrainState.create(apply_fn=None, params=make_params(), tx=tx), states)
  losses = []
  for s in range(n_steps):
    state, out = fn(state, jax.device_put(make_batch(seed=s), data), jax.random.key(7))
    losses.append(summarize_qa(out)["loss"])
  chex.clear_trace_counter()
  if mesh == MESH_3D:
    assert split_arrays(state.params) > 10  # the step ran on split parameters
  return jax.device_get(state.params), losses


@pytest.mark.slow
def test_sharded_step_equals_single_device():
  """Data 2 x fsdp 2 x tensor 2 (the batch in 4 parts, parameters and Adam's moments split by
  their logical axes) == one device, dropout included."""
  assert jax.device_count() == 8
  single_params, single_losses = run_steps("data=1")
  sharded_params, sharded_losses = run_steps(MESH_3D)
  np.testing.assert_allclose(sharded_losses, single_losses, rtol=1e-5)
  chex.assert_trees_all_close(sharded_params, single_params, atol=1e-5, rtol=0)


def _cannot_learn(key: str) -> bool:
  """Leaves whose true gradient is exactly 0 under this loss, so that whether Adam moves them
  depends on rounding (CPUs differ): the attention key biases (q . b_k is the same for every key
  of a query, so the attention softmax drops it) and the reader's BERT pooler (kept for HF parity;
  it feeds no span score)."""
  return "pooler" in key or ("['key']" in key and key.endswith("['bias']"))


SPAN_OFFSET = "['reader']['qa_outputs']['dense_output']['bias']"


@pytest.mark.slow
def test_only_question_tower_and_reader_move():
  """From a shared-tower REALM retriever: after a donated step the document tower (the one that
  built the index) is intact and unchanged; every question-tower and reader leaf that the loss
  can train moved, and the span scorer's output bias (a constant on every span logit, which the
  span softmax removes) did not move at all."""
  retriever = retriever_params()
  doc_before = jax.device_get(retriever["embedder"])
  params = qa_params(retriever, reader_params(1))
  assert set(params) == {"query_tower", "reader"}  # the document tower is not optimised at all
  before = jax.device_get(params)
  state = TrainState.create(apply_fn=None, params=params, tx=bert_adamw(1e-3, 10, warmup_steps=0))
  step = jax.jit(lambda s, b, r: qa_train_step(s, b, r, models=MODELS), donate_argnums=0)
  state, out = step(state, make_batch(), jax.random.key(0))
  assert float(out["skipped"]) == 0.0 and float(out["grad_norm"]) > 0
  chex.assert_trees_all_equal(jax.device_get(retriever["embedder"]), doc_before)
  checked = 0
  for (path, new), old in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(state.params)),
                              jax.tree.leaves(before)):
    key = jax.tree_util.keystr(path)
    if key == SPAN_OFFSET:
      np.testing.assert_array_equal(new, old)
    elif not _cannot_learn(key):
      assert not np.array_equal(new, old), f"{key} did not move"
      checked += 1
  assert checked > 40


@pytest.mark.slow
def test_span_offset_gradient_is_exactly_zero():
  """A constant added to every span logit leaves every loss unchanged (checked here by adding
  one), and the gradient of the bias that adds it is exactly 0, not rounding noise."""
  params, batch = make_params(), make_batch()
  loss = jax.jit(lambda p: qa_loss(p, batch, MODELS)[0])
  shifted = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 5.0 if jax.tree_util.keystr(path) == SPAN_OFFSET else x, params)
  np.testing.assert_allclose(float(loss(shifted)), float(loss(params)), rtol=1e-5)
  grads = jax.jit(jax.grad(lambda p: qa_loss(p, batch, MODELS)[0]))(params)
  assert np.all(np.asarray(grads["reader"]["qa_outputs"]["dense_output"]["bias"]) == 0.0)
  assert np.abs(np.asarray(grads["reader"]["qa_outputs"]["dense_output"]["kernel"])).max() > 0


def test_prediction_only_picks_whole_word_spans():
  """With word_start / word_end allowing a single (start, end) per block, that span is each
  block's best and its logit is unchanged; the training loss sees only allowed spans."""
  from realm_jax.models.open_qa import qa_predict_step, whole_word_spans
  params, batch = make_params(), make_batch()
  b, r, l = batch["reader"]["input_ids"].shape
  batch["word_start"] = np.zeros((b, r, l), np.int32)
  batch["word_end"] = np.zeros((b, r, l), np.int32)
  batch["word_start"][:, :, 6] = 1
  batch["word_end"][:, :, 7] = 1
  read = dict(batch, beam_embeddings=batch["beam_embeddings"][:, :r],
              beam_mask=batch["beam_mask"][:, :r])
  got = jax.device_get(jax.jit(lambda p, x: qa_predict_step(p, x, models=MODELS))(params, read))
  from realm_jax.models.reader import span_candidates
  starts, ends = span_candidates(l, CFG.max_span_width)
  allowed = int(np.flatnonzero((starts == 6) & (ends == 7))[0])
  real = read["beam_mask"] > 0
  assert (got["block_best"][real] == allowed).all()
  out = jax.jit(lambda p, x, logits: MODELS.reader.apply(
      {"params": p}, x["reader"]["input_ids"], x["reader"]["attention_mask"],
      x["reader"]["token_type_ids"], x["block_mask"], logits))(params["reader"], batch,
                                                               got["retriever_logits"])
  np.testing.assert_allclose(got["block_score"][real], np.asarray(out["span_logits"])[..., allowed][real],
                             rtol=1e-6)
  logits, valid = whole_word_spans(out, batch)
  assert int(np.asarray(valid).sum()) <= b * r and np.asarray(valid)[..., allowed].sum() > 0
