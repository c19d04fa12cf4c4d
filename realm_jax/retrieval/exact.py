"""Top-k inner-product search on device over a sharded mesh ("exact", "approx"), and in numpy.

`ExactSearcher` shards the [N, D] rows along N over the "data" axis of a mesh; each device takes the
top-k of its shard (`jax.lax.top_k` under `jax.shard_map`), then the per-shard candidates are merged
with another top-k. One jitted function, compiled once per (query batch, k, exclusions) shape.
`ApproxSearcher` is the same with `jax.lax.approx_max_k` per shard (exact on CPU, fast on TPU).
`brute_force_top_k` is the numpy reference (and ScaNN's fallback).

NaN and infinite scores (a diverged model's queries) rank below every finite one, so a search never
returns padding or excluded rows: the step fails on its own loss, not on an index error.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from realm_jax import config_checks


def finite_scores(scores):
  """NaN and infinite scores as the lowest finite float32, below every real score but above the
  -inf that marks padding and excluded rows (jnp or np arrays)."""
  xp = jnp if isinstance(scores, jax.Array) else np
  lowest = np.finfo(np.float32).min
  return xp.nan_to_num(scores, nan=lowest, posinf=lowest, neginf=lowest)


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
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite queries: see finite_scores
      scores = finite_scores(queries[lo:lo + batch_size].astype(np.float32) @ emb.T)  # [B, N]
    if exclude_rows is not None:
      q, e = np.nonzero(exclude_rows[lo:lo + batch_size] >= 0)
      scores[q, exclude_rows[lo + q, e]] = -np.inf
    top = np.argpartition(scores, n - k, axis=1)[:, n - k:]  # [B, k], unordered
    top_scores = np.take_along_axis(scores, top, axis=1)
    order = np.argsort(-top_scores, axis=1, kind="stable")
    out_scores[lo:lo + batch_size] = np.take_along_axis(top_scores, order, axis=1)
    out_rows[lo:lo + batch_size] = np.take_along_axis(top, order, axis=1)
  return out_scores, out_rows


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
    scores = finite_scores(jnp.einsum("qd,nd->qn", queries, emb, precision=precision,
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


class ExactSearcher:
  """Exact top-k over rows sharded along N on the devices of a mesh (a `Searcher`).

  Args:
    embeddings: [N, D] float rows; each device receives its own rows, as `dtype` (no padded host
      copy of the whole index is made).
    dtype: storage dtype (float32 or bfloat16). Scores are always computed in float32.
    mesh: devices to shard the rows over, on an axis named "data" (default: all devices).
    precision: matmul precision; "highest" keeps float32 queries exact on TPU/GPU (the default
      precision there rounds them to bfloat16/TF32: faster, ~1e-3 relative).
    query_batch_size: queries per device call; [query_batch_size, N / devices] float32 scores are
      live on each device at once. Larger query sets are cut into batches of this size.
  """

  on_device = True
  needs_finite_rows = False
  config_keys = ()
  recall_target = None  # exact top_k per shard; ApproxSearcher sets approx_max_k's target

  def __init__(self, embeddings: np.ndarray, dtype: np.dtype, mesh: Mesh | None = None, *,
               precision: str = "highest", query_batch_size: int = 256):
    config_checks.whole_number("query_batch_size", query_batch_size, 1)
    mesh = mesh if mesh is not None else Mesh(np.array(jax.devices()), ("data",))
    if "data" not in mesh.axis_names:
      raise ValueError(f"The mesh needs an axis named 'data' to shard the index over; it has "
                       f"{mesh.axis_names}.")
    self.count, self.dim = embeddings.shape
    self.query_batch_size = query_batch_size
    shards = mesh.shape["data"]
    padded = -(-self.count // shards) * shards
    sharding = NamedSharding(mesh, P("data"))

    def shard(index):  # each device's rows on their own: no padded host copy of the whole index
      start, stop, _ = index[0].indices(padded)
      out = np.zeros((stop - start, self.dim), dtype)
      real = embeddings[start:min(stop, self.count)]
      out[:len(real)] = real
      return out

    self.emb = jax.make_array_from_callback((padded, self.dim), sharding, shard)  # [N_pad, D]
    replicated = NamedSharding(mesh, P())
    self._search_fn = jax.jit(
        functools.partial(_sharded_top_k, count=self.count, mesh=mesh,
                          recall_target=self.recall_target,
                          precision=jax.lax.Precision(precision)),
        static_argnums=3, in_shardings=(sharding, replicated, replicated),
        out_shardings=replicated)

  def embeddings(self) -> np.ndarray:
    """The stored [N, D] rows on the host, in the storage dtype."""
    if not self.emb.is_fully_addressable:
      raise ValueError("This index is sharded over several hosts; each holds only its own rows. "
                       "Save it from the embeddings it was built from (save(..., embeddings=)).")
    return np.asarray(jax.device_get(self.emb))[:self.count]

  def search(self, queries: np.ndarray, k: int, exclude_rows: np.ndarray):
    """Scores [Q, k] float32 (descending) and rows [Q, k] int32 of `queries` [Q, D] float32, never
    one of `exclude_rows` [Q, E] int32 (-1: nothing); `query_batch_size` queries per call."""
    num_queries = len(queries)
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
      parts.append(self._search_fn(self.emb, q, ex, k))
    # Device calls run asynchronously until their results are read here.
    scores = np.concatenate([np.asarray(s) for s, _ in parts])[:num_queries]
    rows = np.concatenate([np.asarray(r) for _, r in parts])[:num_queries]
    return scores, rows


class ApproxSearcher(ExactSearcher):
  """`ExactSearcher` with `jax.lax.approx_max_k` per shard: exact on CPU, faster on TPU.

  Args:
    recall_target: `approx_max_k`'s recall target, in (0, 1]. The others: `ExactSearcher`'s.
  """

  def __init__(self, embeddings: np.ndarray, dtype: np.dtype, mesh: Mesh | None = None, *,
               recall_target: float = 0.95, **options):
    if not 0 < recall_target <= 1:
      raise ValueError(f"recall_target={recall_target!r}: give a recall in (0, 1].")
    self.recall_target = recall_target
    super().__init__(embeddings, dtype, mesh, **options)
