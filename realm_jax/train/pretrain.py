"""REALM pre-training, end to end: `train_and_evaluate(config, workdir)`.

    corpus blocks -> salient-span examples (once) -> grain batches
      -> retrieve K-1 blocks from the current index (own block excluded) + the null document
      -> jitted train step (re-embeds query and candidates, marginal MLM loss, AdamW)
      -> metrics, TensorBoard, held-out evaluation, orbax checkpoints, index refresh.

Everything lands in `workdir`, a local directory or gs://BUCKET/PATH: `data/` (corpus, examples),
`index/` (published indexes), `checkpoints/` (state + data iterator + index version), `tb/`
(TensorBoard), `metrics.jsonl`. With a gs:// workdir the data is read from a local copy of `data/`
(realm_jax/io_utils.py: local_dir), built or downloaded once per machine.
Started again on the same workdir, a run resumes from its newest checkpoint by itself (one that
is damaged is set aside for the one before: realm_jax/train/checkpoints.py). A run holds the
workdir's lock (`run.lock`, realm_jax/workdir_lock.py): a second run there is refused.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import time
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from realm_jax import config_checks, distributed, workdir_lock
from realm_jax.data.corpus import Corpus, CorpusConfig
from realm_jax.data.pretrain import build_examples, pretrain_batches, special_ids
from realm_jax.io_utils import as_path, read_json, write_json
from realm_jax.text import BertTokenizer
from realm_jax.train import checkpoints, memory, optimizer
from realm_jax.train.candidates import CandidateBuilder, retrieve
from realm_jax.train.init import build_models, init_params
from realm_jax.train.metrics_writer import MetricsWriter
from realm_jax.train.realm_step import TrainState, eval_step, summarize, train_step
from realm_jax.train.refresh import (REFRESH_MODES, AsyncIndexWatcher, DocumentEmbedder,
                                     load_index, refresh)
from realm_jax.retrieval.index import (index_dirs, index_options, index_step, latest_index_dir,
                                      point_latest, read_manifest)

# Settings that change the shapes of parameters, of the optimiser state (a separate retriever
# rate adds a partition) or of the data: a workdir keeps its own.
FIXED_SETTINGS = ("init", "model", "num_layers", "retriever_num_layers", "share_embedders",
          "retriever_learning_rate", "corpus", "query_length", "max_masked", "tagger",
          "heldout_percent")
# Fixed settings added later, and the value that runs (or configs) without them use.
ADDED_SETTINGS = {"retriever_learning_rate": -1.0, "reader_title": True, "retriever_num_layers": 0}


def maybe_initialize_distributed(enabled: bool) -> None:
  """`jax.distributed.initialize()` for multi-host runs: TPU pods find their peers by themselves;
  elsewhere set REALM_COORDINATOR_ADDRESS, REALM_NUM_PROCESSES and REALM_PROCESS_ID (see
  realm_jax/distributed.py)."""
  if enabled:
    distributed.initialize()


def config_diff(old: dict, current: dict, keys: Iterable[str]) -> list[tuple[str, Any, Any]]:
  """(key, old value, current value) of the `keys` whose values differ between two configs as
  JSON; a key missing from a config written before it existed takes its ADDED_SETTINGS value."""
  value = lambda c, k: c.get(k, ADDED_SETTINGS.get(k))
  return [(k, value(old, k), value(current, k)) for k in keys if value(old, k) != value(current, k)]


def check_workdir_config(config, workdir: str, fixed: tuple[str, ...] = FIXED_SETTINGS) -> None:
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


def open_data(config, workdir: str, vocab_file: str):
  """(corpus, tokenizer, examples dir), building what is missing (on the first host; the others
  wait for it, then open what it built, downloading their local copy when it is in gs://)."""
  return distributed.first_host_first(
      "realm_jax:open_data", lambda: _open_data(config, workdir, vocab_file))


def check_workdir_corpus(workdir: str, fingerprint: str) -> None:
  """Refuses a work directory whose indexes were built from other blocks, before the corpus and
  examples are built (hours at Wikipedia scale): its checkpoints and data are of those blocks."""
  latest = latest_index_dir(os.path.join(workdir, "index"))
  corpus = latest and read_manifest(latest)["corpus_fingerprint"]
  if corpus and corpus != fingerprint:
    raise ValueError(
        f"{workdir} holds a run over other blocks (corpus {corpus}, now {fingerprint}: the "
        "corpus files changed, or a newer realm_jax cuts blocks differently). Resume it with the "
        "corpus and realm_jax it was made with, or start anew with another --workdir.")


def check_num_candidates(num_candidates: int, corpus) -> None:
  """Refuses more candidates than the corpus has blocks: a query retrieves the others (never its
  own), so past len(corpus) the candidates are padding that costs memory and compute all the
  same."""
  if num_candidates > len(corpus):
    raise ValueError(
        f"--config.num_candidates={num_candidates} is more than the {len(corpus)} blocks of the "
        f"corpus in {corpus.data_dir}: a query has at most {len(corpus) - 1} other blocks to "
        f"retrieve, beside the null document. Pass --config.num_candidates={len(corpus)} or "
        "fewer, or a larger corpus.")


def _open_data(config, workdir: str, vocab_file: str):
  data_dir = config.data_dir or os.path.join(workdir, "data")
  tokenizer = BertTokenizer(vocab_file)
  corpus = Corpus.build(os.path.join(data_dir, "corpus"),
                        CorpusConfig.from_config(config.corpus, vocab_file))
  check_num_candidates(config.num_candidates, corpus)  # before the examples are built
  settings = f"{config.query_length}-{config.max_masked}-{config.tagger}-{config.heldout_percent}"
  examples_dir = os.path.join(data_dir, f"examples-{corpus.fingerprint[:12]}-{settings}")
  build_examples(corpus, tokenizer, examples_dir, query_length=config.query_length,
                 max_masked=config.max_masked, tagger=config.tagger,
                 heldout_percent=config.heldout_percent)
  return corpus, tokenizer, examples_dir


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


def window_metrics(sums: dict, summarize) -> dict[str, float]:
  """A logging window's metrics from `add_step` sums: `summarize(sums)` with the gradient norm
  averaged over the window's good steps, and the count of skipped ones (only that count when every
  step was skipped)."""
  good = float(sums["good_steps"])
  out = {**summarize(sums), "grad_norm": float(sums["grad_norm"]) / good} if good else {}
  out["skipped"] = float(sums["skipped"])
  return out


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


class Trainer:
  """The pieces of a run, set up once; `run()` trains to config.num_steps."""

  def __init__(self, config, workdir: str):
    if config.index.refresh not in REFRESH_MODES:
      raise ValueError(f"--config.index.refresh={config.index.refresh!r}: use one of {REFRESH_MODES}.")
    if config.batch_size % jax.device_count():
      raise ValueError(f"--config.batch_size={config.batch_size} is not divisible by the "
                       f"{jax.device_count()} devices: pick a multiple.")
    self.config, self.workdir = config, workdir
    # The weights, the corpus files and the index settings are checked before config.json is
    # written: a config refused for a typo must not become the workdir's and refuse the fixed one.
    self.models, self.model_config, vocab = build_models(config)
    corpus_fingerprint = CorpusConfig.from_config(config.corpus, vocab).fingerprint
    index_options(config.index)
    as_path(workdir).mkdir(parents=True, exist_ok=True)
    check_workdir_config(config, workdir)
    check_workdir_corpus(workdir, corpus_fingerprint)
    self.corpus, self.tokenizer, self.examples_dir = open_data(config, workdir, vocab)
    tok = self.tokenizer
    self.builder = CandidateBuilder(self.corpus, tok.cls_id, tok.sep_id, config.num_candidates,
                                    config.doc_length, config.joint_length)
    self.mesh = Mesh(np.array(jax.devices()), ("data",))
    self.replicated = NamedSharding(self.mesh, P())
    self.data_sharding = NamedSharding(self.mesh, P("data"))
    self.host_batch = config.batch_size // jax.process_count()

    self.schedule, tx = optimizer.from_config(config)
    params = init_params(config, self.models, self.model_config, jax.random.key(config.seed))
    self.state = jax.jit(lambda p: TrainState.create(apply_fn=None, params=p, tx=tx),
                         out_shardings=self.replicated)(params)
    self.rng = jax.random.key(config.seed + 1)
    self.step_fn = jax.jit(
        functools.partial(train_step, models=self.models, dropout=config.dropout),
        in_shardings=(self.replicated, self.data_sharding, self.replicated),
        out_shardings=(self.replicated, self.replicated), donate_argnums=0)
    self.eval_fn = jax.jit(functools.partial(eval_step, models=self.models),
                           in_shardings=(self.replicated, self.data_sharding),
                           out_shardings=self.replicated)
    self._embed_q = jax.jit(lambda p, q: self.models.retriever.apply(
        {"params": p}, q["input_ids"], q["attention_mask"], q["token_type_ids"],
        method="embed_queries"), in_shardings=(self.replicated, self.data_sharding),
        out_shardings=self.replicated)

    self.manager = checkpoints.checkpoint_manager(os.path.join(workdir, "checkpoints"),
                                                  config.keep_checkpoints)
    self.train_iter = self._batches("train", config.seed)
    self.index_root = os.path.join(workdir, "index")
    # The index is sharded over every device of every host, like the batch.
    self.index_options = dict(index_options(config.index), mesh=self.mesh)
    self.embedder = DocumentEmbedder(self.models, self.corpus, tok, config.doc_length,
                                     config.index.embed_batch_size)
    self.memory_estimate = memory.estimate(config, jax.device_count(), len(self.corpus),
                                           self.model_config)
    capacity = memory.device_memory()  # this machine's; else the slice the config plans for
    planned_gib = config.slice.hbm_gib if config.get("slice") else 0.0
    logging.info("%s", memory.format_estimate(
        self.memory_estimate, capacity[0] / memory.GIB if capacity else planned_gib))
    if warning := memory.memory_warning(self.memory_estimate, capacity):
      logging.warning("%s", warning)
    self.index, self.index_path = None, None
    self._saved_index_paths = collections.deque(maxlen=config.keep_checkpoints + 1)
    self.watcher = None
    self.metrics = MetricsWriter(workdir)
    self.bad_steps = 0

  # ---------------------------------------------------------------------------------- data
  def _batches(self, split: str, seed: int, num_epochs=None):
    tok = self.tokenizer
    return pretrain_batches(
        self.examples_dir, split, batch_size=self.host_batch, seed=seed,
        query_length=self.config.query_length, max_masked=self.config.max_masked,
        tokenizer_ids=special_ids(tok),
        shard_index=jax.process_index(), shard_count=jax.process_count(), num_epochs=num_epochs)

  def _global(self, host_batch: dict):
    """Host-local numpy batch -> global arrays sharded along the batch over every device."""
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(self.data_sharding, x), host_batch)

  def step_batch(self, queries: dict) -> dict:
    """Retrieval for the global batch, then this host's part of the step batch (global arrays).

    Every host searches all hosts' queries together: the index is sharded over all devices, so
    the search is one collective call with the same arguments everywhere.
    """
    q = {n: queries[n] for n in ("input_ids", "attention_mask", "token_type_ids")}
    emb = np.asarray(self._embed_q(self.state.params["retriever"], self._global(q)))  # [G, D]
    exclude = distributed.allgather_rows(queries["block_id"])  # [G], hosts in process order
    _, rows = retrieve(self.index, self.corpus, emb, exclude, self.builder.k - 1)
    return self._global(self.builder.build(queries, distributed.host_rows(rows, self.host_batch)))

  # --------------------------------------------------------------------------------- index
  def _set_index(self, index, path):
    self.index, self.index_path = index, path
    logging.info("Using index %s (step %d)", path, index_step(path))

  def ensure_index(self, path: str | None):
    """Loads the index a checkpoint names, else the newest published, else builds the first one
    from the current weights (ICT, MiniLM or random)."""
    dim = self.embedder_dim()
    distributed.sync("realm_jax:ensure_index")  # every host sees the same published indexes
    if path:  # by its name in this run's index folder: a moved or copied workdir uses its own
      path = os.path.join(self.index_root, os.path.basename(path.rstrip("/")))
    path = path if path and as_path(path).is_dir() else latest_index_dir(self.index_root)
    if path is not None and index_step(path) <= int(self.state.step):
      self._set_index(load_index(path, self.corpus, dim, self.index_options), path)
      self._go_on_from_index(path)
    else:
      self._set_index(*refresh(self.index_root, self.embedder, self.state.params["retriever"],
                               int(self.state.step), self.index_options, **self._pruning()))
    if self.config.index.refresh == "async":
      self.watcher = AsyncIndexWatcher(self.index_root, self.corpus, dim, self.index_options,
                                       self.index_path, agree=jax.process_count() > 1)

  def _go_on_from_index(self, path: str) -> None:
    """Points LATEST at `path` when the run resumed with an older index than LATEST names (it
    stopped after publishing indexes that no checkpoint reached), so that neither the async
    watcher nor the refresher takes one of those for newer; pruning removes them first."""
    latest = latest_index_dir(self.index_root)
    if jax.process_index() == 0 and latest is not None and index_step(latest) > index_step(path):
      later = [name for step, name in index_dirs(self.index_root) if step > index_step(path)]
      logging.warning(
          "Resumed at step %d with the index %s; %s in %s were published after the checkpoint and "
          "are not used (LATEST now names %s again; training republishes those steps as it gets "
          "there).", int(self.state.step), os.path.basename(path), ", ".join(later),
          self.index_root, os.path.basename(path))
      point_latest(self.index_root, path)
    distributed.sync("realm_jax:latest_index")

  def _pruning(self) -> dict:
    """Old indexes go (config.index.keep), but never the one in use or one a checkpoint names."""
    ckpt_dir = os.path.join(self.workdir, "checkpoints")
    in_use = lambda: (checkpoints.indexes_in_use(ckpt_dir) | {self.index_path or ""}
                      | set(filter(None, self._saved_index_paths)))
    return dict(keep=int(self.config.index.get("keep", 0)), protect=in_use)

  def embedder_dim(self) -> int:
    c = self.model_config
    return c.hidden_size if self.models.retriever.pooling == "mean" else c.retriever_proj_size

  def maybe_refresh(self, step: int):
    mode = self.config.index.refresh
    if mode == "sync" and step % self.config.index.refresh_every == 0 and index_step(
        self.index_path) < step:
      start = time.perf_counter()
      self._set_index(*refresh(self.index_root, self.embedder, self.state.params["retriever"],
                               step, self.index_options, **self._pruning()))
      logging.info("Index refreshed at step %d in %.1f s", step, time.perf_counter() - start)
    elif mode == "async":
      got = self.watcher.poll()
      if got is not None:
        self._set_index(*got)

  # ------------------------------------------------------------------------------ evaluate
  def evaluate(self) -> dict[str, float]:
    """Held-out sentences: masked-token accuracy with retrieval vs with the null document only,
    retrieval utility, loss (no dropout)."""
    it = self._batches("heldout", seed=0, num_epochs=1)
    sums = None
    for i, queries in enumerate(it):
      if i >= self.config.eval_batches:
        break
      out = jax.device_get(self.eval_fn(self.state.params, self.step_batch(queries)))
      sums = out if sums is None else jax.tree.map(np.add, sums, out)
    return summarize(sums) if sums is not None else {}

  # ---------------------------------------------------------------------------------- log
  def log(self, step: int, metrics: dict[str, float], prefix: str):
    if jax.process_index() == 0:
      self.metrics.write(step, metrics, prefix)

  def save(self, step: int, force: bool = False):
    # Remembered until the (asynchronous) checkpoint is on disk for `indexes_in_use` to read.
    self._saved_index_paths.append(self.index_path)
    checkpoints.save(self.manager, step, self.state,
                     {"index_path": self.index_path, "step": step}, self.train_iter, force=force)

  # ---------------------------------------------------------------------------------- run
  def restore(self) -> None:
    got = checkpoints.restore_latest(self.manager, self.state, self.train_iter)
    meta = None
    if got is not None:
      self.state, meta = got
    self.metrics.resume_at(int(self.state.step))
    self.ensure_index(meta and meta.get("index_path"))

  def run(self) -> dict[str, float]:
    try:
      return self._run()
    finally:  # also on errors: let a checkpoint being written finish, so it is not lost
      self.manager.wait_until_finished()
      if self.watcher is not None:
        self.watcher.close()
      self.metrics.close()

  def _run(self) -> dict[str, float]:
    from tqdm.auto import tqdm
    c = self.config
    self._batches("heldout", seed=0, num_epochs=1)  # fails now, not after training, if too small
    self.restore()
    start_step = int(self.state.step)
    if start_step >= c.num_steps:
      logging.info("Nothing to do: the run in %s is at step %d of %d.", self.workdir, start_step,
                   c.num_steps)
      return {}
    sums, window_start, window_examples = None, time.perf_counter(), 0
    last_eval: dict[str, float] = {}
    bar = tqdm(total=c.num_steps, initial=start_step, desc="pre-training", unit="step",
               disable=jax.process_index() != 0)
    for step in range(start_step, c.num_steps):
      self.maybe_refresh(step)
      queries = next(self.train_iter)
      batch = self.step_batch(queries)
      self.state, out = self.step_fn(self.state, batch, self.rng)
      out = jax.device_get(out)
      self.bad_steps = count_bad_steps(self.bad_steps, out["skipped"], step, c.max_bad_steps,
                                       self.workdir)
      sums = add_step(sums, out)
      if step == start_step and (peak := memory.device_peak_bytes()) is not None:
        logging.info("Device memory after the first step: %.2f GiB peak (estimated %.2f GiB).",
                     peak / memory.GIB, self.memory_estimate["total"] / memory.GIB)
      window_examples += c.batch_size
      done = step + 1
      bar.update(1)
      if done % c.log_every == 0 or done == c.num_steps:
        elapsed = time.perf_counter() - window_start
        metrics = window_metrics(sums, summarize)
        metrics.update(learning_rate=float(self.schedule(step)),
                       index_staleness=float(done - 1 - index_step(self.index_path)),
                       examples_per_s=window_examples / elapsed)
        self.log(done, metrics, "train")
        bar.set_postfix(postfix(metrics, loss=("loss", ".3f"), acc=("accuracy", ".3f"),
                                utility=("retrieval_utility", ".3f"),
                                ex_s=("examples_per_s", ".1f")))
        sums, window_start, window_examples = None, time.perf_counter(), 0
      if done % c.eval_every == 0 or done == c.num_steps:
        last_eval = self.evaluate()
        self.log(done, last_eval, "heldout")
        logging.info("step %d held-out: %s", done, json.dumps(
            {k: round(v, 4) for k, v in last_eval.items()}))
      if done % c.checkpoint_every == 0 or done == c.num_steps:
        self.save(done, force=done == c.num_steps)
    bar.close()
    return last_eval


def check_settings(config, workdir: str) -> None:
  """Refuses settings no run can use, naming the flag, before weights, corpus or compiling."""
  config_checks.workdir(workdir)
  config_checks.at_least(config, {
      "batch_size": 1, "num_steps": 1, "num_candidates": 1, "query_length": 4, "max_masked": 1,
      "doc_length": 4, "joint_length": 8, "learning_rate": 0, "log_every": 1, "eval_every": 1,
      "eval_batches": 1, "checkpoint_every": 1, "keep_checkpoints": 1, "max_bad_steps": 1,
      "num_layers": 0, "index.refresh_every": 1, "index.embed_batch_size": 1, "index.keep": 0,
      "corpus.block_length": 4, "corpus.max_docs": 0, "heldout_percent": 0})
  config_checks.one_of(config, {"index.refresh": REFRESH_MODES, "init": ("minilm", "hf", "random"),
                                "tagger": ("auto", "spacy", "regex"),
                                "dtype": ("float32", "bfloat16")})


def train_and_evaluate(config, workdir: str) -> dict[str, float]:
  """Pre-trains to config.num_steps (resuming from `workdir`); returns the last held-out metrics."""
  check_settings(config, workdir)
  maybe_initialize_distributed(config.distributed)
  with workdir_lock.hold(workdir):  # before anything is written there: one run per workdir
    result = Trainer(config, workdir).run()
    if jax.process_index() == 0:
      try:
        from realm_jax.train.plot import plot_metrics
        logging.info("Training curves: %s", plot_metrics(workdir))
      except ImportError:
        logging.info("Install matplotlib (the demo extra) for a plot of the training curves.")
  return result


def quiet_library_logs() -> None:
  """Drops the INFO chatter of orbax and grain (dozens of lines per checkpoint) from absl's log;
  their warnings and errors still show."""
  import logging as std_logging
  from absl import logging as absl_logging

  class _Filter(std_logging.Filter):
    def filter(self, record):
      noisy = any(f"{os.sep}{lib}{os.sep}" in record.pathname for lib in ("orbax", "grain"))
      return record.levelno >= std_logging.WARNING or not noisy

  absl_logging.get_absl_handler().addFilter(_Filter())
