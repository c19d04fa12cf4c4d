"""The one training loop of realm_jax: pre-training, ICT and open-QA fine-tuning each subclass
`TrainLoop` and supply only what is their own.

    TrainLoop.__init__      mesh of config.mesh over every device (realm_jax/sharding.py), batch split
                            along "data" and "fsdp" (cheap, writes nothing)
    subclass __init__       its checks, data, models, parameters; then `start(params, tx, step)`:
                            the state split as the parameters' logical axes say, the donated
                            jitted step, checkpoints, metrics
    run()                   resume -> [evaluate at step 0] -> steps -> log / evaluate / checkpoint
                            -> finish (export, keep the best ...)

What a subclass brings (hooks, each with a plain default):
    next_batch()            the global batch of the next step (host work: retrieval, refresh ...)
    summarize(sums)         a logging window's metrics from the summed step outputs
    train_metrics(step)     more of them (learning rates, index staleness ...)
    evaluate()              held-out / dev metrics; evaluated(step, metrics) acts on them
    checkpoint_meta(step)   the JSON saved beside the state; resumed(meta) reads it back
    finish(last_eval, trained), close()

The same for every trainer, defined here once:
- `log_every` (>= 1), `eval_every` (>= 0; 0 = never) and `checkpoint_every` (>= 1) count steps:
  each fires when the number of steps done is a multiple of it, and at the last step.
- Step 0: a run that starts from scratch (not a resumed one) evaluates before its first step when
  eval_every > 0, so every curve starts from the starting weights.
- `examples_per_s` = examples trained in a logging window (config.batch_size per step) / the
  seconds spent making their batches (retrieval and index refresh included) and running their
  steps; evaluation, checkpointing and logging are not counted.
- A step whose loss or gradient is not finite changes nothing (the step function skips it); the
  run stops after `max_bad_steps` of them in a row, keeping its newest good checkpoint.
- Checkpoints hold the state, `checkpoint_meta` and, when the subclass has one, its data iterator
  (`data_iterator`); a run started again on the same workdir resumes from the newest one.
- `profile_steps` > 0: a jax.profiler trace of that many steps from `profile_start` goes to
  `<workdir>/tb` (TensorBoard's Profile tab), and the log says where their time went
  (realm_jax/train/profile.py).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from realm_jax import distributed, sharding, workdir_lock
from realm_jax.host_memory import release_freed_memory
from realm_jax.io_utils import as_path, is_remote, read_json, write_json
from realm_jax.checkpoints import training as checkpoints
from realm_jax.train import memory
from realm_jax.train.metrics_writer import MetricsWriter
from realm_jax.train.profile import StepProfiler
from realm_jax.train.realm_step import TrainState

# The loop's settings and their least values (config_checks.at_least), shared by every trainer.
LOOP_MINIMUMS = {"batch_size": 1, "num_steps": 1, "log_every": 1, "eval_every": 0,
                 "checkpoint_every": 1, "keep_checkpoints": 1, "max_bad_steps": 1,
                 "profile_start": 0, "profile_steps": 0}
# Fixed settings added after runs were made without them, and the value those runs used (a
# dotted key: a setting inside a nested config).
ADDED_SETTINGS = {"retriever_learning_rate": -1.0, "reader_title": True, "retriever_num_layers": 0,
                  "pooling": "projected_cls", "masking": "salient_spans", "null_document": True,
                  "retrieval.num_layers": 0}


def _with_added(config: dict, key: str) -> Any:
  """config[key], or its ADDED_SETTINGS value; a nested config with its added settings filled."""
  value = config.get(key, ADDED_SETTINGS.get(key))
  if isinstance(value, dict):
    added = {k[len(key) + 1:]: v for k, v in ADDED_SETTINGS.items() if k.startswith(f"{key}.")}
    value = {**added, **value}
  return value


def config_diff(old: dict, current: dict, keys: Iterable[str]) -> list[tuple[str, Any, Any]]:
  """(key, old value, current value) of the `keys` whose values differ between two configs as
  JSON; a setting missing from a config written before it existed takes its ADDED_SETTINGS value."""
  return [(k, _with_added(old, k), _with_added(current, k)) for k in keys
          if _with_added(old, k) != _with_added(current, k)]


def check_workdir_config(config, workdir: str, fixed: Iterable[str]) -> None:
  """Writes the config to `workdir/config.json`; refuses a workdir whose run was made with other
  `fixed` settings (shapes of parameters, optimiser state or data)."""
  path = os.path.join(workdir, "config.json")
  current = json.loads(config.to_json())
  if as_path(path).exists():
    diff = config_diff(read_json(path), current, fixed)
    if diff:
      raise ValueError(
          f"{workdir} holds a run made with another config ({', '.join(k for k, _, _ in diff)} "
          f"differ: {diff}). Resume it with the config it was made with, or use a new --workdir.")
  if jax.process_index() == 0:
    write_json(path, current)


def microbatch_pieces(config, key: str, devices: int) -> int:
  """How many pieces a step runs its batch in when each device takes config[key] of its examples
  at a time (0: all at once); ValueError naming the setting when they do not divide its share of
  config.batch_size."""
  per_device, micro = config.batch_size // devices, config.get(key, 0)
  if micro < 0 or (micro and per_device % micro):
    raise ValueError(f"--config.{key}={micro} must be 0 (the whole batch at once) or divide the "
                     f"{per_device} examples per device (--config.batch_size={config.batch_size} "
                     f"over {devices} devices).")
  return per_device // micro if micro else 1


def train(trainer: Callable[[Any, str], "TrainLoop"], config, workdir: str):
  """`trainer(config, workdir).run()` holding the workdir's lock (one run per workdir, taken
  before anything is written there), after `jax.distributed` start-up when config.distributed."""
  sharding.check_config(config)
  rng_impl(config)
  if config.get("distributed", False):
    distributed.initialize()
  with workdir_lock.hold(workdir):
    return trainer(config, workdir).run()


def add_step(sums: dict | None, out: dict) -> dict:
  """Adds one step's outputs to its logging window's sums (None: the window's first step).

  A skipped step (non-finite loss or gradient) adds only to `skipped`: its statistics are NaN and
  would make every average of the window NaN. `good_steps` counts the other steps, the divisor of
  per-step means such as the gradient norm.
  """
  skipped = bool(out["skipped"])
  out = {k: (v if k == "skipped" or not skipped else jax.tree.map(np.zeros_like, v))
         for k, v in out.items()}
  out["good_steps"] = np.float32(not skipped)
  return out if sums is None else jax.tree.map(np.add, sums, out)


def step_means(sums: dict) -> dict[str, float]:
  """Per-step means over a window's good steps of every summed output."""
  good = float(sums["good_steps"])
  return {k: float(v) / good for k, v in sums.items() if k not in ("skipped", "good_steps")}


def postfix(metrics: dict[str, float], **fields: tuple[str, str]) -> dict[str, str]:
  """Progress-bar fields {name: (metric, format spec)} of a logging window's metrics; a metric the
  window lacks (every step skipped) shows as nan."""
  nan = float("nan")
  return {name: format(metrics.get(key, nan), spec) for name, (key, spec) in fields.items()}


def count_bad_steps(bad_steps: int, skipped: float, step: int, max_bad_steps: int,
                    workdir: str) -> int:
  """The count of consecutive skipped (non-finite) steps after this one; logs each, and stops the
  run with a clear error at `max_bad_steps` (the newest good checkpoint stays in `workdir`)."""
  if not skipped:
    return 0
  bad_steps += 1
  logging.warning("Step %d: non-finite loss or gradient; the update was skipped (%d in a row).",
                  step, bad_steps)
  if bad_steps >= max_bad_steps:
    raise FloatingPointError(
        f"{bad_steps} steps in a row had a non-finite loss (last at step {step}). The newest good "
        f"checkpoint in {workdir}/checkpoints is kept; lower config.learning_rate or check the "
        "data, then resume.")
  return bad_steps


# Random-number generators of the dropout masks (config.rng_impl; jax.random's implementations):
# "threefry2x32", jax's default, draws the same bits on every platform; "rbg" (XLA's
# RngBitGenerator) is the one to use on a TPU: REALM's paper step with BERT's dropout on had not
# compiled for a TPU slice after 28 minutes with threefry and compiled in 5 with rbg (docs/tpu.md).
RNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


def rng_impl(config) -> str:
  """config.rng_impl (threefry2x32 for a config that names none); ValueError for an unknown one."""
  impl = config.get("rng_impl", RNG_IMPLS[0])
  if impl not in RNG_IMPLS:
    raise ValueError(f"--config.rng_impl={impl!r}: use one of {', '.join(RNG_IMPLS)}.")
  return impl


def dropout_key(config):
  """The run's dropout key: seed + 1, drawn by config.rng_impl's generator."""
  return jax.random.key(config.seed + 1, impl=rng_impl(config))


class TrainLoop:
  """A run's set-up and its loop; subclasses fill in the hooks (see the module docstring)."""

  name = "training"                      # the progress bar's label
  eval_name = "heldout"                  # the prefix of evaluation metrics
  progress: dict[str, tuple[str, str]] = {"loss": ("loss", ".3f")}  # bar fields beside ex/s
  data_iterator = None                   # a checkpointable iterator, saved with the state

  def __init__(self, config, workdir: str):
    """The mesh of config.mesh over every device of every host (data parallelism by default);
    checks only, writes nothing."""
    self.mesh = sharding.config_mesh(config)
    self.rules = sharding.config_rules(config)
    self.batch_shards = sharding.batch_shards(self.mesh)
    if config.batch_size % self.batch_shards:
      raise ValueError(f"--config.batch_size={config.batch_size} is not divisible by the "
                       f"{self.batch_shards} parts the batch is split into (--config.mesh="
                       f"{config.get('mesh', sharding.DEFAULT_MESH)}: data x fsdp): pick a "
                       "multiple.")
    if config.get("profile_steps", 0) and is_remote(workdir):
      raise ValueError(f"--config.profile_steps={config.profile_steps} writes its trace into the "
                       f"work directory, and {workdir} is not local: profile a run in a local "
                       "--workdir (a few steps show where the time goes).")
    self.config, self.workdir = config, workdir
    self.replicated = NamedSharding(self.mesh, P())
    # An index's rows are split over every device, whatever config.mesh (retrieval/exact.py).
    self.index_mesh = Mesh(self.mesh.devices.reshape(-1), ("data",))
    self.data_sharding = sharding.batch_sharding(self.mesh)
    self.host_batch = config.batch_size // jax.process_count()
    self.rng = dropout_key(config)
    self.bad_steps = 0

  def param_shardings(self, params):
    """Each parameter's sharding on this run's mesh, by its logical axes and the config's rules
    (replicated with the default mesh)."""
    return sharding.param_shardings(params, self.mesh, self.rules)

  def init_params(self, init: Callable, *args):
    """`init(*args)` (random parameters) jitted to create each array already split over the
    mesh: no device ever holds the whole of a split parameter."""
    abstract = jax.eval_shape(init, *args)
    return jax.jit(init, out_shardings=self.param_shardings(abstract))(*args)

  def start(self, params, tx: optax.GradientTransformation, step: Callable) -> None:
    """The train state split over the mesh as the parameters' logical axes say, the jitted
    `step(state, batch, rng) -> (state, outputs)` with the state donated, the checkpoint
    manager and the metrics writer. Subclasses call it last in their constructor, after every
    check: it creates `workdir/checkpoints`. `params`: host arrays, or arrays on the devices."""
    shardings = self.param_shardings(params)
    params = jax.device_put(params, shardings)
    create = lambda p: TrainState.create(apply_fn=None, params=p, tx=tx)
    state_shardings = sharding.state_shardings(jax.eval_shape(create, params), params, shardings,
                                               self.mesh)
    self.state = jax.jit(create, out_shardings=state_shardings)(params)
    self.step_fn = jax.jit(sharding.traced_on(self.mesh, step),
                           in_shardings=(state_shardings, self.data_sharding, self.replicated),
                           out_shardings=(state_shardings, self.replicated), donate_argnums=0)
    self.manager = checkpoints.checkpoint_manager(
        os.path.join(self.workdir, "checkpoints"), self.config.keep_checkpoints,
        data=self.data_iterator is not None)
    self.metrics = MetricsWriter(self.workdir)

  def jit_eval(self, fn: Callable) -> Callable:
    """`fn(params, batch) -> outputs` jitted like the step (the parameters as the state holds
    them, the batch split), outputs replicated, nothing donated."""
    return jax.jit(sharding.traced_on(self.mesh, fn), out_shardings=self.replicated)

  def put(self, host_batch: dict) -> dict:
    """This host's numpy batch -> global arrays split along the batch over every device."""
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(self.data_sharding, x), host_batch)

  # ----------------------------------------------------------------------------------- hooks
  def next_batch(self) -> dict:
    raise NotImplementedError

  def summarize(self, sums: dict) -> dict[str, float]:
    return step_means(sums)

  def train_metrics(self, step: int) -> dict[str, float]:
    return {}

  def evaluate(self) -> dict[str, float]:
    raise NotImplementedError

  def evaluated(self, step: int, metrics: dict[str, float]) -> None:
    pass

  def checkpoint_meta(self, step: int) -> dict:
    return {"step": step}

  def resumed(self, meta: dict | None) -> None:
    pass

  def finish(self, last_eval: dict[str, float], trained: bool):
    return last_eval

  def close(self) -> None:
    pass

  # ------------------------------------------------------------------------------------ loop
  def log(self, step: int, metrics: dict[str, float], prefix: str) -> None:
    if jax.process_index() == 0:
      self.metrics.write(step, metrics, prefix)

  def save(self, step: int, force: bool = False) -> None:
    """Checkpoints the state, asynchronously on accelerators. On the CPU the device memory is
    the host's: the host copy an asynchronous save holds would add to the next steps' buffers
    (fine-tuning's peak), so the save is waited for there."""
    checkpoints.save(self.manager, step, self.state, self.checkpoint_meta(step),
                     self.data_iterator, force=force)
    if jax.default_backend() == "cpu":
      self.manager.wait_until_finished()
    release_freed_memory()

  def restore(self) -> None:
    """The newest usable checkpoint's state, data position and meta (see `resumed`)."""
    got = checkpoints.restore_latest(self.manager, self.state, self.data_iterator)
    meta = None
    if got is not None:
      self.state, meta = got
    self.metrics.resume_at(int(self.state.step))
    self.resumed(meta)

  def _evaluate(self, step: int) -> dict[str, float]:
    metrics = self.evaluate()
    self.log(step, metrics, self.eval_name)
    logging.info("step %d %s: %s", step, self.eval_name,
                 json.dumps({k: round(v, 4) for k, v in metrics.items()}))
    self.evaluated(step, metrics)
    release_freed_memory()  # evaluation's buffers are gone: give their pages back
    return metrics

  def run(self):
    """Trains to config.num_steps from the newest checkpoint; returns `finish(...)`."""
    try:
      return self._run()
    finally:  # also on errors: let a checkpoint being written finish, so it is not lost
      self.manager.wait_until_finished()
      self.close()
      self.metrics.close()

  def _run(self):
    from tqdm.auto import tqdm
    c = self.config
    self.restore()
    start_step = int(self.state.step)
    if start_step >= c.num_steps:
      logging.info("Nothing to do: the run in %s is at step %d of %d.", self.workdir, start_step,
                   c.num_steps)
      return self.finish({}, trained=False)
    last_eval: dict[str, float] = {}
    if c.eval_every and start_step == 0:
      last_eval = self._evaluate(0)
    sums, busy, examples = None, 0.0, 0
    bar = tqdm(total=c.num_steps, initial=start_step, desc=self.name, unit="step",
               disable=jax.process_index() != 0)
    profiler = StepProfiler(c, self.metrics.logdir)
    for step in range(start_step, c.num_steps):
      profiler.before(step)
      start = time.perf_counter()
      batch = self.next_batch()
      self.state, out = self.step_fn(self.state, batch, self.rng)
      out = jax.device_get(out)
      busy += time.perf_counter() - start
      examples += c.batch_size
      self.bad_steps = count_bad_steps(self.bad_steps, out["skipped"], step, c.max_bad_steps,
                                       self.workdir)
      sums = add_step(sums, out)
      if step == start_step and (peak := memory.device_peak_bytes()) is not None:
        logging.info("Device memory after the first step: %.2f GiB peak.", peak / memory.GIB)
      done = step + 1
      bar.update(1)
      profiler.after(step, self.state)
      if done % c.log_every == 0 or done == c.num_steps:
        good = float(sums["good_steps"])  # 0: every step of the window was skipped
        metrics = {**self.summarize(sums), "grad_norm": float(sums["grad_norm"]) / good
                  } if good else {}
        metrics.update(skipped=float(sums["skipped"]), **self.train_metrics(step),
                       examples_per_s=examples / busy)
        self.log(done, metrics, "train")
        bar.set_postfix(postfix(metrics, **self.progress, ex_s=("examples_per_s", ".1f")))
        sums, busy, examples = None, 0.0, 0
      if c.eval_every and (done % c.eval_every == 0 or done == c.num_steps):
        last_eval = self._evaluate(done)
      if done % c.checkpoint_every == 0 or done == c.num_steps:
        self.save(done, force=done == c.num_steps)
    bar.close()
    return self.finish(last_eval, trained=True)
