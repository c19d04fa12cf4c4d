"""The REALM pre-training step: sharded == single device, one compilation, gradients reach both
retriever towers (finite differences), and the loss equals the HF port's on the same inputs."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MESH_3D, jit_init, laid_out, perturbed, random_inputs, split_arrays

from realm_jax import sharding
from realm_jax.models import BertModel, KnowledgeAugEncoder, RealmConfig, RealmRetriever
from realm_jax.train.init import _init
from realm_jax.train.optimizer import bert_adamw, bert_schedule, decay_mask
from realm_jax.train.realm_step import (RealmModels, TrainState, realm_loss, retriever_logits,
                                        summarize, train_step)

# One layer: what the step does to its parameters is the same in every layer; a second one cost
# ~20% more CPU here, in test_qa_step.py and in test_pieces.py (docs/notes.md, 2026-12-01).
# Layers stacked in HF's order are checked in test_hf_parity.py (conftest.TINY_HF: 2 layers).
CFG = RealmConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=37, max_position_embeddings=64, retriever_proj_size=16)
NAMES = ("input_ids", "attention_mask", "token_type_ids")


def make_batch(seed=0, b=8, k=4, lq=10, ld=12, le=20, m=3, vocab=100):
  rng = np.random.default_rng(seed)
  q = random_inputs(rng, (b,), lq, vocab, min_len=6)
  c = random_inputs(rng, (b, k), ld, vocab)
  j = random_inputs(rng, (b, k), le, vocab, min_len=8)
  pos = np.stack([rng.choice(np.arange(1, 6), m, replace=False) for _ in range(b)]).astype(np.int32)
  weights = (rng.random((b, m)) < 0.8).astype(np.float32)
  weights[:, 0] = 1
  mask = np.ones((b, k), np.float32)
  mask[0, -1] = 0  # one query has a missing candidate
  as32 = lambda t: {n: x.astype(np.int32) for n, x in zip(NAMES, t)}
  return {"query": as32(q), "candidates": as32(c), "joint": as32(j), "candidate_mask": mask,
          "mlm_positions": pos, "mlm_targets": rng.integers(1, vocab, (b, m)).astype(np.int32),
          "mlm_weights": weights}


def make_models(share=True, scale=1.0, cfg=CFG):
  return RealmModels(RealmRetriever(cfg, share_embedders=share), KnowledgeAugEncoder(cfg), scale)


def make_params(models, seed=0):
  r1, r2 = jax.random.split(jax.random.key(seed))
  return {"retriever": _init(models.retriever, CFG, r1), "encoder": _init(models.encoder, CFG, r2)}


@functools.lru_cache(maxsize=None)
def compiled_step(mesh: str):
  """(models, tx, state shardings, batch sharding, jitted step with the state donated) on `mesh`
  (conftest.laid_out: the parameters split as the training loop splits them), shared by the tests
  so that each mesh's step compiles once."""
  models = make_models()
  # Adam divides by sqrt(v): on a parameter whose gradient is ~0 (a rare word piece) a 1e-9
  # difference from another summation order moves the update by ~lr, so lr bounds the comparison.
  tx = bert_adamw(1e-4, 10, warmup_steps=2)
  states, data, rep = laid_out(mesh, jax.eval_shape(lambda: make_params(models)), tx)

  chex.clear_trace_counter()  # chex counts by function: the other mesh's `step` traced once too

  @chex.assert_max_traces(n=1)
  def step(state, batch, rng):
    return train_step(state, batch, rng, models=models)

  fn = jax.jit(sharding.traced_on(rep.mesh, step), in_shardings=(states, data, rep),
               out_shardings=(states, rep), donate_argnums=0)  # with the activation hints
  return models, tx, states, data, fn


def run_steps(mesh, n_steps=3):
  models, tx, states, data, fn = compiled_step(mesh)
  state = jax.device_put(TrainState.create(apply_fn=None, params=make_params(models), tx=tx),
                         states)
  losses = []
  for s in range(n_steps):
    batch = jax.device_put(make_batch(seed=s), data)
    state, out = fn(state, batch, jax.random.key(7))
    losses.append(float(out["loss_sum"]) / float(out["tokens"]))
  if mesh == MESH_3D:
    assert split_arrays(state.params) > 10  # the step ran on split parameters
  return jax.device_get(state.params), losses


@pytest.mark.slow
def test_sharded_step_equals_single_device_with_one_compilation():
  """Data 2 x fsdp 2 x tensor 2 (the batch in 4 parts, parameters and Adam's moments split by
  their logical axes) == one device."""
  assert jax.device_count() == 8
  single_params, single_losses = run_steps("data=1")
  sharded_params, sharded_losses = run_steps(MESH_3D)
  np.testing.assert_allclose(sharded_losses, single_losses, atol=1e-5, rtol=0)
  assert single_losses[0] != single_losses[2]  # the parameters did move
  chex.assert_trees_all_close(sharded_params, single_params, atol=1e-5, rtol=0)


# Slow alone (~14 s: it compiles the step); ~1 s after the other step tests share that compilation.
@pytest.mark.slow
def test_non_finite_loss_skips_the_update():
  """Neither the parameters nor Adam's moments and count change (a finite gradient would move the
  moments even at the warmup's zero rate); the step counter and the learning-rate schedule's count
  advance together, so the rate in use stays schedule(step), the one the trainers log."""
  models, tx, states, data, fn = compiled_step("data=1")
  state = TrainState.create(apply_fn=None, params=make_params(models), tx=tx)
  before = jax.device_get(state)
  batch = make_batch()
  batch["mlm_weights"][0, 0] = np.nan  # -> NaN loss and gradients
  new, out = fn(jax.device_put(state, states), jax.device_put(batch, data), jax.random.key(0))
  assert float(out["skipped"]) == 1.0 and int(new.step) == 1
  chex.assert_trees_all_equal(jax.device_get(new.params), before.params)
  is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)
  split = lambda opt: jax.tree.flatten(jax.device_get(opt), is_leaf=is_schedule)[0]
  kinds = [is_schedule(x) for x in split(before.opt_state)]
  assert any(kinds) and not all(kinds)
  for old, now, schedule in zip(split(before.opt_state), split(new.opt_state), kinds):
    if schedule:
      assert int(old.count) == 0 and int(now.count) == 1
    else:
      chex.assert_trees_all_equal(now, old)
  _, ok = fn(new, jax.device_put(make_batch(), data), jax.random.key(0))
  assert float(ok["skipped"]) == 0.0


@pytest.mark.slow
def test_retriever_gradients_match_finite_differences():
  """Separate towers: d loss / d tower is non-zero and equals a central finite difference along a
  random direction in that tower's parameters, for the query and the document tower (float32, so
  the step is large and the tolerance loose; a missing path would give exactly zero)."""
  models = make_models(share=False, scale=3.0)
  params = make_params(models, seed=1)
  batch = make_batch(seed=2)
  loss = jax.jit(lambda p: realm_loss(p, batch, models)[0])
  grads = jax.jit(jax.grad(lambda p: realm_loss(p, batch, models)[0]))(params)
  for tower in ("query_embedder", "embedder"):
    g_tower = grads["retriever"][tower]
    assert float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g_tower)))) > 1e-4
    leaves, treedef = jax.tree.flatten(params["retriever"][tower])
    keys = jax.random.split(jax.random.key(3), len(leaves))
    direction = jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape)
                                             for k, x in zip(keys, leaves)])
    analytic = float(sum(jnp.sum(g * d) for g, d in
                         zip(jax.tree.leaves(g_tower), jax.tree.leaves(direction))))

    def moved(eps):
      new = jax.tree.map(lambda x: x, params)
      new["retriever"][tower] = jax.tree.map(lambda x, d: x + eps * d,
                                             params["retriever"][tower], direction)
      return float(loss(new))

    eps = 1e-4  # the loss is strongly curved along a direction that moves every weight
    numeric = (moved(eps) - moved(-eps)) / (2 * eps)
    assert abs(analytic) > 1e-3, tower
    np.testing.assert_allclose(numeric, analytic, rtol=2e-2, err_msg=tower)


@pytest.mark.slow
def test_loss_matches_hf_scorer_and_encoder():
  """realm_loss on a batch == HF RealmScorer relevance -> HF RealmKnowledgeAugEncoder loss, with
  the same (perturbed) weights, candidates and masked tokens; and its metrics (accuracy with
  retrieval and with the null document only, retrieval utility and the standard errors over
  examples, the same on the examples whose span was retrieved) == numpy on HF's relevance scores
  and MLM logits."""
  torch = pytest.importorskip("torch")
  realm_hf = pytest.importorskip("transformers.models.deprecated.realm.modeling_realm")
  from conftest import hf_realm_config
  from realm_jax.checkpoints import from_hf_state_dict
  hf_cfg = hf_realm_config(num_candidates=4)
  cfg = RealmConfig.from_dict(hf_cfg.to_dict())
  scorer = realm_hf.RealmScorer(hf_cfg)
  perturbed(scorer.embedder, seed=5)
  encoder = perturbed(realm_hf.RealmKnowledgeAugEncoder(hf_cfg), seed=6)
  params = {"retriever": from_hf_state_dict(scorer.state_dict(), "retriever", cfg)[0],
            "encoder": from_hf_state_dict(encoder.state_dict(), "encoder", cfg)[0]}
  models = RealmModels(RealmRetriever(cfg), KnowledgeAugEncoder(cfg))
  batch = make_batch(seed=4, b=3, k=4)
  batch["candidate_mask"][:] = 1  # HF has no notion of a missing candidate
  batch["span_found"] = np.array([1.0, 0.0, 1.0], np.float32)
  ours, _ = realm_loss(params, batch, models)

  t = lambda x: torch.as_tensor(np.asarray(x, np.int64))
  q, c, j = batch["query"], batch["candidates"], batch["joint"]
  b, k, le = j["input_ids"].shape
  labels = np.full((b, le), -100)
  for i in range(b):
    for p, y, w in zip(batch["mlm_positions"][i], batch["mlm_targets"][i], batch["mlm_weights"][i]):
      if w:
        labels[i, p] = y
  with torch.no_grad():
    rel = scorer(t(q["input_ids"]), attention_mask=t(q["attention_mask"]),
                 token_type_ids=t(q["token_type_ids"]), candidate_input_ids=t(c["input_ids"]),
                 candidate_attention_mask=t(c["attention_mask"]),
                 candidate_token_type_ids=t(c["token_type_ids"])).relevance_score
    flat = lambda name: t(j[name]).view(b * k, le)
    out = encoder(flat("input_ids"), attention_mask=flat("attention_mask"),
                  token_type_ids=flat("token_type_ids"), relevance_score=rel,
                  labels=t(labels), mlm_mask=t(labels != -100))
  np.testing.assert_allclose(float(ours), out.loss.item(), atol=1e-5, rtol=0)
  np.testing.assert_allclose(retriever_logits(params, batch, models), rel.numpy(), atol=1e-5)

  # The metrics, from HF's numbers with numpy.
  log_softmax = lambda x, axis: x - np.log(np.exp(x - x.max(axis, keepdims=True)).sum(
      axis, keepdims=True)) - x.max(axis, keepdims=True)
  retr_logp = log_softmax(rel.numpy().astype(np.float64), 1)                       # [b, k]
  logits = out.logits.numpy().astype(np.float64).reshape(b, k, le, -1)
  at = np.take_along_axis(logits, batch["mlm_positions"][:, None, :, None], 2)   # [b, k, m, V]
  vocab_logp = log_softmax(at, 3)
  joint = retr_logp[:, :, None, None] + vocab_logp
  marginal = np.log(np.exp(joint - joint.max(1, keepdims=True)).sum(1)) + joint.max(1)  # [b, m, V]
  # Targets (which do not change the logits) that each prediction gets right somewhere: the
  # marginal's argmax at the first masked position, the null document's at the second.
  y = batch["mlm_targets"].copy()
  y[:, 0], y[:, 1] = marginal[:, 0].argmax(-1), vocab_logp[:, 0, 1].argmax(-1)
  w = batch["mlm_weights"]
  pick = lambda lp: np.take_along_axis(lp, y[..., None], -1)[..., 0]
  correct, null_correct = marginal.argmax(-1) == y, vocab_logp[:, 0].argmax(-1) == y
  assert 0 < (correct * w).sum() < w.sum() and 0 < (null_correct * w).sum() < w.sum()
  utility = pick(marginal) - pick(vocab_logp[:, 0])
  batch["mlm_targets"] = y
  got = summarize(jax.device_get(realm_loss(params, batch, models)[1]))
  fw = w * batch["span_found"][:, None]
  want = {"loss": -(pick(marginal) * w).sum() / w.sum(),
          "accuracy": (correct * w).sum() / w.sum(),
          "null_accuracy": (null_correct * w).sum() / w.sum(),
          "retrieval_utility": (utility * w).sum() / w.sum(),
          "span_in_candidates": 2 / 3,
          "found_accuracy": (correct * fw).sum() / fw.sum(),
          "found_null_accuracy": (null_correct * fw).sum() / fw.sum(),
          "found_retrieval_utility": (utility * fw).sum() / fw.sum()}
  # Standard errors over examples, by the delta method for a ratio of sums (E / (E - 1)).
  n_e = w.sum(1)
  for key, per_token in (("retrieval_utility_se", utility), ("accuracy_gain_se",
                                                              correct * 1.0 - null_correct)):
    x_e = (per_token * w).sum(1)
    resid = x_e - x_e.sum() / n_e.sum() * n_e
    want[key] = np.sqrt((resid ** 2).sum() * b / (b - 1)) / n_e.sum()
    assert want[key] > 1e-3, key
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, atol=1e-5, rtol=0, err_msg=key)
  # Without any example whose span was retrieved there is nothing to report on them.
  batch["span_found"][:] = 0
  assert not any(k.startswith("found_") for k in summarize(realm_loss(params, batch, models)[1]))


def test_bert_schedule_and_decay_mask():
  sched = bert_schedule(1.0, total_steps=100, warmup_steps=10)
  np.testing.assert_allclose([sched(0), sched(5), sched(10), sched(55), sched(100)],
                             [0.0, 0.5, 1.0, 0.5, 0.0], atol=1e-6)
  default = bert_schedule(1.0, total_steps=5000)  # warmup min(10k, max(100, 500)) = 500
  np.testing.assert_allclose([default(250), default(500)], [0.5, 1.0], atol=1e-6)
  mask = decay_mask({"dense": {"kernel": 1, "bias": 2}, "LayerNorm": {"scale": 3, "bias": 4}})
  assert mask == {"dense": {"kernel": True, "bias": False},
                  "LayerNorm": {"scale": False, "bias": False}}


def assert_same_bert_outputs_and_gradients(cfg_a, cfg_b, dropout_rng):
  """One BertModel (every tower of the step is one), same parameters and [B, K, L] inputs under
  two configs: the sequence and pooled outputs and the gradient of a scalar of both agree up to
  float32 rounding of a differently arranged computation."""
  ids, mask, types = (jnp.asarray(a) for a in random_inputs(np.random.default_rng(3), (8, 4), 20,
                                                             CFG.vocab_size))
  params = jit_init(BertModel(cfg_a, add_pooling_layer=True), 0, ids, mask, types)
  w = jax.random.normal(jax.random.key(1), (CFG.hidden_size,))
  rngs = None if dropout_rng is None else {"dropout": dropout_rng}
  out = []
  for cfg in (cfg_a, cfg_b):
    model = BertModel(cfg, add_pooling_layer=True)

    def scalar(p, model=model):
      seq, pooled = model.apply({"params": p}, ids, mask, types, rngs is None, rngs=rngs)
      return jnp.sum(jnp.tanh(seq @ w) * mask) + jnp.sum(pooled @ w), (seq, pooled)

    out.append(jax.jit(jax.value_and_grad(scalar, has_aux=True))(params))
  ((va, outs_a), grads_a), ((vb, outs_b), grads_b) = out
  np.testing.assert_allclose(va, vb, rtol=1e-6)
  for a, b in zip(jax.tree.leaves((outs_a, grads_a)), jax.tree.leaves((outs_b, grads_b))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()) + 1e-9)


def test_num_chunks_by_hand():
  from realm_jax.models.bert import num_chunks
  assert num_chunks(64, 128, 0) == 1            # off
  assert num_chunks(64, 128, 8192) == 1         # fits in one
  assert num_chunks(64, 128, 2048) == 4         # 8192 / 2048
  assert num_chunks(64, 160, 2048) == 8         # 5 needed, 5 does not divide 64
  assert num_chunks(7, 10, 20) == 7             # prime row count: one row per chunk
  assert num_chunks(6, 100, 10) == 6            # a row longer than a chunk: one row per chunk


@pytest.mark.slow
def test_chunked_bert_calls_change_no_number():
  """config.chunk_tokens runs each BERT call in interleaved chunks of rows: the outputs and every
  gradient equal the unchunked model's."""
  assert_same_bert_outputs_and_gradients(CFG, CFG.replace(chunk_tokens=200),  # 640 tokens: 4 chunks
                                         dropout_rng=None)


@pytest.mark.slow
def test_layer_recomputation_changes_no_number():
  """config.remat recomputes each layer in the backward pass: the outputs and every gradient equal
  the plain model's (same parameters, same dropout) up to float32 rounding of a differently fused
  computation."""
  assert_same_bert_outputs_and_gradients(CFG.replace(remat=False), CFG.replace(remat=True),
                                         dropout_rng=jax.random.key(7))


@pytest.mark.slow
def test_memory_estimate_against_xla():
  """The estimate printed before a run counts the parameters exactly and stays within its margin
  below XLA's buffer assignment of the compiled step (tiny config: 1 device; 8 devices with a
  retriever of 1 layer beside the encoder's 2)."""
  import os
  import sys
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
  from memory import measured  # benchmarks/memory.py

  from realm_jax.configs.pretrain import get_config
  from realm_jax.train import memory
  from realm_jax.train.init import build_models
  for retriever_layers, devices in ((0, 1), (1, 8)):
    c = get_config("tiny")
    if retriever_layers:
      c.model.num_hidden_layers = 2  # (the tiny config has 1)
    c.retriever_num_layers = retriever_layers
    mc = memory.model_config(c)
    models, _, _ = build_models(c)
    real = {n: sum(x.size for x in jax.tree.leaves(_init(m, mc, jax.random.key(0))))
            for n, m in (("retriever", models.retriever), ("encoder", models.encoder))}
    est = memory.estimate(c, devices, 96, mc, platform="cpu")
    assert est["params"] == real
    step = sum(v for k, v in est["parts"].items() if k not in ("index shard", "search scratch"))
    xla = measured(c, mc, devices)["total"]
    assert step <= xla <= memory.MARGIN * step, (devices, step, xla)


def test_memory_estimate_counts_the_index_on_device_only_for_device_searchers():
  """An exact index shard is its rows x dim x bytes per device, hand-computed; ScaNN's index lives
  in host memory and takes none."""
  from realm_jax.configs.pretrain import get_config
  from realm_jax.train import memory
  c = get_config("tiny")
  mc = memory.model_config(c)
  rows, devices = 1000, 8
  exact = memory.estimate(c, devices, rows, mc, platform="cpu")["parts"]
  # 1000 rows over 8 devices, the 16-dim projection of the tiny model, float32; 8 queries.
  assert (c.init, mc.retriever_proj_size, c.batch_size) == ("random", 16, 8)
  assert exact["index shard"] == 125 * 16 * 4
  assert exact["search scratch"] == 8 * 125 * 4
  c.index.searcher = "scann"
  scann = memory.estimate(c, devices, rows, mc, platform="cpu")["parts"]
  assert scann["index shard"] == scann["search scratch"] == 0
  assert {k: v for k, v in scann.items() if "index" not in k and "search" not in k} == {
      k: v for k, v in exact.items() if "index" not in k and "search" not in k}


def test_retriever_learning_rate_applies_to_the_retriever_towers_only():
  """config.retriever_learning_rate: Adam's first update is -lr * g / (|g| + eps) per element, so
  each part moves by its own rate; -1 (the default) gives every part config.learning_rate."""
  from ml_collections import ConfigDict
  from realm_jax.train.optimizer import from_config
  params = {"retriever": {"w": jnp.ones(3)}, "encoder": {"w": jnp.ones(3)}}
  g = jnp.array([1.0, -2.0, 0.5])
  grads = {"retriever": {"w": g}, "encoder": {"w": 3 * g}}
  step = lambda a, b: np.asarray(-a * b / (np.abs(b) + 1e-6))
  for retriever_lr, want_r in ((1e-4, 1e-4), (-1.0, 1e-3)):
    config = ConfigDict(dict(learning_rate=1e-3, retriever_learning_rate=retriever_lr,
                             num_steps=10, warmup_steps=0, weight_decay=0.0, clip_norm=100.0))
    schedule, tx = from_config(config)
    assert float(schedule(0)) == pytest.approx(1e-3)
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["retriever"]["w"], step(want_r, g), rtol=1e-5)
    np.testing.assert_allclose(updates["encoder"]["w"], step(1e-3, 3 * g), rtol=1e-5)


@pytest.mark.slow
def test_a_new_mlm_head_can_start_from_the_identity(tmp_path):
  """config.mlm_transform_init='identity': the head's logits are then the tied word embeddings
  against LayerNorm(GELU(h)) (checked with torch); a head loaded from a checkpoint is never
  overwritten. config.query_hides_mask gives the query tower the vocabulary's [MASK] id."""
  import torch
  from realm_jax.checkpoints import save_hf_checkpoint
  from realm_jax.checkpoints.hf import abstract_params
  from realm_jax.configs.pretrain import get_config
  from realm_jax.text import BertTokenizer
  from realm_jax.train.init import build_models, init_params
  config = get_config("tiny")
  config.mlm_transform_init, config.query_hides_mask = "identity", True
  models, model_config, vocab = build_models(config)
  assert models.retriever.query_ignore_id == BertTokenizer(vocab).mask_id == 103
  params = init_params(config, models, model_config, jax.random.key(0))["encoder"]
  h = model_config.hidden_size
  dense = params["cls"]["predictions"]["transform"]["dense"]
  np.testing.assert_array_equal(dense["kernel"], np.eye(h))
  np.testing.assert_array_equal(dense["bias"], np.zeros(h))

  ids, mask, types = (jnp.asarray(a) for a in random_inputs(np.random.default_rng(0), (2, 1), 12,
                                                             1000, min_len=6))
  positions = np.array([[1, 4], [2, 3]])
  logits = models.encoder.apply({"params": params}, ids, mask, types, jnp.asarray(positions))
  seq, _ = BertModel(model_config, add_pooling_layer=True).apply(
      {"params": params["realm"]}, ids, mask, types)
  hidden = torch.from_numpy(np.take_along_axis(np.asarray(seq), positions[:, None, :, None], 2))
  approx = "tanh" if model_config.hidden_act == "gelu_new" else "none"
  x = torch.nn.functional.layer_norm(torch.nn.functional.gelu(hidden, approximate=approx), (h,),
                                     eps=model_config.layer_norm_eps)
  words = torch.from_numpy(np.array(params["realm"]["embeddings"]["word_embeddings"]["embedding"]))
  np.testing.assert_allclose(logits, (x @ words.T).numpy(), rtol=1e-4, atol=1e-4)

  config.mlm_transform_init = "ones"
  with pytest.raises(ValueError, match="mlm_transform_init='ones': use one of"):
    init_params(config, models, model_config, jax.random.key(0))
  config.init, config.mlm_transform_init = "hf", "identity"
  config.retriever_weights, config.encoder_weights = str(tmp_path / "r"), str(tmp_path / "e")
  for kind, path in (("retriever", config.retriever_weights), ("encoder", config.encoder_weights)):
    save_hf_checkpoint(path, model_config, jax.tree.map(
        lambda s: np.zeros(s.shape, np.float32), abstract_params(kind, model_config)), kind)
  (tmp_path / "r" / "vocab.txt").write_text(open(vocab).read())
  models, model_config, _ = build_models(config)
  with pytest.raises(ValueError, match="would overwrite the MLM head of .*e; keep the default"):
    init_params(config, models, model_config, jax.random.key(0))


@pytest.mark.slow
def test_the_retriever_can_keep_fewer_layers_of_the_weights():
  """config.retriever_num_layers: the retriever keeps the first N of the MiniLM layers the encoder
  keeps (config.num_layers), with the weights of those layers; more than the encoder is refused."""
  from flax import traverse_util
  from realm_jax.checkpoints.minilm import load_minilm
  from realm_jax.configs.pretrain import get_config
  from realm_jax.train.init import build_models, init_params
  config = get_config("demo")
  config.num_layers, config.retriever_num_layers = 3, 1
  models, model_config, _ = build_models(config)
  assert model_config.num_hidden_layers == 3
  assert models.retriever.config.num_hidden_layers == 1
  assert models.encoder.config.num_hidden_layers == 3
  params = init_params(config, models, model_config, jax.random.key(0))
  layers = lambda tree: sorted(tree["realm"]["encoder"])
  assert layers(params["retriever"]["embedder"]) == ["layer_0"]
  assert layers(params["encoder"]) == ["layer_0", "layer_1", "layer_2"]
  _, bert, _ = load_minilm()
  want = traverse_util.flatten_dict(bert["encoder"]["layer_0"])
  for tree in (params["retriever"]["embedder"], params["encoder"]):
    got = traverse_util.flatten_dict(tree["realm"]["encoder"]["layer_0"])
    assert got.keys() == want.keys()
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])
  config.retriever_num_layers = 4
  with pytest.raises(ValueError, match="retriever_num_layers=4 is more than the 3 layers"):
    build_models(config)
  config.retriever_num_layers = -1
  with pytest.raises(ValueError, match="retriever_num_layers=-1: give 0"):
    build_models(config)


def test_a_smaller_retriever_loads_the_first_layers_of_hf_weights(tmp_path):
  """config.init='hf' with config.retriever_num_layers: the retriever takes the first N layers of
  a deeper HF retriever checkpoint, the encoder all of its own."""
  from flax import traverse_util
  import os
  from realm_jax.checkpoints import save_hf_checkpoint
  from realm_jax.checkpoints.hf import abstract_params
  from realm_jax.checkpoints.minilm import minilm_dir
  from realm_jax.configs.pretrain import get_config
  from realm_jax.train.init import build_models, init_params
  config = get_config("tiny")
  config.init, config.retriever_num_layers = "hf", 1
  config.retriever_weights, config.encoder_weights = str(tmp_path / "r"), str(tmp_path / "e")
  config.vocab_file = os.path.join(minilm_dir(), "vocab.txt")
  config.model.num_hidden_layers = 2  # (the tiny config has 1)
  model_config = RealmConfig(**dict(config.model))
  rng = np.random.default_rng(0)
  saved = {}
  for kind, path in (("retriever", config.retriever_weights), ("encoder", config.encoder_weights)):
    saved[kind] = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32),
                               abstract_params(kind, model_config))
    save_hf_checkpoint(path, model_config, saved[kind], kind)
  models, got_config, _ = build_models(config)
  params = init_params(config, models, got_config, jax.random.key(0))
  embedder = params["retriever"]["embedder"]["realm"]["encoder"]
  assert sorted(embedder) == ["layer_0"]
  assert sorted(params["encoder"]["realm"]["encoder"]) == ["layer_0", "layer_1"]
  want = traverse_util.flatten_dict(saved["retriever"]["embedder"]["realm"]["encoder"]["layer_0"])
  got = traverse_util.flatten_dict(embedder["layer_0"])
  assert got.keys() == want.keys()
  for key in want:
    np.testing.assert_array_equal(got[key], want[key])


@pytest.mark.slow
def test_a_bert_encoder_keeps_its_pretrained_mlm_head(tmp_path):
  """config.init='hf' with a HF BertForPreTraining (bert-base-uncased's layout) as encoder_weights:
  the encoder's MLM logits are HF's `prediction_logits`, head included; an identity head would
  overwrite it and is refused."""
  import os
  import torch
  from transformers import BertConfig, BertForPreTraining
  from realm_jax.checkpoints import save_hf_checkpoint
  from realm_jax.checkpoints.hf import abstract_params
  from realm_jax.checkpoints.minilm import minilm_dir
  from realm_jax.configs.pretrain import get_config
  from realm_jax.train.init import build_models, init_params
  config = get_config("tiny")
  config.init = "hf"
  config.retriever_weights, config.encoder_weights = str(tmp_path / "r"), str(tmp_path / "e")
  config.vocab_file = os.path.join(minilm_dir(), "vocab.txt")
  model_config = RealmConfig(**dict(config.model))
  save_hf_checkpoint(config.retriever_weights, model_config, jax.tree.map(
      lambda s: np.zeros(s.shape, np.float32), abstract_params("retriever", model_config)),
                     "retriever")
  c = model_config
  torch.manual_seed(0)
  bert = perturbed(BertForPreTraining(BertConfig(
      vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
      num_attention_heads=c.num_attention_heads, intermediate_size=c.intermediate_size,
      max_position_embeddings=c.max_position_embeddings, hidden_act=c.hidden_act)))
  bert.save_pretrained(config.encoder_weights, safe_serialization=True)
  models, got_config, _ = build_models(config)
  params = init_params(config, models, got_config, jax.random.key(0))

  ids, mask, types = random_inputs(np.random.default_rng(0), (3,), 12, c.vocab_size, min_len=6)
  logits = models.encoder.apply({"params": params["encoder"]}, *(jnp.asarray(a[:, None])
                                                                  for a in (ids, mask, types)))
  with torch.no_grad():
    want = bert(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                token_type_ids=torch.from_numpy(types)).prediction_logits.numpy()
  real = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(logits)[:, 0][real], want[real], rtol=1e-4, atol=1e-4)

  config.mlm_transform_init = "identity"
  with pytest.raises(ValueError, match="would overwrite the MLM head of .*e; keep the default"):
    init_params(config, models, got_config, jax.random.key(0))


@pytest.mark.slow
def test_without_the_null_document_the_loss_is_that_of_the_other_candidates():
  """candidate_mask[:, 0] = 0 (config.null_document=False) gives the loss and retrieval log
  probabilities of the same batch with candidate 0 removed altogether."""
  models = make_models()
  params = make_params(models)
  batch = make_batch(seed=3)
  batch["candidate_mask"][:, 0] = 0.0
  loss_fn = jax.jit(functools.partial(realm_loss, models=models))
  loss, stats = loss_fn(params, batch)
  cut = dict(batch)
  for name in ("candidates", "joint"):
    cut[name] = {n: x[:, 1:] for n, x in batch[name].items()}
  cut["candidate_mask"] = batch["candidate_mask"][:, 1:]
  want, want_stats = loss_fn(params, cut)
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
  assert float(stats["null_prob_sum"]) == 0.0
  np.testing.assert_allclose(float(stats["entropy_sum"]), float(want_stats["entropy_sum"]),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_frozen_retriever_keeps_its_weights_and_clips_the_encoder_alone():
  """config.retriever_learning_rate=0: the step stops the retriever's gradient (the global norm is
  the encoder's alone, from jax.grad of the loss in the encoder only) and the optimiser leaves it
  as it was; the encoder moves."""
  from ml_collections import ConfigDict
  from realm_jax.train.optimizer import from_config
  models = RealmModels(RealmRetriever(CFG), KnowledgeAugEncoder(CFG), 1.0, train_retriever=False)
  params = make_params(models)
  batch = make_batch(seed=1)
  config = ConfigDict(dict(learning_rate=1e-3, retriever_learning_rate=0.0, num_steps=10,
                           warmup_steps=0, weight_decay=0.01, clip_norm=1.0))
  _, tx = from_config(config)
  state = TrainState.create(apply_fn=None, params=params, tx=tx)
  new, out = jax.jit(functools.partial(train_step, models=models, dropout=False))(
      state, batch, jax.random.key(0))
  encoder_grads = jax.jit(jax.grad(
      lambda e: realm_loss({**params, "encoder": e}, batch, models)[0]))(params["encoder"])
  np.testing.assert_allclose(float(out["grad_norm"]), float(optax.tree.norm(encoder_grads)),
                             rtol=1e-5)
  chex.assert_trees_all_equal(new.params["retriever"], params["retriever"])
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                                       new.params["encoder"], params["encoder"]))
  assert max(moved) > 1e-4
