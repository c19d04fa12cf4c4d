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
is damaged is set aside for the one before: realm_jax/checkpoints/training.py). A run holds the
workdir's lock (`run.lock`, realm_jax/workdir_lock.py): a second run there is refused.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import time

import jax
import numpy as np

from realm_jax import config_checks, distributed
from realm_jax.data.corpus import CorpusConfig
from realm_jax.data.pretrain import MASKINGS, pretrain_batches, special_ids
from realm_jax.io_utils import as_path, write_json
from realm_jax.checkpoints import training as checkpoints
from realm_jax.checkpoints.export import export_hf, pretraining_exports
from realm_jax.train import loop, memory, optimizer
from realm_jax.train.candidates import CandidateBuilder, retrieve
from realm_jax.train.init import build_models, init_params, retriever_model_config
from realm_jax.train.pretrain_workdir import FIXED_SETTINGS, open_data
from realm_jax.train.realm_step import eval_step, summarize, train_step
from realm_jax.train.refresh import (REFRESH_MODES, AsyncIndexWatcher, DocumentEmbedder,
                                     load_index, refresh, update)
from realm_jax.retrieval.index import index_options
from realm_jax.retrieval.index_store import (index_dirs, index_step, latest_index_dir, point_latest,
                                             read_manifest)


class Trainer(loop.TrainLoop):
  """A pre-training run (realm_jax/train/loop.py): `run()` trains to config.num_steps."""

  name = "pre-training"
  progress = {"loss": ("loss", ".3f"), "acc": ("accuracy", ".3f"),
              "utility": ("retrieval_utility", ".3f")}

  def __init__(self, config, workdir: str):
    if config.index.refresh not in REFRESH_MODES:
      raise ValueError(f"--config.index.refresh={config.index.refresh!r}: use one of {REFRESH_MODES}.")
    super().__init__(config, workdir)
    pieces = loop.microbatch_pieces(config, "microbatch", self.batch_shards)
    if pieces > 1 and config.chunk_tokens and config.dropout:
      raise ValueError(f"--config.microbatch={config.microbatch} with --config.chunk_tokens="
                       f"{config.chunk_tokens}: set --config.chunk_tokens=0 (the pieces keep each "
                       "BERT call small already; with dropout the two cannot be combined).")
    # The weights, the corpus files and the index settings are checked before config.json is
    # written: a config refused for a typo must not become the workdir's and refuse the fixed one.
    self.models, self.model_config, vocab = build_models(config)
    self.vocab_file = vocab
    _ = CorpusConfig.from_config(config.corpus, vocab).fingerprint  # settings; files exist
    index_options(config.index)
    as_path(workdir).mkdir(parents=True, exist_ok=True)
    loop.check_workdir_config(config, workdir, FIXED_SETTINGS)
    self.corpus, self.tokenizer, self.examples_dir = open_data(config, workdir, vocab)
    tok = self.tokenizer
    self.builder = CandidateBuilder(self.corpus, tok.cls_id, tok.sep_id, config.num_candidates,
                                    config.doc_length, config.joint_length,
                                    null_document=config.null_document)
    if config.eval_every:  # fails now, not after training, if too small
      self._batches("heldout", seed=0, num_epochs=1)

    self.schedule, tx = optimizer.from_config(config)
    self.eval_fn = self.jit_eval(functools.partial(eval_step, models=self.models))
    self._embed_q = self.jit_eval(lambda p, q: self.models.retriever.apply(
        {"params": p}, q["input_ids"], q["attention_mask"], q["token_type_ids"],
        method="embed_queries"))
    self.data_iterator = self._batches("train", config.seed)
    self.index_root = os.path.join(workdir, "index")
    # The index is sharded over every device of every host, whatever config.mesh.
    self.index_options = dict(index_options(config.index), mesh=self.index_mesh)
    self.embedder = DocumentEmbedder(self.models, self.corpus, tok, config.doc_length,
                                     config.index.embed_batch_size)
    self.memory_estimate = memory.estimate(config, jax.device_count(), len(self.corpus),
                                           self.model_config, platform=memory.platform_of())
    capacity = memory.device_memory()  # this machine's; else the slice the config plans for
    planned_gib = config.slice.hbm_gib if config.get("slice") else 0.0
    logging.info("%s", memory.format_estimate(
        self.memory_estimate, capacity[0] / memory.GIB if capacity else planned_gib))
    if warning := memory.memory_warning(self.memory_estimate, capacity):
      logging.warning("%s", warning)
    self.index, self.index_path = None, None
    self._saved_index_paths = collections.deque(maxlen=config.keep_checkpoints + 1)
    self.watcher = None
    self.start(init_params(config, self.models, self.model_config, jax.random.key(config.seed)),
               tx, functools.partial(train_step, models=self.models, dropout=config.dropout,
                                     pieces=pieces))

  # ---------------------------------------------------------------------------------- data
  def _batches(self, split: str, seed: int, num_epochs=None):
    """Training batches are masked as config.masking says; held-out ones always by salient spans,
    so that every masking variant is measured on the same masked tokens."""
    tok = self.tokenizer
    return pretrain_batches(
        self.examples_dir, split, batch_size=self.host_batch, seed=seed,
        query_length=self.config.query_length, max_masked=self.config.max_masked,
        tokenizer_ids=special_ids(tok),
        shard_index=jax.process_index(), shard_count=jax.process_count(), num_epochs=num_epochs,
        masking=self.config.masking if split == "train" else "salient_spans")

  def step_batch(self, queries: dict) -> dict:
    """Retrieval for the global batch, then this host's part of the step batch (global arrays).

    Every host searches all hosts' queries together: the index is sharded over all devices, so
    the search is one collective call with the same arguments everywhere.
    """
    q = {n: queries[n] for n in ("input_ids", "attention_mask", "token_type_ids")}
    emb = np.asarray(self._embed_q(self.state.params["retriever"], self.put(q)))  # [G, D]
    exclude = distributed.allgather_rows(queries["block_id"])  # [G], hosts in process order
    _, rows = retrieve(self.index, self.corpus, emb, exclude, self.builder.k - 1)
    return self.put(self.builder.build(queries, distributed.host_rows(rows, self.host_batch)))

  # --------------------------------------------------------------------------------- index
  def _set_index(self, index, path):
    self.index, self.index_path = index, path
    logging.info("Using index %s (step %d)", path, index_step(path))

  def ensure_index(self, path: str | None):
    """Loads the index a checkpoint names, else the newest published, else builds the first one
    from the current weights (ICT, MiniLM or random). An index of another version of the corpus
    (its files changed since) is brought up to date first: only new and edited blocks are
    embedded, with the current weights (`refresh.update`)."""
    dim = self.embedder_dim()
    distributed.sync("realm_jax:ensure_index")  # every host sees the same published indexes
    if path:  # by its name in this run's index folder: a moved or copied workdir uses its own
      path = os.path.join(self.index_root, os.path.basename(path.rstrip("/")))
    path = path if path and as_path(path).is_dir() else latest_index_dir(self.index_root)
    if path is not None and index_step(path) <= int(self.state.step):
      manifest = read_manifest(path)
      if manifest["corpus_fingerprint"] == self.corpus.fingerprint:
        self._set_index(load_index(path, self.corpus, dim, self.index_options), path)
        self._go_on_from_index(path)
      else:  # LATEST back at `path` first: the update is then published as the newest index
        self._go_on_from_index(path)
        self._set_index(*update(self.index_root, path, manifest, self.embedder,
                                self.state.params["retriever"], int(self.state.step),
                                self.index_options, **self._pruning()))
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

  # ----------------------------------------------------------------------------- the loop
  def next_batch(self) -> dict:
    self.maybe_refresh(int(self.state.step))
    return self.step_batch(next(self.data_iterator))

  def summarize(self, sums: dict) -> dict[str, float]:
    return summarize(sums)

  def train_metrics(self, step: int) -> dict[str, float]:
    return {"learning_rate": float(self.schedule(step)),
            "index_staleness": float(step - index_step(self.index_path))}

  def evaluate(self) -> dict[str, float]:
    """Held-out sentences: masked-token accuracy with retrieval vs with the null document only,
    retrieval utility, loss (no dropout). The per-sentence figures behind them go to
    `eval/heldout-SSSSSSSS.json`: lists `tokens`, `correct`, `null_correct`, `utility`,
    `span_found` and `block_id`, one entry per sentence, in the same order at every step and in
    every run over the same examples (what paired comparisons of two runs need)."""
    it = self._batches("heldout", seed=0, num_epochs=1)
    sums, per_example = None, collections.defaultdict(list)
    for i, queries in enumerate(it):
      if i >= self.config.eval_batches:
        break
      out = jax.device_get(self.eval_fn(self.state.params, self.step_batch(queries)))
      for name, values in out.pop("per_example").items():
        per_example[name] += np.asarray(values).tolist()
      per_example["block_id"] += distributed.allgather_rows(queries["block_id"]).tolist()
      sums = out if sums is None else jax.tree.map(np.add, sums, out)
    if sums is None:
      return {}
    if jax.process_index() == 0:
      write_json(os.path.join(self.workdir, "eval", f"heldout-{int(self.state.step):08d}.json"),
                 {"step": int(self.state.step), **per_example})
    return summarize(sums)

  def checkpoint_meta(self, step: int) -> dict:
    # Remembered until the (asynchronous) checkpoint is on disk for `indexes_in_use` to read.
    self._saved_index_paths.append(self.index_path)
    return {"index_path": self.index_path, "step": step}

  def resumed(self, meta: dict | None) -> None:
    self.ensure_index(meta and meta.get("index_path"))

  def finish(self, last_eval: dict[str, float], trained: bool) -> dict[str, float]:
    """Exports the retriever (a HF REALM scorer) and the knowledge-augmented encoder to
    `export/retriever` and `export/encoder` (`pretraining_exports`), what fine-tuning's
    config.init reads; also when a finished run is started again and an export is missing."""
    dirs = pretraining_exports(self.workdir)
    missing = not all(as_path(os.path.join(d, "config.json")).exists() for d in dirs.values())
    if jax.process_index() == 0 and (trained or missing):
      params = jax.device_get(self.state.params)
      export_hf(dirs["retriever"], retriever_model_config(self.config, self.model_config),
                params["retriever"], "retriever", self.vocab_file)
      export_hf(dirs["encoder"], self.model_config, params["encoder"], "encoder", self.vocab_file)
    return last_eval

  def close(self) -> None:
    if self.watcher is not None:
      self.watcher.close()


def check_settings(config, workdir: str) -> None:
  """Refuses settings no run can use, naming the flag, before weights, corpus or compiling."""
  config_checks.workdir(workdir)
  config_checks.at_least(config, {
      **loop.LOOP_MINIMUMS, "num_candidates": 1, "query_length": 4, "max_masked": 1,
      "doc_length": 4, "joint_length": 8, "learning_rate": 0, "eval_batches": 1, "num_layers": 0,
      "index.refresh_every": 1, "index.embed_batch_size": 1, "index.keep": 0,
      "corpus.block_length": 4, "corpus.max_docs": 0, "heldout_percent": 0})
  config_checks.one_of(config, {"index.refresh": REFRESH_MODES, "init": ("minilm", "hf", "random"),
                                "masking": MASKINGS, "null_document": (True, False),
                                "tagger": ("auto", "spacy", "regex"),
                                "dtype": ("float32", "bfloat16")})


def train_and_evaluate(config, workdir: str) -> dict[str, float]:
  """Pre-trains to config.num_steps (resuming from `workdir`); returns the last held-out metrics."""
  check_settings(config, workdir)
  result = loop.train(Trainer, config, workdir)
  if jax.process_index() == 0:
    try:
      from realm_jax.train.plot import plot_metrics
      logging.info("Training curves: %s", plot_metrics(workdir))
    except ImportError:
      logging.info("Install matplotlib (the demo extra) for a plot of the training curves.")
  return result
