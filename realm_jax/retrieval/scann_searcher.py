"""ScaNN on the host, with exact re-scoring: searcher "scann".

ScaNN (tree + asymmetric hashing, as in the original REALM runs) finds candidates, and its
re-ordering pass scores the best hashed ones exactly (float32, against the stored rows). Queries
left with fewer than k candidates, and non-finite queries, are brute-forced. The rows stay in host
memory; ScaNN is imported only when a searcher is built, and without TensorFlow (`scann_ops`).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import os
import sys
import time

import numpy as np
from jax.sharding import Mesh

from realm_jax import config_checks
from realm_jax.retrieval.exact import brute_force_top_k, finite_scores
from realm_jax.retrieval.rows import HostRows, read_all


def scann_ops():
  """ScaNN's searcher module (`scann.scann_ops_pybind`), imported without running the `scann`
  package's __init__, which also imports TensorFlow when it is installed (the `tf` extra), for
  ScaNN's TensorFlow ops that realm_jax does not use: 8.5 s of a process's start on 2 AMD EPYC
  cores (docs/notes.md, 2026-12-02). A `scann` already imported whole is used as it is; a later
  `import scann` runs its __init__ as usual."""
  if "scann" in sys.modules:
    return sys.modules["scann"].scann_ops_pybind
  spec = importlib.util.find_spec("scann")
  if spec is None:
    raise ModuleNotFoundError("No module named 'scann'", name="scann")
  package = importlib.util.module_from_spec(spec)  # its path, to find the submodules by
  sys.modules["scann"] = package
  try:
    return importlib.import_module("scann.scann_ops.py.scann_ops_pybind")
  finally:
    if sys.modules.get("scann") is package:
      del sys.modules["scann"]


class ScannSearcher:
  """ScaNN's candidates, re-scored exactly (a `Searcher`).

  Args:
    embeddings: [N, D] finite float rows (an array or `HostRows`), kept on the host as `dtype`.
    dtype: storage dtype (float32 or bfloat16); ScaNN indexes them as float32.
    mesh: not used (ScaNN shares the queries out over the host's cores itself).
    num_leaves, num_leaves_to_search, training_sample_size, reorder_num_neighbors: ScaNN's tree
      and re-ordering settings. By default no tree up to 100k rows (asymmetric hashing scores
      every row), else sqrt(N) leaves of which a tenth are searched; 100k training points; the
      100 best hashed scores re-ordered. Raise num_leaves_to_search for recall.
    dims_per_block: dimensions per 4-bit code of the asymmetric hashing: 2 (the default) codes a
      row in D / 4 bytes; 4 or 8 halve or quarter the codes and the hashed scoring time for a
      coarser first pass, which a deeper re-ordering then corrects (fastest at recall 0.95 on the
      10k x 384 MiniLM corpus: 8 dims, 200 re-ordered; benchmarks/README.md).

  `settings` holds the tree and re-ordering settings it was built with.
  """

  on_device = False  # the rows and ScaNN's codes live in host memory
  needs_finite_rows = True  # ScaNN cannot index NaN or infinite rows
  config_keys = ("num_leaves", "num_leaves_to_search", "reorder_num_neighbors", "dims_per_block",
                 "training_sample_size")

  def __init__(self, embeddings: np.ndarray | HostRows, dtype: np.dtype,
               mesh: Mesh | None = None, *,
               num_leaves: int | None = None, num_leaves_to_search: int | None = None,
               training_sample_size: int = 100_000, reorder_num_neighbors: int = 100,
               dims_per_block: int = 2):
    del mesh
    config_checks.whole_number(
        "dims_per_block", dims_per_block, 1, embeddings.shape[1],
        " (dimensions per ScaNN code, up to the embedding dimension; 2 by default)")
    tree = dict(num_leaves=num_leaves, num_leaves_to_search=num_leaves_to_search,
                training_sample_size=training_sample_size)
    for name, value in tree.items():
      if value is not None:
        config_checks.whole_number(name, value, 1)
    config_checks.whole_number(
        "reorder_num_neighbors", reorder_num_neighbors, 1, None,
        " (ScaNN's best hashed candidates re-scored exactly; 100 by default, more for recall)")
    self.count = len(embeddings)
    self._emb = read_all(embeddings).astype(dtype, copy=False)  # [N, D]
    self._reorder_num_neighbors = int(reorder_num_neighbors)
    self._scann = self._build(num_leaves, num_leaves_to_search, training_sample_size,
                              int(reorder_num_neighbors), int(dims_per_block))

  def _build(self, num_leaves, num_leaves_to_search, training_sample_size, reorder,
             dims_per_block):
    n = self.count
    if num_leaves is None:
      # ScaNN's rule of thumb: partition only beyond 100k rows, into ~sqrt(N) leaves. Searching a
      # tenth of them is REALM's setting (1000 leaves, 100 searched for 13M blocks).
      num_leaves = math.isqrt(n) if n > 100_000 else 1
    num_leaves = min(num_leaves, n)
    if num_leaves_to_search is None:
      num_leaves_to_search = max(1, num_leaves // 10)
    num_leaves_to_search = min(num_leaves_to_search, num_leaves)
    db = np.ascontiguousarray(self._emb, dtype=np.float32)
    start = time.perf_counter()
    builder = scann_ops().builder(db, reorder, "dot_product")
    if num_leaves > 1:  # a tree of one leaf fails to train; without a tree AH scores every row
      builder = builder.tree(num_leaves=num_leaves, num_leaves_to_search=num_leaves_to_search,
                             training_sample_size=min(training_sample_size, n))
    searcher = builder.score_ah(
        dims_per_block, anisotropic_quantization_threshold=0.2,
        training_sample_size=min(training_sample_size, n)).reorder(reorder).build()
    self.settings = dict(num_leaves=num_leaves, num_leaves_to_search=num_leaves_to_search,
                         reorder_num_neighbors=reorder, dims_per_block=dims_per_block)
    logging.info("ScaNN over %d rows (%s) built in %.1f s", n, self.settings,
                 time.perf_counter() - start)
    return searcher

  def retune(self, num_leaves_to_search: int | None = None,
             reorder_num_neighbors: int | None = None) -> None:
    """Changes the query-time settings without building again: leaves searched (at most the
    tree's leaves) and hashed candidates re-scored exactly; None keeps a setting."""
    if num_leaves_to_search is not None:
      config_checks.whole_number("num_leaves_to_search", num_leaves_to_search, 1,
                                 self.settings["num_leaves"], " (at most the tree's leaves)")
      self.settings["num_leaves_to_search"] = int(num_leaves_to_search)
    if reorder_num_neighbors is not None:
      config_checks.whole_number("reorder_num_neighbors", reorder_num_neighbors, 1)
      self.settings["reorder_num_neighbors"] = self._reorder_num_neighbors = int(
          reorder_num_neighbors)

  def embeddings(self) -> np.ndarray:
    """The stored [N, D] rows, in the storage dtype."""
    return self._emb

  def rows(self, lo: int, hi: int) -> np.ndarray:
    """Rows [lo, hi), in the storage dtype (a view)."""
    return self._emb[lo:hi]

  def search(self, queries: np.ndarray, k: int, exclude_rows: np.ndarray):
    """Scores [Q, k] float32 (descending) and rows [Q, k] int64 of `queries` [Q, D] float32, never
    one of `exclude_rows` [Q, E] int32 (-1: nothing). One ScaNN call for all queries; queries left
    with < k candidates, and non-finite queries (which ScaNN fails on when a tree is used), are
    brute-forced."""
    top_scores = np.full((len(queries), k), -np.inf, np.float32)
    top_rows = np.zeros((len(queries), k), np.int64)
    finite = np.isfinite(queries).all(axis=1)
    if finite.any():
      top_scores[finite], top_rows[finite] = self._scann_top_k(queries[finite], k,
                                                               exclude_rows[finite])
    short = np.isneginf(top_scores[:, -1])
    if short.any():
      top_scores[short], top_rows[short] = brute_force_top_k(
          queries[short], self._emb, k, exclude_rows[short])
    return top_scores, top_rows

  def _scann_top_k(self, queries, k, exclude_rows):
    """Top-k of ScaNN's candidates without the excluded rows (-inf where there are too few)."""
    num_excluded = exclude_rows.shape[1]
    candidates = min(self.count, k + num_excluded)
    # ScaNN's re-ordering pass scores the best `pre_reorder` hashed candidates exactly (float32
    # inner products with the stored rows), so its distances are the exact scores already. The
    # excluded rows may be among them: re-order as many more.
    rows, dist = self._scann.search_batched_parallel(
        queries, final_num_neighbors=candidates,
        pre_reorder_num_neighbors=min(self.count, max(candidates,
                                                      self._reorder_num_neighbors + num_excluded)),
        leaves_to_search=(self.settings["num_leaves_to_search"]
                          if self.settings["num_leaves"] > 1 else None),
        batch_size=-(-len(queries) // (os.cpu_count() or 1)))  # a share of the queries per core
    rows = rows.astype(np.int64)  # [Q, C]
    # ScaNN pads with NaN distances when its searched leaves hold fewer than C rows.
    drop = np.isnan(dist)
    for e in range(num_excluded):  # [Q, C] at a time, not [Q, C, E]
      drop |= rows == exclude_rows[:, e:e + 1]
    scores = np.where(drop, -np.inf, finite_scores(dist)).astype(np.float32)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]  # [Q, k]
    return np.take_along_axis(scores, order, axis=1), np.take_along_axis(rows, order, axis=1)
