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

import jax
import numpy as np

from realm_jax.retrieval.embed import embed_in_buckets
from realm_jax.retrieval.index import DocIndex, latest_index_dir, publish_index, read_manifest
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

  def __call__(self, retriever_params) -> np.ndarray:
    if self._inputs is None:  # laid out once: the corpus does not change under a run
      self._inputs = self.corpus.model_inputs(np.arange(len(self.corpus)), self._doc_length,
                                              self._tokenizer)
    return embed_in_buckets(lambda b: self._fn(retriever_params, b), self._inputs,
                            self._batch_size, desc="refreshing index")


def index_fingerprint(retriever_params) -> str:
  return params_fingerprint(retriever_params)


def refresh(root: str, embedder: DocumentEmbedder, retriever_params, step: int,
            index_options: dict) -> tuple[DocIndex, str]:
  """Re-embeds the corpus with `retriever_params` and publishes it as step `step`."""
  params = jax.device_get(retriever_params)
  emb = embedder(params)
  index = DocIndex(emb, embedder.corpus.block_ids, **index_options)
  path = publish_index(root, index, step, model_fingerprint=index_fingerprint(params),
                       corpus_fingerprint=embedder.corpus.fingerprint)
  index.manifest = read_manifest(path)
  return index, path


def load_index(path: str, corpus, dim: int, index_options: dict) -> DocIndex:
  """A published index, checked against the corpus and the retriever's dimension."""
  return DocIndex.load(path, expected_dim=dim, expected_corpus_fingerprint=corpus.fingerprint,
                       **index_options)


class AsyncIndexWatcher:
  """Loads each newly published index in a background thread; `poll()` between steps swaps it in.

  Only complete indexes are ever seen (`latest_index_dir` ignores interrupted writes); an index
  that fails to load is logged and the current one kept.
  """

  def __init__(self, root: str, corpus, dim: int, index_options: dict, current_path: str | None):
    self.root, self.corpus, self.dim, self.options = root, corpus, dim, index_options
    self.current_path = current_path
    self._pool = concurrent.futures.ThreadPoolExecutor(1)
    self._pending: tuple[str, concurrent.futures.Future] | None = None

  def poll(self) -> tuple[DocIndex, str] | None:
    """A newer index when one has finished loading, else None (never blocks on a load)."""
    if self._pending is not None:
      path, future = self._pending
      if not future.done():
        return None
      self._pending = None
      try:
        index = future.result()
      except Exception as e:  # noqa: BLE001  (a bad index must not stop training)
        logging.warning("Could not load the index %s (%s); training goes on with %s.", path, e,
                        self.current_path)
        self._bad = path
        return None
      self.current_path = path
      return index, path
    path = latest_index_dir(self.root)
    if path and path != self.current_path and path != getattr(self, "_bad", None):
      self._pending = (path, self._pool.submit(load_index, path, self.corpus, self.dim,
                                               self.options))
    return None

  def close(self):
    self._pool.shutdown(wait=False, cancel_futures=True)


def index_step(path: str | None) -> int:
  return -1 if path is None else int(os.path.basename(path).split("-")[-1])
