"""realm_jax/train/loop.py: the one training loop, on a toy least-squares trainer over 8 fake
devices, against a plain loop written here (same data, same optax update, one device)."""

import gzip
import json
import os

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from realm_jax.data.pretrain import default_read_options
from realm_jax.train import loop, profile
from realm_jax.train.realm_step import loss_step

DIM, ROWS, LR = 4, 64, 0.05
W_TRUE = np.arange(1, DIM + 1, dtype=np.float32)


def _row(i: int) -> dict:
  x = np.random.default_rng(int(i)).normal(size=DIM).astype(np.float32)
  return {"x": x, "y": np.float32(x @ W_TRUE)}


def _rows(seed: int):
  """grain iterator of batches of 8 rows, reshuffled every epoch: checkpointable; read ahead as
  the trainers read (with grain's defaults, ~15 CPU-seconds of this file went to rows no step
  took)."""
  ds = grain.MapDataset.range(ROWS).shuffle(seed=seed).repeat().map(_row).batch(8)
  return iter(ds.to_iter_dataset(default_read_options()))


def _loss(params, batch, poison=None):
  err = batch["x"] @ params["w"] - batch["y"]                      # [B]
  loss = jnp.mean(err**2)
  if poison is not None:  # a NaN loss while the step counter is in `poison` (a traced array)
    loss = jnp.where(poison, jnp.nan, loss)
  return loss, {"loss": loss}


def _config(**kw):
  c = ml_collections.ConfigDict(dict(
      batch_size=8, num_steps=6, seed=0, log_every=2, eval_every=3, checkpoint_every=2,
      keep_checkpoints=2, max_bad_steps=2, nan_steps=()))
  c.update(kw)
  return c


class Toy(loop.TrainLoop):
  """Least squares y = x . w with SGD; evaluation: the loss on 16 fixed rows."""
  name = "toy"

  def __init__(self, config, workdir):
    super().__init__(config, workdir)
    self.evaluations, self.finished = [], None
    self.data_iterator = _rows(config.seed)
    nan_steps = jnp.asarray(list(config.nan_steps) or [-1])

    def step(state, batch, rng):
      poison = jnp.isin(state.step, nan_steps)
      return loss_step(state, lambda p, r: _loss(p, batch, poison), rng, dropout=False)

    self.eval_fn = self.jit_eval(lambda p, b: _loss(p, b)[1])
    self.start({"w": np.zeros(DIM, np.float32)}, optax.sgd(LR), step)

  def next_batch(self):
    return self.put(next(self.data_iterator))

  def train_metrics(self, step):
    return {"learning_rate": LR}

  def evaluate(self):
    batch = {k: np.stack([_row(1000 + i)[k] for i in range(16)]) for k in ("x", "y")}
    out = {k: float(v) for k, v in jax.device_get(self.eval_fn(self.state.params,
                                                               self.put(batch))).items()}
    self.evaluations.append(int(self.state.step))
    return out

  def finish(self, last_eval, trained):
    self.finished = trained
    return last_eval


def _plain(steps: int, grad_norms: list | None = None) -> np.ndarray:
  """The same training without the loop: one device, plain optax; each step's gradient norm is
  appended to `grad_norms` if given."""
  it, w, opt = _rows(0), np.zeros(DIM, np.float32), optax.sgd(LR)
  state = opt.init({"w": w})
  params = {"w": jnp.asarray(w)}
  for _ in range(steps):
    batch = next(it)
    grads = jax.grad(lambda p: _loss(p, batch)[0])(params)
    if grad_norms is not None:
      grad_norms.append(float(np.sqrt(np.sum(np.asarray(grads["w"], np.float64) ** 2))))
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return np.asarray(params["w"])


def _rows_of(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def test_a_run_trains_like_a_plain_loop_logs_evaluates_and_checkpoints_on_cadence(tmp_path):
  workdir = str(tmp_path / "w")
  toy = Toy(_config(), workdir)
  last = toy.run()
  np.testing.assert_allclose(np.asarray(toy.state.params["w"]), _plain(6), rtol=1e-5, atol=1e-6)
  # Step 0 of a fresh run, every eval_every steps and the last step.
  assert toy.evaluations == [0, 3, 6] and toy.finished is True
  rows = _rows_of(workdir)
  assert [(r["split"], r["step"]) for r in rows] == [
      ("heldout", 0), ("train", 2), ("heldout", 3), ("train", 4), ("train", 6), ("heldout", 6)]
  train = [r for r in rows if r["split"] == "train"]
  for r in train:
    assert {"loss", "grad_norm", "skipped", "learning_rate", "examples_per_s"} <= set(r)
    assert r["examples_per_s"] > 0 and r["skipped"] == 0
  assert last == {k: v for k, v in rows[-1].items() if k not in ("step", "split")}
  steps = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
  assert steps == [4, 6]  # every checkpoint_every steps, the last 2 kept


def test_a_resumed_run_continues_where_it_stopped_without_evaluating_step_0_again(tmp_path):
  workdir = str(tmp_path / "w")
  Toy(_config(num_steps=4), workdir).run()
  again = Toy(_config(), workdir)
  again.run()
  assert again.evaluations == [6]  # not 0 again: the run resumed at step 4
  np.testing.assert_allclose(np.asarray(again.state.params["w"]), _plain(6), rtol=1e-5,
                             atol=1e-6)
  done = Toy(_config(), workdir)
  assert done.run() == {} and done.finished is False and done.evaluations == []


def test_logged_gradient_norm_is_the_mean_over_its_window(tmp_path):
  """Logged every 4 of 6 steps, the windows hold 4 and then 2 steps: each logged grad_norm is the
  mean of the gradient norms of those steps, computed here by a plain loop over the same batches
  (every trainer logs through this loop)."""
  workdir = str(tmp_path / "w")
  Toy(_config(log_every=4, eval_every=0), workdir).run()
  got = {r["step"]: r["grad_norm"] for r in _rows_of(workdir) if r["split"] == "train"}
  norms = []
  _plain(6, norms)
  assert sorted(got) == [4, 6]
  np.testing.assert_allclose(got[4], np.mean(norms[:4]), rtol=1e-5)
  np.testing.assert_allclose(got[6], np.mean(norms[4:]), rtol=1e-5)


def test_eval_every_0_never_evaluates(tmp_path):
  toy = Toy(_config(eval_every=0), str(tmp_path / "w"))
  assert toy.run() == {} and toy.evaluations == []
  assert all(r["split"] == "train" for r in _rows_of(str(tmp_path / "w")))


def test_non_finite_steps_are_skipped_and_max_bad_steps_in_a_row_stop_the_run(tmp_path):
  workdir = str(tmp_path / "w")
  toy = Toy(_config(nan_steps=(2,), eval_every=0, num_steps=4), workdir)
  toy.run()  # one bad step: skipped, the run goes on
  rows = [r for r in _rows_of(workdir) if r["split"] == "train"]
  assert [r["skipped"] for r in rows] == [0, 1]
  # Step 2 changed nothing: the parameters are those of 3 good steps on batches 1, 2 and 4.
  it, params = _rows(0), {"w": jnp.zeros(DIM)}
  for i in range(4):
    batch = next(it)
    if i != 2:
      params = jax.tree.map(lambda p, g: p - LR * g, params,
                            jax.grad(lambda p: _loss(p, batch)[0])(params))
  np.testing.assert_allclose(np.asarray(toy.state.params["w"]), params["w"], rtol=1e-5,
                             atol=1e-6)
  stopped = Toy(_config(nan_steps=(1, 2), eval_every=0), str(tmp_path / "x"))
  with pytest.raises(FloatingPointError, match="2 steps in a row had a non-finite loss"):
    stopped.run()


def test_profiled_steps_leave_a_trace_and_a_table_and_train_the_same(tmp_path, caplog):
  caplog.set_level("INFO")
  workdir = str(tmp_path / "w")
  toy = Toy(_config(eval_every=0, profile_start=2, profile_steps=3), workdir)
  toy.run()
  np.testing.assert_allclose(np.asarray(toy.state.params["w"]), _plain(6), rtol=1e-5, atol=1e-6)
  [message] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Profile of")]
  assert message.startswith("Profile of steps 2-4 (3 steps): ")
  trace = profile.newest_trace(os.path.join(workdir, "tb"))
  assert trace is not None and os.path.dirname(trace) in message
  with gzip.open(trace, "rt") as f:
    times = profile.op_times(json.load(f))
  # The table's rows are the trace's op kinds, slowest first, per step.
  rows = [line.split() for line in message.splitlines()[1:]]
  slowest = sorted(times, key=lambda k: -times[k][0])[:len(rows)]
  assert [r[0] for r in rows] == slowest
  assert float(rows[0][1].replace(",", "")) == pytest.approx(times[slowest[0]][0] / 1e3 / 3,
                                                             abs=0.05)


def test_a_profile_running_past_the_last_step_ends_with_the_run(tmp_path, caplog):
  caplog.set_level("INFO")
  Toy(_config(eval_every=0, profile_start=4, profile_steps=5), str(tmp_path / "w")).run()
  assert [r.getMessage().split(":")[0] for r in caplog.records
          if r.getMessage().startswith("Profile of")] == ["Profile of steps 4-5 (2 steps)"]


def test_a_profile_into_a_remote_workdir_is_refused(tmp_path):
  with pytest.raises(ValueError, match="profile_steps=2 writes its trace into the work directory"):
    Toy(_config(profile_steps=2), "gs://bucket/run")


def test_a_batch_the_devices_cannot_split_is_refused(tmp_path):
  with pytest.raises(ValueError, match="batch_size=12 is not divisible by the 8 parts"):
    Toy(_config(batch_size=12), str(tmp_path / "w"))


def test_a_window_leaves_out_the_statistics_of_skipped_steps():
  good = lambda loss: {"loss_sum": np.float32(loss), "grad_norm": np.float32(2 * loss),
                       "skipped": np.float32(0)}
  bad = {"loss_sum": np.float32(np.nan), "grad_norm": np.float32(np.inf), "skipped": np.float32(1)}
  sums = None
  for out in (good(1.0), bad, good(3.0), bad):
    sums = loop.add_step(sums, out)
  assert {k: float(v) for k, v in sums.items()} == {
      "loss_sum": 4.0, "grad_norm": 8.0, "skipped": 2.0, "good_steps": 2.0}
  only_bad = loop.add_step(None, bad)
  assert float(only_bad["good_steps"]) == 0 and float(only_bad["skipped"]) == 1
  assert np.isfinite(float(only_bad["loss_sum"]))


def test_progress_bar_fields_show_nan_for_what_a_window_lacks():
  assert loop.postfix({"loss": 1.23456, "examples_per_s": 7.66}, loss=("loss", ".3f"),
                      acc=("accuracy", ".3f"), ex_s=("examples_per_s", ".1f")) == {
                          "loss": "1.235", "acc": "nan", "ex_s": "7.7"}


def test_the_dropout_key_is_drawn_by_the_configs_generator(tmp_path):
  """config.rng_impl: the key the loop hands every step is seed + 1 of that jax.random generator
  (threefry2x32 where the config names none); an unknown one is refused, naming the flag."""
  for impl in ("rbg", "threefry2x32", None):
    config = _config(seed=4) if impl is None else _config(seed=4, rng_impl=impl)
    rng = Toy(config, str(tmp_path / str(impl))).rng
    want = jax.random.key(5, impl=impl or "threefry2x32")
    assert str(jax.random.key_impl(rng)) == str(jax.random.key_impl(want))
    np.testing.assert_array_equal(jax.random.key_data(rng), jax.random.key_data(want))
  with pytest.raises(ValueError, match="--config.rng_impl='philox': use one of threefry2x32"):
    Toy(_config(rng_impl="philox"), str(tmp_path / "bad"))


def test_a_nested_setting_added_later_takes_the_value_older_runs_used():
  """A work directory whose config.json predates retrieval.num_layers (fine-tuning's retrieval
  config) resumes with 0, the value it ran with, and is refused with another."""
  old = {"retrieval": {"weights": "minilm"}, "seed": 0}
  now = lambda n: {"retrieval": {"weights": "minilm", "num_layers": n}, "seed": 0}
  assert loop.config_diff(old, now(0), ["retrieval", "seed"]) == []
  assert loop.config_diff(old, now(1), ["retrieval", "seed"]) == [
      ("retrieval", now(0)["retrieval"], now(1)["retrieval"])]
