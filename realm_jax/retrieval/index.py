"""Maximum-inner-product search over block embeddings, and its versioned on-disk form.

`DocIndex` holds the [N, D] embeddings of the corpus blocks with their int64 block ids and answers
top-k queries in one of three ways:

* "exact": embeddings sharded along N over the "data" axis of a mesh; each device takes the top-k of
  its shard (`jax.lax.top_k` under `jax.shard_map`), then the per-shard candidates are merged with
  another top-k. One jitted function, compiled once per (query batch, k, exclusions) shape.
* "approx": the same with `jax.lax.approx_max_k` per shard (exact on CPU, fast on TPU).
* "scann": ScaNN on the host (tree + asymmetric hashing, as in the original REALM runs), whose
  re-ordering pass scores the best hashed candidates exactly (float32, against the stored rows).

Every searcher can exclude given block ids per query (REALM drops the block a masked sentence came
from), and never returns padding or excluded rows, even for queries with non-finite values (whose
NaN or infinite scores rank below every finite one: a diverged model still gets valid rows, and
its step fails on its own loss, not on an index error). An index is saved as `index.safetensors`
+ `manifest.json` (locally: written into a temporary directory and renamed into place; on gs://:
the manifest uploaded last, see realm_jax/io_utils.py), and counts as saved only once its manifest
exists. The manifest holds the CRC-32 of the arrays, which `load` checks: a file damaged after it
was saved (even with its size unchanged) is refused, not searched.
`publish_index` / `latest_index_dir` keep a `LATEST` pointer next to numbered index directories for
an asynchronously refreshed index.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import time
import uuid
import zlib
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from realm_jax.io_utils import as_path, atomic_write_dir, local_file, read_json, write_json

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ARRAYS = "index.safetensors"
LATEST = "LATEST"
SEARCHERS = ("exact", "approx", "scann")
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(jnp.bfloat16)}
_INDEX_DIR = re.compile(r"index-(\d+)")


def _sharded_top_k(emb, queries, exclude_rows, k, *, count, mesh, recall_target, precision):
  """Top-k rows of `queries @ emb.T` over "data"-sharded rows, leaving out padding and exclusions.

  Args:
    emb: [N_pad, D] embeddings, sharded along N over mesh axis "data"; rows >= `count` are padding.
    queries: [Q, D] float32, replicated.
    exclude_rows: [Q, E] int32 global row indices never to return (-1: nothing), replicated.
    k: results per query (static); at most the number of rows each query may return.
    count: number of real rows (static).
    recall_target: None for exact `top_k` per shard, else `approx_max_k`'s recall target.

  Returns:
    scores [Q, k] float32 in descending order and their global rows [Q, k] int32.
  """
  shard_rows = emb.shape[0] // mesh.shape["data"]
  local_k = min(k, shard_rows)

  def local_top_k(emb, queries, exclude_rows):
    scores = _finite(jnp.einsum("qd,nd->qn", queries, emb, precision=precision,
                                preferred_element_type=jnp.float32))  # [Q, S]
    start = jax.lax.axis_index("data") * shard_rows
    scores = jnp.where(start + jnp.arange(shard_rows) < count, scores, -jnp.inf)
    local = exclude_rows - start  # [Q, E]
    # Rows of other shards (and -1) point one past the end, where mode="drop" ignores them.
    local = jnp.where((exclude_rows >= 0) & (local >= 0) & (local < shard_rows), local, shard_rows)
    scores = scores.at[jnp.arange(scores.shape[0])[:, None], local].set(-jnp.inf, mode="drop")
    if recall_target is None:
      top_scores, top_rows = jax.lax.top_k(scores, local_k)
    else:
      top_scores, top_rows = jax.lax.approx_max_k(scores, local_k, recall_target=recall_target)
    return top_scores, top_rows + start  # [Q, local_k] each

  # Per-shard candidates side by side: [Q, shards * local_k] each.
  scores, rows = jax.shard_map(
      local_top_k, mesh=mesh, in_specs=(P("data"), P(), P()),
      out_specs=(P(None, "data"), P(None, "data")))(emb, queries, exclude_rows)
  top_scores, pos = jax.lax.top_k(scores, k)
  return top_scores, jnp.take_along_axis(rows, pos, axis=1)


def _require_whole(name, value, low, high=None, what=""):
  """ValueError naming `name` unless `value` is an int (not a bool) in [low, high]."""
  if (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low
      or (high is not None and value > high)):
    span = f"from {low} to {high}" if high is not None else f">= {low}"
    raise ValueError(f"{name}={value!r}: give a whole number {span}{what}.")


def _finite(scores):
  """NaN and infinite scores as the lowest finite float32, below every real score but above the
  -inf that marks padding and excluded rows (jnp or np arrays)."""
  xp = jnp if isinstance(scores, jax.Array) else np
  lowest = np.finfo(np.float32).min
  return xp.nan_to_num(scores, nan=lowest, posinf=lowest, neginf=lowest)


def arrays_crc32(*arrays: np.ndarray) -> str:
  """CRC-32 of the arrays' bytes in C order, one after another, as 8 hex digits: a check for
  files damaged on disk or in transfer (not for tampering)."""
  # CRC-32 rather than SHA-256 or BLAKE2b: the check must not slow the load of a many-GB index
  # below disk speed. Over 200 MB on one core of a Xeon with SHA instructions, zlib.crc32 ran at
  # 1.6-2.3 GB/s, hashlib's sha256 at 0.9-1.6 and blake2b at 0.7-1.0 (sha256 is slower still
  # without SHA instructions).
  crc = 0
  for a in arrays:
    crc = zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8), crc)
  return f"{crc:08x}"


def brute_force_top_k(queries: np.ndarray, embeddings: np.ndarray, k: int,
                      exclude_rows: np.ndarray | None = None, batch_size: int = 256):
  """Exact top-k in numpy: float32 matmul + argpartition, `batch_size` queries at a time.

  Args:
    queries: [Q, D] float32.
    embeddings: [N, D] (any float dtype; products are taken in float32).
    k: results per query, at most N minus the rows excluded for any query.
    exclude_rows: optional [Q, E] row indices never to return (-1: nothing).

  Returns:
    scores [Q, k] float32 in descending order and their rows [Q, k] int64.
  """
  emb = embeddings.astype(np.float32, copy=False)
  n = len(emb)
  out_scores = np.empty((len(queries), k), np.float32)
  out_rows = np.empty((len(queries), k), np.int64)
  for lo in range(0, len(queries), batch_size):
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite queries: see _finite
      scores = _finite(queries[lo:lo + batch_size].astype(np.float32) @ emb.T)  # [B, N]
    if exclude_rows is not None:
      q, e = np.nonzero(exclude_rows[lo:lo + batch_size] >= 0)
      scores[q, exclude_rows[lo + q, e]] = -np.inf
    top = np.argpartition(scores, n - k, axis=1)[:, n - k:]  # [B, k], unordered
    top_scores = np.take_along_axis(scores, top, axis=1)
    order = np.argsort(-top_scores, axis=1, kind="stable")
    out_scores[lo:lo + batch_size] = np.take_along_axis(top_scores, order, axis=1)
    out_rows[lo:lo + batch_size] = np.take_along_axis(top, order, axis=1)
  return out_scores, out_rows


class DocIndex:
  """Top-k maximum-inner-product search over block embeddings with unique int64 block ids.

  Args:
    embeddings: [N, D] float array (float32 or bfloat16), N >= 1.
    block_ids: [N] unique non-negative int64 ids (hashes, not 0..N-1); results are given as these.
    searcher: "exact", "approx" or "scann" (see the module docstring).
    mesh: devices to shard the embeddings over, on an axis named "data" (default: all devices).
      Only for "exact" and "approx".
    dtype: storage dtype, "float32" or "bfloat16". Scores are always computed in float32.
    precision: matmul precision of the device searchers; "highest" keeps float32 queries exact on
      TPU/GPU (the default precision there rounds them to bfloat16/TF32: faster, ~1e-3 relative).
    query_batch_size: queries per device call ("exact", "approx"); [query_batch_size,
      N / devices] float32 scores are live on each device at once. Larger query sets are cut into
      batches of this size. ScaNN takes all queries in one call.
    recall_target: recall target of `approx_max_k` ("approx").
    num_leaves, num_leaves_to_search, training_sample_size, reorder_num_neighbors: ScaNN's tree
      and re-ordering settings ("scann"). By default no tree up to 100k rows (asymmetric hashing
      scores every row), else sqrt(N) leaves of which a tenth are searched; 100k training points;
      the 100 best hashed scores re-ordered. Raise num_leaves_to_search for recall.
    dims_per_block: dimensions per 4-bit code of ScaNN's asymmetric hashing ("scann"): 2 (the
      default) codes a row in D / 4 bytes; 4 or 8 halve or quarter the codes and the hashed
      scoring time for a coarser first pass, which a deeper re-ordering then corrects (fastest
      at recall 0.95 on the 10k x 384 MiniLM corpus: 8 dims, 200 re-ordered; benchmarks/README.md).
  """

  def __init__(self, embeddings: np.ndarray, block_ids: np.ndarray, searcher: str = "exact", *,
               mesh: Mesh | None = None, dtype: str = "float32", precision: str = "highest",
               query_batch_size: int = 256, recall_target: float = 0.95,
               num_leaves: int | None = None, num_leaves_to_search: int | None = None,
               training_sample_size: int = 100_000, reorder_num_neighbors: int = 100,
               dims_per_block: int = 2):
    embeddings, block_ids = np.asarray(embeddings), np.asarray(block_ids)
    if searcher not in SEARCHERS:
      raise ValueError(f"Unknown searcher {searcher!r}: use one of {SEARCHERS}.")
    if str(dtype) not in DTYPES:
      raise ValueError(f"Unknown storage dtype {dtype!r}: use one of {tuple(DTYPES)}.")
    if embeddings.ndim != 2:
      raise ValueError(f"embeddings must be [N, D]; got shape {embeddings.shape}.")
    if searcher == "scann":
      _require_whole("dims_per_block", dims_per_block, 1, embeddings.shape[1],
                     " (dimensions per ScaNN code, up to the embedding dimension; 2 by default)")
      tree = dict(num_leaves=num_leaves, num_leaves_to_search=num_leaves_to_search,
                  training_sample_size=training_sample_size)
      for name, value in tree.items():
        if value is not None:
          _require_whole(name, value, 1)
      _require_whole("reorder_num_neighbors", reorder_num_neighbors, 1, None,
                     " (ScaNN's best hashed candidates re-scored exactly; 100 by default, more for "
                     "recall)")
    _require_whole("query_batch_size", query_batch_size, 1)
    if len(embeddings) == 0:
      raise ValueError("Cannot build an empty index: embeddings has no rows. Embed a corpus first.")
    if len(embeddings) >= 2**31:
      raise ValueError(f"{len(embeddings)} rows do not fit int32 row indices; split the index.")
    if block_ids.shape != (len(embeddings),) or not np.issubdtype(block_ids.dtype, np.integer):
      raise ValueError(f"block_ids must be [N] = [{len(embeddings)}] integers; got "
                       f"{block_ids.dtype} of shape {block_ids.shape}.")
    block_ids = block_ids.astype(np.int64)
    order = np.argsort(block_ids, kind="stable")
    sorted_ids = block_ids[order]
    duplicated = sorted_ids[1:][sorted_ids[1:] == sorted_ids[:-1]]
    if len(duplicated):
      raise ValueError(f"{len(duplicated)} duplicate block ids, e.g. {duplicated[:5].tolist()}: "
                       "every block needs its own id (check how block ids are hashed).")
    if sorted_ids[0] < 0:
      raise ValueError(f"Block ids must be non-negative (-1 means 'nothing' in exclude_ids); got "
                       f"{sorted_ids[0]}.")

    self.searcher = searcher
    self.count, self.dim = embeddings.shape
    self.dtype = DTYPES[str(dtype)]
    self.block_ids = block_ids  # [N] row -> block id
    self._sorted_ids, self._sorted_rows = sorted_ids, order  # block id -> row, via searchsorted
    self.query_batch_size = query_batch_size
    self.manifest: dict | None = None  # set by `load`, with the directory it came from
    self.directory: str | None = None
    if searcher == "approx" and not 0 < recall_target <= 1:
      raise ValueError(f"recall_target={recall_target!r}: give a recall in (0, 1].")
    if searcher == "scann":
      bad = np.flatnonzero(~np.isfinite(embeddings).all(axis=1))
      if len(bad):  # ScaNN cannot index them (exact search never returns them)
        raise ValueError(f"{len(bad)} embedding rows are not finite (NaN or infinite), e.g. block "
                         f"ids {block_ids[bad[:5]].tolist()}: the model that embedded them has "
                         "diverged; re-embed the corpus with finite weights.")
      self._host_emb = embeddings.astype(self.dtype, copy=False)  # [N, D]
      self._scann = self._build_scann(num_leaves, num_leaves_to_search, training_sample_size,
                                      int(reorder_num_neighbors), int(dims_per_block))
      self._reorder_num_neighbors = int(reorder_num_neighbors)
    else:
      self._init_device(embeddings, mesh, precision,
                        recall_target if searcher == "approx" else None)

  def _init_device(self, embeddings, mesh, precision, recall_target):
    mesh = mesh if mesh is not None else Mesh(np.array(jax.devices()), ("data",))
    if "data" not in mesh.axis_names:
      raise ValueError(f"The mesh needs an axis named 'data' to shard the index over; it has "
                       f"{mesh.axis_names}.")
    shards = mesh.shape["data"]
    padded = -(-self.count // shards) * shards
    sharding = NamedSharding(mesh, P("data"))

    def shard(index):  # each device's rows on their own: no padded host copy of the whole index
      start, stop, _ = index[0].indices(padded)
      out = np.zeros((stop - start, self.dim), self.dtype)
      real = embeddings[start:min(stop, self.count)]
      out[:len(real)] = real
      return out

    self._emb = jax.make_array_from_callback((padded, self.dim), sharding, shard)  # [N_pad, D]
    replicated = NamedSharding(mesh, P())
    self._search_fn = jax.jit(
        functools.partial(_sharded_top_k, count=self.count, mesh=mesh, recall_target=recall_target,
                          precision=jax.lax.Precision(precision)),
        static_argnums=3, in_shardings=(sharding, replicated, replicated),
        out_shardings=replicated)

  def _build_scann(self, num_leaves, num_leaves_to_search, training_sample_size, reorder,
                   dims_per_block):
    import scann  # local: importing ScaNN loads TensorFlow (seconds)

    n = self.count
    if num_leaves is None:
      # ScaNN's rule of thumb: partition only beyond 100k rows, into ~sqrt(N) leaves. Searching a
      # tenth of them is REALM's setting (1000 leaves, 100 searched for 13M blocks).
      num_leaves = math.isqrt(n) if n > 100_000 else 1
    num_leaves = min(num_leaves, n)
    if num_leaves_to_search is None:
      num_leaves_to_search = max(1, num_leaves // 10)
    num_leaves_to_search = min(num_leaves_to_search, num_leaves)
    db = np.ascontiguousarray(self._host_emb, dtype=np.float32)
    start = time.perf_counter()
    builder = scann.scann_ops_pybind.builder(db, reorder, "dot_product")
    if num_leaves > 1:  # a tree of one leaf fails to train; without a tree AH scores every row
      builder = builder.tree(num_leaves=num_leaves, num_leaves_to_search=num_leaves_to_search,
                             training_sample_size=min(training_sample_size, n))
    searcher = builder.score_ah(
        dims_per_block, anisotropic_quantization_threshold=0.2,
        training_sample_size=min(training_sample_size, n)).reorder(reorder).build()
    self.scann_settings = dict(num_leaves=num_leaves, num_leaves_to_search=num_leaves_to_search,
                               reorder_num_neighbors=reorder, dims_per_block=dims_per_block)
    logging.info("ScaNN over %d rows (%s) built in %.1f s", n, self.scann_settings,
                 time.perf_counter() - start)
    return searcher

  def embeddings(self) -> np.ndarray:
    """The stored [N, D] embeddings on the host, in the storage dtype."""
    if self.searcher == "scann":
      return self._host_emb
    if not self._emb.is_fully_addressable:
      raise ValueError("This index is sharded over several hosts; each holds only its own rows. "
                       "Save it from the embeddings it was built from (save(..., embeddings=)).")
    return np.asarray(jax.device_get(self._emb))[:self.count]

  def _rows(self, ids: np.ndarray) -> np.ndarray:
    """Row of each block id (same shape), -1 for ids not in the index (and for -1)."""
    pos = np.minimum(np.searchsorted(self._sorted_ids, ids), self.count - 1)
    return np.where(self._sorted_ids[pos] == ids, self._sorted_rows[pos], -1)

  def _check(self, queries, k, exclude_ids):
    """Validated float32 queries [Q, D] and int32 excluded rows [Q, E]."""
    if not isinstance(k, (int, np.integer)) or k < 1:
      raise ValueError(f"k must be a positive integer; got {k!r}.")
    queries = np.asarray(queries)
    if queries.ndim != 2:
      raise ValueError(f"queries must be [Q, D]; got shape {queries.shape}. For one query pass "
                       "queries[None].")
    if queries.shape[1] != self.dim:
      raise ValueError(f"Query dimension {queries.shape[1]} does not match the index dimension "
                       f"{self.dim}: embed queries with the same retriever as the index.")
    num_queries = len(queries)
    if exclude_ids is None:
      exclude_rows = np.full((num_queries, 1), -1, np.int32)
    else:
      exclude_ids = np.asarray(exclude_ids)
      if exclude_ids.size and not np.issubdtype(exclude_ids.dtype, np.integer):
        raise ValueError(f"exclude_ids must be integer block ids; got dtype {exclude_ids.dtype} "
                         "(a float cannot hold every int64 id exactly).")
      if exclude_ids.ndim == 1:
        exclude_ids = exclude_ids[:, None]
      if exclude_ids.ndim != 2 or len(exclude_ids) != num_queries or exclude_ids.shape[1] == 0:
        raise ValueError(f"exclude_ids must be [Q] or [Q, E] with Q = {num_queries} and E >= 1 "
                         f"(-1 for 'nothing'); got shape {exclude_ids.shape}.")
      exclude_rows = self._rows(exclude_ids.astype(np.int64)).astype(np.int32)
    # Each query can return the rows it does not exclude (an id listed twice counts once).
    ordered = np.sort(exclude_rows, axis=1)
    distinct = (ordered >= 0) & np.concatenate(
        [np.ones((num_queries, 1), bool), ordered[:, 1:] != ordered[:, :-1]], axis=1)
    returnable = self.count - distinct.sum(1).max(initial=0)
    if k > returnable:
      raise ValueError(f"k = {k} is more than the {returnable} rows a query can return (index of "
                       f"{self.count} rows, minus excluded ones); ask for k <= {returnable}.")
    return queries.astype(np.float32, copy=False), exclude_rows

  def search(self, queries: np.ndarray, k: int, exclude_ids: np.ndarray | None = None):
    """Top-k blocks for each query, by inner product.

    Args:
      queries: [Q, D] float queries.
      k: results per query; at most N minus the blocks excluded for any query.
      exclude_ids: None, or int64 block ids [Q] or [Q, E] never to return for that query (-1 and ids
        not in the index exclude nothing).

    Returns:
      scores [Q, k] float32 in descending order and their block ids [Q, k] int64.
    """
    queries, exclude_rows = self._check(queries, k, exclude_ids)
    num_queries = len(queries)
    if num_queries == 0:
      return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
    if self.searcher == "scann":  # one call: ScaNN shares the queries out over the cores itself
      scores, rows = self._search_scann(queries, k, exclude_rows)
      return scores, self.block_ids[rows]
    # Fewer queries than a batch are padded to a power of two up to 32, then to a multiple of 32:
    # a few compiled shapes, not one for each query count, and at most 31 padded queries above 32.
    bucket = (1 << (num_queries - 1).bit_length() if num_queries <= 32
              else -(-num_queries // 32) * 32)
    batch = min(bucket, self.query_batch_size)
    parts = []
    for lo in range(0, num_queries, batch):
      q, ex = queries[lo:lo + batch], exclude_rows[lo:lo + batch]
      if len(q) < batch:  # pad the last batch so that every call has the same shape (no recompile)
        q = np.concatenate([q, np.zeros((batch - len(q), self.dim), np.float32)])
        ex = np.concatenate([ex, np.full((batch - len(ex), ex.shape[1]), -1, np.int32)])
      parts.append(self._search_fn(self._emb, q, ex, k))
    # Device calls run asynchronously until their results are read here.
    scores = np.concatenate([np.asarray(s) for s, _ in parts])[:num_queries]
    rows = np.concatenate([np.asarray(r) for _, r in parts])[:num_queries]
    return scores, self.block_ids[rows]

  def _search_scann(self, queries, k, exclude_rows):
    """ScaNN's exactly re-scored candidates; queries left with < k of them, and non-finite queries
    (which ScaNN fails on when a tree is used), are brute-forced."""
    top_scores = np.full((len(queries), k), -np.inf, np.float32)
    top_rows = np.zeros((len(queries), k), np.int64)
    finite = np.isfinite(queries).all(axis=1)
    if finite.any():
      top_scores[finite], top_rows[finite] = self._scann_top_k(queries[finite], k,
                                                               exclude_rows[finite])
    short = np.isneginf(top_scores[:, -1])
    if short.any():
      top_scores[short], top_rows[short] = brute_force_top_k(
          queries[short], self._host_emb, k, exclude_rows[short])
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
        batch_size=-(-len(queries) // (os.cpu_count() or 1)))  # a share of the queries per core
    rows = rows.astype(np.int64)  # [Q, C]
    # ScaNN pads with NaN distances when its searched leaves hold fewer than C rows.
    drop = np.isnan(dist)
    for e in range(num_excluded):  # [Q, C] at a time, not [Q, C, E]
      drop |= rows == exclude_rows[:, e:e + 1]
    scores = np.where(drop, -np.inf, _finite(dist)).astype(np.float32)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]  # [Q, k]
    return np.take_along_axis(scores, order, axis=1), np.take_along_axis(rows, order, axis=1)

  def save(self, directory: str | os.PathLike, *, step: int, model_fingerprint: str,
           corpus_fingerprint: str, embeddings: np.ndarray | None = None) -> None:
    """Writes `index.safetensors` and `manifest.json` into `directory`, atomically (replacing it).

    Args:
      directory: where the index goes, local or gs://; it appears complete or not at all (on gs://
        the manifest is uploaded after the arrays: an index without one is not complete).
      step: training step of the retriever that embedded the corpus.
      model_fingerprint: identifies those retriever weights.
      corpus_fingerprint: identifies the blocks (text and order); `load` can insist on it.
      embeddings: the [N, D] rows this index was built from, when the caller still has them: an
        index sharded over several hosts holds only its own rows on each.
    """
    from safetensors.numpy import save_file  # local: only saving and loading need it

    _require_whole("step", step, 0, None, " (the training step)")
    # A new id for each save, in the manifest and in the arrays' header: `load` can tell a
    # manifest from the arrays of another save of the same directory (a reader racing a writer),
    # and an upload to gs:// is never skipped as unchanged.
    save_id = uuid.uuid4().hex
    manifest = {"format_version": FORMAT_VERSION, "step": int(step),
                "model_fingerprint": str(model_fingerprint),
                "corpus_fingerprint": str(corpus_fingerprint), "dtype": self.dtype.name,
                "count": self.count, "dim": self.dim, "save_id": save_id}
    if embeddings is None:
      embeddings = self.embeddings()
    elif np.shape(embeddings) != (self.count, self.dim):
      raise ValueError(f"embeddings has shape {np.shape(embeddings)}; this index is "
                       f"[{self.count}, {self.dim}].")
    arrays = {"embeddings": np.asarray(embeddings).astype(self.dtype, copy=False),
              "block_ids": self.block_ids}
    manifest["arrays_crc32"] = arrays_crc32(arrays["embeddings"], arrays["block_ids"])

    def write(tmp):
      save_file(arrays, os.path.join(tmp, ARRAYS), metadata={"save_id": save_id})
      write_json(os.path.join(tmp, MANIFEST), manifest)

    atomic_write_dir(directory, write, marker=MANIFEST)

  @classmethod
  def load(cls, directory: str | os.PathLike, *, expected_dim: int | None = None,
           expected_corpus_fingerprint: str | None = None,
           expected_model_fingerprint: str | None = None, searcher: str = "exact",
           mesh: Mesh | None = None, dtype: str | None = None, **options) -> "DocIndex":
    """Reads an index written by `save`; `options` go to the constructor. Its arrays must have
    the CRC-32 its manifest records (indexes saved before manifests had one are not checked).

    Args:
      expected_dim / expected_corpus_fingerprint / expected_model_fingerprint: if given, must
        match the manifest (the last: the document tower that embedded the blocks).
      dtype: storage dtype to use (default: the saved one).
    """
    directory = os.fspath(directory)
    manifest = read_manifest(directory)
    if expected_dim is not None and manifest["dim"] != expected_dim:
      raise ValueError(f"The index in {directory} has dimension {manifest['dim']}, but "
                       f"{expected_dim} was expected: rebuild it with the current retriever.")
    for key, expected, what, fix in (
        ("corpus_fingerprint", expected_corpus_fingerprint, "built from corpus",
         "rebuild the index for this corpus."),
        ("model_fingerprint", expected_model_fingerprint, "embedded by retriever weights",
         "rebuild the index with these weights (experiments/build_index.py), or configure the "
         "weights that built it.")):
      if expected is not None and manifest[key] != expected:
        raise ValueError(f"The index in {directory} was {what} {manifest[key]!r}, but "
                         f"{expected!r} was expected: {fix}")
    emb, ids, save_id = _read_arrays(directory)
    if (emb is None or ids is None or emb.shape != (manifest["count"], manifest["dim"])
        or ids.shape != (manifest["count"],) or emb.dtype != DTYPES[manifest["dtype"]]):
      raise ValueError(f"{directory}/{ARRAYS} does not hold the [{manifest['count']}, "
                       f"{manifest['dim']}] {manifest['dtype']} embeddings and block ids its "
                       "manifest promises; rebuild the index.")
    if save_id != manifest.get("save_id"):  # both None for indexes saved before save_id existed
      raise ValueError(f"{directory} was saved again while it was being read (its manifest and "
                       "arrays come from different saves); load it again.")
    _check_crc(directory, manifest, emb, ids)
    index = cls(emb, ids, searcher, mesh=mesh, dtype=dtype or manifest["dtype"], **options)
    index.manifest, index.directory = manifest, directory
    return index


SCANN_SETTINGS = ("num_leaves", "num_leaves_to_search", "reorder_num_neighbors", "dims_per_block",
                  "training_sample_size")


def index_options(index_config) -> dict:
  """`DocIndex` keyword arguments from a config's `index` section: `searcher`, `dtype` and, for
  searcher "scann", the non-zero entries of `index.scann` (0: DocIndex's default)."""
  for key, allowed in (("searcher", SEARCHERS), ("dtype", tuple(DTYPES))):
    if index_config[key] not in allowed:
      raise ValueError(f"--config.index.{key}={index_config[key]!r}: use one of {allowed}.")
  options = dict(searcher=index_config.searcher, dtype=index_config.dtype)
  scann = dict(index_config.get("scann") or {})  # absent in configs written before it existed
  unknown = sorted(set(scann) - set(SCANN_SETTINGS))
  if unknown:
    raise ValueError(f"Unknown config.index.scann setting(s) {unknown}: use {SCANN_SETTINGS}.")
  for key, value in scann.items():
    _require_whole(f"--config.index.scann.{key}", value, 0, None, " (0: DocIndex's default)")
  if index_config.searcher == "scann":
    options.update({key: value for key, value in scann.items() if value})
  return options


def _read_arrays(directory: str):
  """(embeddings, block_ids, save_id) of `directory`/index.safetensors (None for what it lacks);
  a clear error for a truncated or corrupt file."""
  from safetensors import SafetensorError, safe_open  # local: only saving and loading need it

  with local_file(os.path.join(directory, ARRAYS)) as path:  # safe_open reads local files only
    try:
      with safe_open(path, framework="numpy") as f:
        names = set(f.keys())
        arrays = [f.get_tensor(n) if n in names else None for n in ("embeddings", "block_ids")]
        return (*arrays, (f.metadata() or {}).get("save_id"))
    except (SafetensorError, OSError) as e:
      raise ValueError(f"{directory}/{ARRAYS} cannot be read ({e}): the file is truncated or "
                       f"corrupt. Delete {directory} and rebuild the index.") from e


def _check_crc(directory: str, manifest: dict, emb: np.ndarray, ids: np.ndarray) -> None:
  """ValueError unless the arrays read have the CRC-32 of the manifest (none before it existed)."""
  want = manifest.get("arrays_crc32")
  if want is None:  # saved before realm_jax wrote checksums
    logging.info("%s has no checksum in its manifest (saved by an older realm_jax): its arrays "
                 "are not verified. Rebuild it to have them verified.", directory)
    return
  got = arrays_crc32(emb, ids)
  if got != want:
    raise ValueError(
        f"{directory}/{ARRAYS} is corrupt: its arrays' CRC-32 is {got}, but its manifest says "
        f"{want} (the file was damaged after it was saved). Delete {directory} and rebuild the "
        "index (e.g. experiments/build_index.py).")


def read_manifest(directory: str | os.PathLike) -> dict:
  """The validated manifest of a saved index; a clear error if it is missing, corrupt or too new."""
  path = os.path.join(os.fspath(directory), MANIFEST)
  if not as_path(path).exists():
    raise FileNotFoundError(f"{path} does not exist: {directory} is not a saved index (or its "
                            "write did not finish). Save one with DocIndex.save or publish_index.")
  try:
    manifest = read_json(path)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is corrupt: not valid JSON ({e.msg}: line {e.lineno}, column "
                     f"{e.colno}). Delete {directory} and rebuild the index.") from e
  except UnicodeDecodeError as e:
    raise ValueError(f"{path} is corrupt: not UTF-8 text (byte {e.start}). Delete {directory} "
                     "and rebuild the index.") from e
  keys = ("format_version", "step", "model_fingerprint", "corpus_fingerprint", "dtype", "count",
          "dim")
  if not isinstance(manifest, dict) or any(key not in manifest for key in keys):
    raise ValueError(f"{path} lacks some of {keys}; delete {directory} and rebuild it.")
  if manifest["format_version"] != FORMAT_VERSION:
    raise ValueError(f"{path} has format_version {manifest['format_version']!r}; this realm_jax "
                     f"reads version {FORMAT_VERSION}. Rebuild the index, or use the realm_jax "
                     "that wrote it.")
  bad = [k for k in ("step", "count", "dim") if isinstance(manifest[k], bool)
         or not isinstance(manifest[k], int) or manifest[k] < (1 if k != "step" else 0)]
  if bad:
    raise ValueError(f"{path} has invalid {', '.join(f'{k}={manifest[k]!r}' for k in bad)} (whole "
                     f"numbers expected); delete {directory} and rebuild it.")
  if manifest["dtype"] not in DTYPES:
    raise ValueError(f"{path} has unknown dtype {manifest['dtype']!r}; expected one of "
                     f"{tuple(DTYPES)}.")
  return manifest


def index_path(root: str | os.PathLike, step: int) -> str:
  """Where `publish_index` puts the index of training step `step`."""
  return os.path.join(os.fspath(root), f"index-{step:08d}")


def publish_index(root: str | os.PathLike, index: DocIndex, step: int, *, model_fingerprint: str,
                  corpus_fingerprint: str, embeddings: np.ndarray | None = None) -> str:
  """Saves `index` as `root/index-{step:08d}`, then points `root/LATEST` at it; returns its path.

  The index directory is complete (manifest written last) before LATEST names it, and LATEST is
  replaced in one piece, so a reader that follows LATEST never sees a partial index. `embeddings`:
  see `DocIndex.save`.
  """
  path = index_path(root, step)
  index.save(path, step=step, model_fingerprint=model_fingerprint,
             corpus_fingerprint=corpus_fingerprint, embeddings=embeddings)
  point_latest(root, path)
  return path


def index_step(path: str | os.PathLike | None) -> int:
  """The training step of the index directory `path` (named `index-<step>`); -1 for None."""
  if path is None:
    return -1
  match = _INDEX_DIR.fullmatch(os.path.basename(os.fspath(path).rstrip("/")))
  if match is None:
    raise ValueError(f"{path} is not an index-<step> directory.")
  return int(match[1])


def point_latest(root: str | os.PathLike, path: str | os.PathLike) -> None:
  """Makes `root/LATEST` name the index directory `path` (its name, in `root`), in one piece."""
  step = index_step(path)
  write_json(os.path.join(os.fspath(root), LATEST),
             {"directory": os.path.basename(os.fspath(path).rstrip("/")), "step": step})


def latest_index_dir(root: str | os.PathLike) -> str | None:
  """The index that `root/LATEST` names, or else the complete `index-*` of the highest step.

  LATEST wins over a higher step because a run resumed from an older checkpoint republishes an
  older step on purpose. Only an index whose manifest is valid and whose arrays exist is returned:
  never the temporary directory of an interrupted local write, nor an index directory whose
  upload to gs:// has not finished (its manifest goes last). None if there is no complete index.

  Raises:
    ValueError (read_manifest's) when there is no complete index but a damaged one: a manifest
    that exists but is corrupt (it is written whole, so it was damaged afterwards) or too new.
  """
  root = os.fspath(root)
  if not as_path(root).is_dir():
    return None
  damaged = []

  def complete(name):
    try:
      read_manifest(os.path.join(root, name))
    except OSError:  # no manifest yet (or not readable now): not complete
      return False
    except ValueError as e:
      damaged.append(e)
      return False
    return as_path(os.path.join(root, name, ARRAYS)).exists()

  try:
    name = read_json(os.path.join(root, LATEST))["directory"]
    if isinstance(name, str) and _INDEX_DIR.fullmatch(name) and complete(name):
      return os.path.join(root, name)
  except (OSError, ValueError, KeyError, TypeError):
    pass
  for _, name in index_dirs(root):
    if complete(name):
      if damaged:
        _warn_once(f"{damaged[0]} Using {os.path.join(root, name)} instead.")
      return os.path.join(root, name)
  if damaged:
    raise damaged[0]
  return None


@functools.cache
def _warn_once(message: str) -> None:
  # latest_index_dir is polled at every training step (AsyncIndexWatcher).
  logging.warning(message)


def index_dirs(root: str | os.PathLike) -> list[tuple[int, str]]:
  """(step, name) of the `index-<step>` directories of `root`, complete or not, newest first."""
  if not as_path(root).is_dir():
    return []
  found = ((_INDEX_DIR.fullmatch(p.name), p.name) for p in as_path(root).iterdir())
  return sorted(((int(m[1]), name) for m, name in found if m), reverse=True)


def prune_indexes(root: str | os.PathLike, keep: int, protect: Iterable[str] = ()) -> list[str]:
  """Deletes the `index-*` directories of `root` but the `keep` of the highest steps, the one
  LATEST names and those named in `protect` (names or paths); returns the deleted paths.

  Indexes of steps above the one LATEST names were left by a run that then resumed from an older
  checkpoint (LATEST moved back with it): they are not among the `keep` newest, and go unless
  protected. Each goes manifest first, so a reader never takes a half-deleted index for a
  complete one. `keep` = 0 keeps everything (REALM refreshes its 13M-block index hundreds of times
  a run).
  """
  if keep < 0:
    raise ValueError(f"keep={keep}: the number of indexes to keep must be >= 0 (0: all).")
  root = os.fspath(root)
  if keep == 0 or not as_path(root).is_dir():
    return []
  found = index_dirs(root)
  latest = latest_index_dir(root)
  limit = math.inf if latest is None else index_step(latest)
  current = [name for step, name in found if step <= limit]  # newest first
  spared = set(current[:keep]) | {os.path.basename(os.fspath(p).rstrip("/")) for p in protect}
  if latest is not None:
    spared.add(os.path.basename(latest))
  deleted = []
  for _, name in found:
    if name not in spared:
      path = as_path(os.path.join(root, name))
      (path / MANIFEST).unlink(missing_ok=True)
      path.rmtree()
      deleted.append(os.path.join(root, name))
  return deleted
