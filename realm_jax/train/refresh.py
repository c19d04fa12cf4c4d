"""Keeping the pre-training index fresh: embed the corpus with the current document tower and
publish it (synchronously, in the trainer), or pick up what `experiments/refresh_index.py`
publishes beside the trainer (asynchronously, as REALM did).

Indexes live in `workdir/index/index-SSSSSSSS` (S = the training step of the weights that embedded
the corpus) and are published atomically (`publish_index`), so a reader never sees half an index.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from collections.abc import Callable, Iterable

import jax
import numpy as np

from realm_jax import distributed
from realm_jax.io_utils import is_remote
from realm_jax.retrieval.embed import embed_in_buckets
from realm_jax.retrieval.index import DocIndex
from realm_jax.retrieval.index_store import (index_path, index_step, latest_index_dir,
                                             prune_indexes, publish_index, read_manifest,
                                             updated_rows)
from realm_jax.retrieval.towers import params_fingerprint

REFRESH_MODES = ("sync", "async", "none")


class DocumentEmbedder:
  """Embeds every corpus block with given retriever parameters (the document tower)."""

  def __init__(self, models, corpus, tokenizer, doc_length: int, batch_size: int = 64):
    self.corpus = corpus
    self._fn = jax.jit(lambda p, b: models.retriever.apply(
        {"params": p}, b["input_ids"], b["attention_mask"], b["token_type_ids"],
        method="embed_documents"))
    self._inputs = None
    self._tokenizer, self._doc_length, self._batch_size = tokenizer, doc_length, batch_size

  def __call__(self, retriever_params, rows: np.ndarray | None = None) -> np.ndarray:
    """[N, D] embeddings of every block (or of the N corpus rows `rows`), on every host. With
    several hosts each embeds its own share of the blocks on its local devices, then the shares
    are gathered."""
    if rows is None:
      n = len(self.corpus)
      if self._inputs is None:  # laid out once: the corpus does not change under a run
        self._inputs = self._host_inputs(np.arange(n))
      inputs = self._inputs
    else:
      n, inputs = len(rows), self._host_inputs(np.asarray(rows, np.int64))
    emb = embed_in_buckets(lambda b: self._fn(retriever_params, b), inputs, self._batch_size,
                           desc="refreshing index" if rows is None else "new blocks")
    return distributed.allgather_rows(emb)[:n]

  def _host_inputs(self, rows: np.ndarray) -> dict:
    """Model inputs of this host's share of `rows` (the last host's share is padded with the last
    row)."""
    share = -(-len(rows) // jax.process_count())
    mine = np.minimum(np.arange(share) + jax.process_index() * share, len(rows) - 1)
    return self.corpus.model_inputs(rows[mine], self._doc_length, self._tokenizer)


def index_fingerprint(retriever_params) -> str:
  return params_fingerprint(retriever_params)


def refresh(root: str, embedder: DocumentEmbedder, retriever_params, step: int,
            index_options: dict, keep: int = 0,
            protect: Callable[[], Iterable[str]] = tuple) -> tuple[DocIndex, str]:
  """Re-embeds the corpus with `retriever_params` and publishes it as step `step`.

  With several hosts each embeds its share of the blocks and gets the others' (`DocumentEmbedder`),
  the index keeps on each host the rows of its own devices, and the first host publishes; all
  return once it is published. Then all but the newest `keep` indexes are deleted (0: none),
  sparing those `protect()` names (the ones the run's checkpoints would resume with).
  """
  params = jax.device_get(retriever_params)
  emb = embedder(params)
  return _publish(root, embedder, emb, params, step, index_options, keep, protect)


def update(root: str, previous: str, manifest: dict, embedder: DocumentEmbedder, retriever_params,
           step: int, index_options: dict, keep: int = 0,
           protect: Callable[[], Iterable[str]] = tuple) -> tuple[DocIndex, str]:
  """The index `previous` (its `manifest`; of another version of the corpus) brought to
  `embedder.corpus`: its rows of unchanged blocks are kept (embedded by the weights that made
  it), new and edited blocks are embedded with `retriever_params`, removed ones leave
  (`index_store.updated_rows`). Published as step `step` (replacing an index of that step,
  atomically) and pruned as `refresh` does; says what it did."""
  params = jax.device_get(retriever_params)
  emb, done = updated_rows(embedder.corpus.block_ids, previous, manifest,
                           lambda new: embedder(params, new))
  index, path = _publish(root, embedder, emb, params, step, index_options, keep, protect)
  message = f"Corpus update: {done} of {os.path.basename(previous)}; published as {path}."
  logging.info(message)
  if jax.process_index() == 0:
    print(message, flush=True)
  return index, path


def _publish(root, embedder, emb, params, step, index_options, keep, protect):
  index = DocIndex(emb, embedder.corpus.block_ids, **index_options)
  path = index_path(root, step)
  if jax.process_index() == 0:
    publish_index(root, index, step, model_fingerprint=index_fingerprint(params),
                  corpus_fingerprint=embedder.corpus.fingerprint, embeddings=emb)
    for gone in prune_indexes(root, keep, protect()):
      logging.info("Deleted the index %s (config.index.keep=%d).", gone, keep)
  distributed.sync(f"realm_jax:refresh:{step}")
  index.manifest = read_manifest(path)
  return index, path


def load_index(path: str, corpus, dim: int, index_options: dict) -> DocIndex:
  """A published index, checked against the corpus and the retriever's dimension."""
  return DocIndex.load(path, expected_dim=dim, expected_corpus_fingerprint=corpus.fingerprint,
                       **index_options)


class AsyncIndexWatcher:
  """Loads each newly published index in a background thread; `poll()` between steps swaps it in.

  Only complete indexes are ever seen (`latest_index_dir` ignores interrupted writes); an index
  that fails to load is logged and the current one kept. In gs:// the index root is looked at
  every `remote_look_every_s` seconds, not at every poll (each look is a few requests).

  With several hosts (`agree=True`) every host must search the same index (it is one array
  sharded over all of them), so `poll` is a collective: an index is swapped in only once every
  host has loaded that same version; a host that loaded an older one than another drops it and
  loads the newer one.
  """

  def __init__(self, root: str, corpus, dim: int, index_options: dict, current_path: str | None,
               agree: bool = False, remote_look_every_s: float = 10.0):
    self.root, self.corpus, self.dim, self.options = root, corpus, dim, index_options
    self.current_path, self.agree = current_path, agree
    self._look_every_s = remote_look_every_s if is_remote(root) else 0.0
    self._next_look = 0.0
    self._pool = concurrent.futures.ThreadPoolExecutor(1)
    self._pending: tuple[str, concurrent.futures.Future] | None = None
    self._ready: tuple[DocIndex, str] | None = None
    self._bad: str | None = None

  def _load(self, path: str) -> None:
    self._pending = (path, self._pool.submit(load_index, path, self.corpus, self.dim,
                                             self.options))

  def _collect(self) -> None:
    """Moves a finished load to `_ready` (or logs its failure); starts loading a newer index."""
    if self._pending is not None:
      path, future = self._pending
      if not future.done():
        return
      self._pending = None
      try:
        self._ready = (future.result(), path)
      except Exception as e:  # noqa: BLE001  (a bad index must not stop training)
        logging.warning("Could not load the index %s (%s); training goes on with %s.", path, e,
                        self.current_path)
        self._bad = path
      return
    if self._ready is None and time.monotonic() >= self._next_look:
      self._next_look = time.monotonic() + self._look_every_s
      path = latest_index_dir(self.root)
      if path and path != self.current_path and path != self._bad:
        self._load(path)

  def poll(self) -> tuple[DocIndex, str] | None:
    """A newer index when one has finished loading (on every host), else None; never blocks on
    a load."""
    self._collect()
    if self.agree:
      mine = index_step(self._ready[1]) if self._ready is not None else -1
      steps = distributed.allgather_rows(np.array([mine], np.int64))
      if steps.min() != steps.max():  # hosts hold different versions: all go for the newest
        newest = index_path(self.root, int(steps.max()))
        if mine < steps.max() and self._pending is None and newest != self._bad:
          self._ready = None
          self._load(newest)
        return None
    if self._ready is None:
      return None
    got, self._ready = self._ready, None
    self.current_path = got[1]
    return got

  def close(self):
    self._pool.shutdown(wait=False, cancel_futures=True)
