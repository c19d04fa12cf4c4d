"""Steps in pieces (pre-training's config.microbatch, fine-tuning's config.reader_microbatch):
dropout masks that do not depend on the pieces, and steps whose loss, statistics and gradient equal
the whole batch's, on one device and sharded over 8, with a fraction of its memory."""

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import forked_runs
from conftest import ROOT, one_device_env
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
import test_train_step as pre
from test_qa_step import CFG, MODELS, make_batch, make_params

from realm_jax.models import BertModel
from realm_jax.models import dropout as dropout_lib
from realm_jax.models.dropout import Dropout, Rows, bernoulli_rows
from realm_jax.train.loop import microbatch_pieces
from realm_jax.train.qa_step import qa_loss_and_grads
from realm_jax.train.realm_step import realm_loss_and_grads

KEYS = {"typed": lambda: jax.random.fold_in(jax.random.key(3), 7),
        "raw": lambda: jax.random.PRNGKey(5)}


@pytest.mark.parametrize("key,partitioned", [("typed", True), ("raw", True), ("typed", False)])
def test_bernoulli_rows_are_those_rows_of_the_whole_mask(key, partitioned, monkeypatch):
  """From threefry's counters, and (another PRNG setting) by slicing the whole mask."""
  monkeypatch.setattr(dropout_lib, "_counter_partitioned", lambda: partitioned)
  k = KEYS[key]()
  whole = np.asarray(jax.random.bernoulli(k, 0.9, (12, 3, 5, 7)))
  for ids in ([11, 2, 5, 3, 3], list(range(12))):
    got = jax.jit(lambda k, i: bernoulli_rows(k, 0.9, (len(ids), 3, 5, 7), Rows(i, 12)))(
        k, jnp.asarray(ids, jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), whole[ids])
  assert 0.85 < whole.mean() < 0.95


class _Two(nn.Module):
  """Two dropouts in a row, auto-named as in the BERT layers."""
  cls: type

  @nn.compact
  def __call__(self, x, rows=None):
    extra = {} if rows is None else {"rows": rows}
    return self.cls(0.3)(self.cls(0.1)(x, False, **extra), False, **extra)


def test_dropout_is_flax_dropout_and_rows_get_their_mask():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(10, 4, 6)), jnp.float32)
  rngs = {"dropout": jax.random.key(1)}
  ours = _Two(Dropout).apply({}, x, rngs=rngs)
  flax = _Two(nn.Dropout).apply({}, x, rngs=rngs)
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(flax))
  assert 0.55 < float(jnp.mean(ours != 0)) < 0.7  # kept: 0.9 * 0.7 = 0.63
  ids = jnp.asarray([7, 1, 8], jnp.int32)
  part = _Two(Dropout).apply({}, x[ids], Rows(ids, 10), rngs=rngs)
  np.testing.assert_array_equal(np.asarray(part), np.asarray(ours)[np.asarray(ids)])


def test_bert_on_some_rows_drops_what_the_whole_batch_drops():
  """A [B, R, L] input: questions 1 and 3 of 4 alone give their rows of the whole call, with
  dropout on (embeddings, attention probabilities, hidden states)."""
  model = BertModel(CFG, add_pooling_layer=False)
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(1, CFG.vocab_size, (4, 3, 10)), jnp.int32)
  mask = jnp.ones_like(ids).at[:, :, 8:].set(0)
  params = jax.jit(model.init)(jax.random.key(0), ids)
  apply = jax.jit(lambda p, i, m, rows: model.apply(p, i, m, None, False, rows,
                                                    rngs={"dropout": jax.random.key(9)})[0])
  whole = np.asarray(apply(params, ids, mask, None))
  no_dropout = np.asarray(model.apply(params, ids, mask)[0])
  assert np.abs(whole - no_dropout).max() > 0.1
  pick = jnp.asarray([1, 3], jnp.int32)
  part = np.asarray(apply(params, ids[pick], mask[pick], Rows(pick, 4)))
  np.testing.assert_allclose(part, whole[np.asarray(pick)], rtol=1e-6, atol=1e-6)


def _with_words(batch, seed=1):
  rng = np.random.default_rng(seed)
  shape = batch["reader"]["input_ids"].shape
  return {**batch, "word_start": (rng.random(shape) < 0.8).astype(np.int32),
          "word_end": (rng.random(shape) < 0.8).astype(np.int32)}


def _assert_same(got, want, tol=1e-5):
  (loss, sums), grads = got
  (want_loss, want_sums), want_grads = want
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=tol)
  for k in want_sums:
    np.testing.assert_allclose(float(sums[k]), float(want_sums[k]), rtol=tol, atol=tol, err_msg=k)
  flat, want_flat = jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)
  assert len(flat) == len(want_flat)
  scale = max(float(jnp.abs(g).max()) for g in want_flat)
  for (path, g), w in zip(flat, want_flat):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=tol * scale,
                               err_msg=jax.tree_util.keystr(path))


def _compiled(pieces, shardings=None):
  fn = lambda p, b, r: qa_loss_and_grads(p, b, MODELS, r, pieces)
  return jax.jit(fn, **(shardings or {})).lower(*_inputs()).compile()


def _inputs():
  return make_params(), _with_words(make_batch(b=16)), jax.random.key(4)


@pytest.fixture(scope="module")
def whole_batch():
  """The step's loss, sums and gradient with the reader on all 16 questions at once (dropout on),
  and the compiled program's temporary memory."""
  compiled = _compiled(1)
  got = compiled(*_inputs())
  assert float(got[0][1]["reader_loss_sum"]) > 0 and float(got[0][1]["answer_in_read"]) > 0
  return got, compiled.memory_analysis().temp_size_in_bytes


def test_pieces_give_the_whole_batch_loss_and_gradient_in_less_memory(whole_batch):
  want, want_temp = whole_batch
  compiled = _compiled(8)
  _assert_same(compiled(*_inputs()), want)
  assert compiled.memory_analysis().temp_size_in_bytes < 0.5 * want_temp


def test_pieces_sharded_over_8_devices_equal_one_device(whole_batch):
  if jax.device_count() < 8:
    pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (set by conftest)")
  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  data, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  sharded = _compiled(2, {"in_shardings": (rep, data, rep), "out_shardings": rep})
  _assert_same(sharded(*_inputs()), whole_batch[0])


def _pretrain_inputs():
  models = pre.make_models()
  batch = pre.make_batch(b=16)
  batch["mlm_weights"][3] = 0  # an example without a masked token: its piece still counts right
  return models, (pre.make_params(models), batch, jax.random.key(2))


@pytest.mark.slow
def test_pretraining_pieces_give_the_whole_batch_loss_and_gradient():
  models, inputs = _pretrain_inputs()
  fn = lambda n: jax.jit(lambda p, b, r: realm_loss_and_grads(p, b, models, r, n)).lower(
      *inputs).compile()
  whole, four = fn(1), fn(4)
  want = whole(*inputs)
  # 1e-4 of the largest gradient, as for the other re-arranged steps (test_train_step): float32
  # sums in another order through the retriever's softmax; the loss agrees to the last digit.
  _assert_same(four(*inputs), want, tol=1e-4)
  temp = lambda compiled: compiled.memory_analysis().temp_size_in_bytes
  assert temp(four) < 0.6 * temp(whole)
  if jax.device_count() >= 8:  # sharded over 8 devices, 2 examples each, in 2 pieces
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    data, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    sharded = jax.jit(lambda p, b, r: realm_loss_and_grads(p, b, models, r, 2),
                      in_shardings=(rep, data, rep), out_shardings=rep)
    _assert_same(sharded(*inputs), want, tol=1e-4)


def test_reader_pieces_from_the_config():
  from realm_jax.configs.finetune import get_config
  c = get_config("tiny")
  c.batch_size, c.reader_microbatch = 16, 0
  pieces = lambda devices: microbatch_pieces(c, "reader_microbatch", devices)
  assert pieces(1) == 1
  c.reader_microbatch = 2
  assert (pieces(1), pieces(4), pieces(8)) == (8, 2, 1)
  for bad, devices in ((3, 1), (4, 8), (-1, 1)):
    c.reader_microbatch = bad
    with pytest.raises(ValueError, match="--config.reader_microbatch"):
      pieces(devices)


@pytest.mark.slow
def test_finetune_refuses_a_microbatch_that_does_not_divide_the_batch(tmp_path):
  got = forked_runs.run(
      [sys.executable, "experiments/finetune.py", "--config=realm_jax/configs/finetune.py:tiny",
       f"--workdir={tmp_path}/qa", "--config.reader_microbatch=3"],
      cwd=ROOT, env=one_device_env(), capture_output=True, text=True, timeout=300)
  assert got.returncode == 2, got.stderr[-2000:]
  last = got.stderr.strip().splitlines()[-1]
  assert last.startswith("error:") and "--config.reader_microbatch=3" in last, last
  assert not (tmp_path / "qa" / "corpus").exists()  # refused before any work


def test_dropout_rows_refuse_chunked_bert_calls():
  model = BertModel(CFG.replace(chunk_tokens=20), add_pooling_layer=False)
  ids = jnp.ones((4, 10), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(0), ids)
  with pytest.raises(ValueError, match="chunk_tokens=0"):
    model.apply(params, ids, None, None, False, Rows(jnp.arange(4), 8),
                rngs={"dropout": jax.random.key(1)})
