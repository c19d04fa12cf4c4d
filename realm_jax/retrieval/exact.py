"""Top-k inner-product search on device over a sharded mesh ("exact", "approx"), and in numpy.

`ExactSearcher` shards the [N, D] rows along N over the "data" axis of a mesh; each device takes the
top-k of its shard (`jax.lax.top_k` under `jax.shard_map`), then the per-shard candidates are merged
with another top-k. One jitted function, compiled once per (query batch, k, exclusions) shape. A
shard whose [query batch, rows] scores would exceed `max_score_bytes` is scored in equal blocks of
rows, one after another, keeping each block's top-k: a 13.35M-row index needs a few hundred MB of
scores at a time, not 13 GB. Each device's rows are filled from the host a slice at a time
(realm_jax/retrieval/rows.py), so building from files holds the index once. bfloat16 rows are
held on the device as their uint16 bits (`BITS`) and converted a block at a time.
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
from realm_jax.retrieval.rows import HostRows, as_rows

MAX_SCORE_BYTES = 256 << 20  # float32 scores a device holds at once, by default: blocks above it
QUERY_BATCH_SIZE = 256  # queries per device call, by default
RECALL_TARGET = 0.95  # approx_max_k's, by default

def finite_scores(scores):
  """NaN and infinite scores as the lowest finite float32, below every real score but above the
  -inf that marks padding and excluded rows (jnp or np arrays)."""
  xp = jnp if isinstance(scores, jax.Array) else np
  lowest = np.finfo(np.float32).min
  return xp.nan_to_num(scores, nan=lowest, posinf=lowest, neginf=lowest)


def brute_force_top_k(queries: np.ndarray, embeddings: np.ndarray, k: int,
                      exclude_rows: np.ndarray | None = None, batch_size: int = 256,
                      block_rows: int = 1 << 18):
  """Exact top-k in numpy: float32 matmul + argpartition, `batch_size` queries against
  `block_rows` rows at a time (each block's best k kept, then merged), so the scores in memory
  stay at [batch_size, block_rows] float32 (256 MiB) whatever N is.

  Args:
    queries: [Q, D] float32.
    embeddings: [N, D] (any float dtype; products are taken in float32, a block at a time).
    k: results per query, at most N minus the rows excluded for any query.
    exclude_rows: optional [Q, E] row indices never to return (-1: nothing).

  Returns:
    scores [Q, k] float32 in descending order and their rows [Q, k] int64.
  """
  n = len(embeddings)
  out_scores = np.empty((len(queries), k), np.float32)
  out_rows = np.empty((len(queries), k), np.int64)
  for lo in range(0, len(queries), batch_size):
    q = queries[lo:lo + batch_size].astype(np.float32)
    excluded = None if exclude_rows is None else exclude_rows[lo:lo + batch_size]
    kept_scores, kept_rows = [], []
    for start in range(0, n, block_rows):
      block = embeddings[start:start + block_rows].astype(np.float32, copy=False)
      with np.errstate(invalid="ignore", over="ignore"):  # non-finite queries: see finite_scores
        scores = finite_scores(q @ block.T)  # [B, R]
      if excluded is not None:
        local = excluded - start
        i, e = np.nonzero((excluded >= 0) & (local >= 0) & (local < len(block)))
        scores[i, local[i, e]] = -np.inf
      keep = min(k, len(block))
      top = np.argpartition(scores, len(block) - keep, axis=1)[:, len(block) - keep:]  # unordered
      kept_scores.append(np.take_along_axis(scores, top, axis=1))
      kept_rows.append(top + start)
    scores, rows = np.concatenate(kept_scores, axis=1), np.concatenate(kept_rows, axis=1)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    out_scores[lo:lo + batch_size] = np.take_along_axis(scores, order, axis=1)
    out_rows[lo:lo + batch_size] = np.take_along_axis(rows, order, axis=1)
  return out_scores, out_rows


def _sharded_top_k(emb, queries, exclude_rows, k, *, count, mesh, recall_target, precision,
                   block_rows):
  """Top-k rows of `queries @ emb.T` over "data"-sharded rows, leaving out padding and exclusions.

  Args:
    emb: [N_pad, D] embeddings (float32, or bfloat16 as uint16 bits), sharded along N over mesh
      axis "data"; rows >= `count` are padding.
    queries: [Q, D] float32, replicated.
    exclude_rows: [Q, E] int32 global row indices never to return (-1: nothing), replicated.
    k: results per query (static); at most the number of rows each query may return.
    count: number of real rows (static).
    recall_target: None for exact `top_k` per shard, else `approx_max_k`'s recall target.
    block_rows: rows scored at a time on a device (static); divides the shard's rows.

  Returns:
    scores [Q, k] float32 in descending order and their global rows [Q, k] int32.
  """
  shard_rows = emb.shape[0] // mesh.shape["data"]
  num_blocks = shard_rows // block_rows

  def block_top_k(block, queries, exclude_rows, start):
    """Top min(k, block rows) of one block of rows whose first global row is `start`."""
    rows = block.shape[0]
    if block.dtype == jnp.uint16:  # bfloat16 rows held as their bits (see `BITS`)
      block = jax.lax.bitcast_convert_type(block, jnp.bfloat16)
    scores = finite_scores(jnp.einsum("qd,nd->qn", queries, block, precision=precision,
                                      preferred_element_type=jnp.float32))  # [Q, R]
    scores = jnp.where(start + jnp.arange(rows) < count, scores, -jnp.inf)
    local = exclude_rows - start  # [Q, E]
    # Rows of other blocks (and -1) point one past the end, where mode="drop" ignores them.
    local = jnp.where((exclude_rows >= 0) & (local >= 0) & (local < rows), local, rows)
    scores = scores.at[jnp.arange(scores.shape[0])[:, None], local].set(-jnp.inf, mode="drop")
    if recall_target is None:
      top_scores, top_rows = jax.lax.top_k(scores, min(k, rows))
    else:
      top_scores, top_rows = jax.lax.approx_max_k(scores, min(k, rows),
                                                  recall_target=recall_target)
    return top_scores, top_rows + start

  def local_top_k(emb, queries, exclude_rows):
    start = jax.lax.axis_index("data") * shard_rows
    if num_blocks == 1:
      return block_top_k(emb, queries, exclude_rows, start)  # [Q, min(k, S)] each
    blocks = emb.reshape(num_blocks, block_rows, emb.shape[1])

    def one(_, b):
      return None, block_top_k(blocks[b], queries, exclude_rows, start + b * block_rows)

    # One block's [Q, block_rows] scores live at a time; each block's top-k is kept.
    _, (scores, rows) = jax.lax.scan(one, None, jnp.arange(num_blocks))  # [nb, Q, kb] each
    scores = jnp.moveaxis(scores, 0, 1).reshape(scores.shape[1], -1)  # [Q, nb * kb]
    rows = jnp.moveaxis(rows, 0, 1).reshape(rows.shape[1], -1)
    top_scores, pos = jax.lax.top_k(scores, min(k, scores.shape[1]))
    return top_scores, jnp.take_along_axis(rows, pos, axis=1)

  # Per-shard candidates side by side: [Q, shards * local_k] each.
  scores, rows = jax.shard_map(
      local_top_k, mesh=mesh, in_specs=(P("data"), P(), P()),
      out_specs=(P(None, "data"), P(None, "data")))(emb, queries, exclude_rows)
  top_scores, pos = jax.lax.top_k(scores, k)
  return top_scores, jnp.take_along_axis(rows, pos, axis=1)


def sharded_search(count: int, mesh: Mesh, block_rows: int, *, recall_target: float | None = None,
                   precision: str = "highest"):
  """The jitted `search(emb, queries, exclude_rows, k) -> (scores, rows)` over `count` rows
  sharded along "data" (`_sharded_top_k`; `k` static): ExactSearcher's, and what
  realm_jax/compile/steps.py lowers from shapes alone."""
  sharding, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  return jax.jit(
      functools.partial(_sharded_top_k, count=count, mesh=mesh, recall_target=recall_target,
                        precision=jax.lax.Precision(precision), block_rows=block_rows),
      static_argnums=3, in_shardings=(sharding, replicated, replicated),
      out_shardings=replicated)


def query_batch(num_queries: int, query_batch_size: int) -> int:
  """Queries per device call of a search of `num_queries`: fewer than a batch are padded to a
  power of two up to 32, then to a multiple of 32 (a few compiled shapes, not one for each query
  count, and at most 31 padded queries above 32)."""
  bucket = (1 << (num_queries - 1).bit_length() if num_queries <= 32
            else -(-num_queries // 32) * 32)
  return min(bucket, query_batch_size)


def shard_layout(count: int, shards: int, max_block_rows: int) -> tuple[int, int]:
  """(rows per shard, rows per block) for `count` rows over `shards` devices: equal shards of
  equal blocks of at most `max_block_rows` rows (multiples of 8 when blocked), padded as little
  as that allows."""
  shard_rows = -(-count // shards)
  if shard_rows <= max_block_rows:
    return shard_rows, shard_rows
  num_blocks = -(-shard_rows // max_block_rows)
  block_rows = -(-shard_rows // num_blocks)
  block_rows += -block_rows % 8
  return num_blocks * block_rows, block_rows


# Storage dtypes held on the device as another dtype of the same bits. XLA:CPU has no bfloat16
# matmul: given bfloat16 rows it converted the whole shard to float32 before the loop over blocks
# (6.7 GB more for a 13.35M x 128 index); rows that are uint16 to XLA are converted a block at a
# time, inside the loop.
BITS = {np.dtype(jnp.bfloat16): np.dtype(np.uint16)}


@functools.partial(jax.jit, donate_argnums=0)
def _put_rows(buffer, rows, at):
  """`buffer` [S, D] with `rows` [R, D] written from row `at` (donated: in place)."""
  return jax.lax.dynamic_update_slice(buffer, rows, (at, 0))


def device_rows(rows: HostRows, dtype: np.dtype, sharding: NamedSharding,
                padded: int) -> jax.Array:
  """The [padded, D] array of `rows` as `dtype` (zeros below them; a dtype in `BITS` as those
  bits) with `sharding`, each addressable device's rows copied from the host a slice at a time
  (`HostRows.chunks`): the host never holds more than one slice of it beside what `rows` already
  holds. Devices that hold the same rows (a mesh with other axes) get a device-to-device copy."""
  count, dim = rows.shape
  held = BITS.get(np.dtype(dtype), np.dtype(dtype))
  host = lambda part: np.asarray(part, dtype).view(held)  # [R, D] as the device holds it
  shape = (padded, dim)
  filled, arrays = {}, []
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    start, stop, _ = index[0].indices(padded)
    if (start, stop) in filled:
      arrays.append(jax.device_put(filled[start, stop], device))
      continue
    real = max(0, min(stop, count) - start)
    if real == stop - start and real <= rows.chunk_rows():  # one slice: put it as it is
      buffer = jax.device_put(host(rows.read(start, stop)), device)
    else:
      buffer = jnp.zeros((stop - start, dim), held, device=device)
      for lo, part in rows.chunks(start, start + real):
        buffer = _put_rows(buffer, jax.device_put(host(part), device), np.int32(lo - start))
        buffer.block_until_ready()  # else slices queue up on the device, each a copy in memory
    filled[start, stop] = buffer
    arrays.append(buffer)
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


class ExactSearcher:
  """Exact top-k over rows sharded along N on the devices of a mesh (a `Searcher`).

  Args:
    embeddings: [N, D] float rows, an array or `HostRows` (rows.py: e.g. a file read in slices);
      each device receives its own rows, as `dtype`, a slice at a time (no host copy of the
      index is made).
    dtype: storage dtype (float32 or bfloat16). Scores are always computed in float32.
    mesh: devices to shard the rows over, on an axis named "data" (default: all devices).
    precision: matmul precision; "highest" keeps float32 queries exact on TPU/GPU (the default
      precision there rounds them to bfloat16/TF32: faster, ~1e-3 relative).
    query_batch_size: queries per device call. Larger query sets are cut into batches of this
      size.
    max_score_bytes: the most [query_batch_size, rows] float32 scores a device holds at once; a
      larger shard is scored in blocks of rows (the default, 256 MiB, is 262,144 rows for 256
      queries).
  """

  on_device = True
  needs_finite_rows = False
  config_keys = ()
  recall_target = None  # exact top_k per shard; ApproxSearcher sets approx_max_k's target

  def __init__(self, embeddings: np.ndarray | HostRows, dtype: np.dtype, mesh: Mesh | None = None,
               *, precision: str = "highest", query_batch_size: int = QUERY_BATCH_SIZE,
               max_score_bytes: int = MAX_SCORE_BYTES):
    config_checks.whole_number("query_batch_size", query_batch_size, 1)
    config_checks.whole_number("max_score_bytes", max_score_bytes, 1)
    mesh = mesh if mesh is not None else Mesh(np.array(jax.devices()), ("data",))
    if "data" not in mesh.axis_names:
      raise ValueError(f"The mesh needs an axis named 'data' to shard the index over; it has "
                       f"{mesh.axis_names}.")
    rows = as_rows(embeddings)
    self.count, self.dim = rows.shape
    self.query_batch_size = query_batch_size
    shards = mesh.shape["data"]
    shard_rows, self.block_rows = shard_layout(
        self.count, shards, max(8, max_score_bytes // (4 * query_batch_size)))
    sharding = NamedSharding(mesh, P("data"))
    self.dtype = np.dtype(dtype)
    self.emb = device_rows(rows, self.dtype, sharding, shards * shard_rows)  # [N_pad, D]
    self._search_fn = sharded_search(self.count, mesh, self.block_rows,
                                     recall_target=self.recall_target, precision=precision)

  def embeddings(self) -> np.ndarray:
    """The stored [N, D] rows on the host, in the storage dtype."""
    return self.rows(0, self.count)

  def rows(self, lo: int, hi: int) -> np.ndarray:
    """Rows [lo, hi) on the host, in the storage dtype, copied from the devices that hold them
    (a slice of each: `save` writes a large index this way, a slice at a time)."""
    if not self.emb.is_fully_addressable:
      raise ValueError("This index is sharded over several hosts; each holds only its own rows. "
                       "Save it from the embeddings it was built from (save(..., embeddings=)).")
    parts, seen = [], set()
    for shard in sorted(self.emb.addressable_shards, key=lambda s: s.index[0].start or 0):
      start, stop, _ = shard.index[0].indices(self.emb.shape[0])
      if start in seen or stop <= lo or start >= hi:
        continue
      seen.add(start)
      a, b = max(lo, start) - start, min(hi, stop) - start
      if shard.device.platform == "cpu":  # host memory already: a view, no copy
        parts.append(np.asarray(shard.data)[a:b].view(self.dtype))
      else:  # only the slice crosses to the host
        parts.append(np.asarray(jax.device_get(shard.data[a:b])).view(self.dtype))
    if not parts:
      return np.zeros((0, self.dim), self.dtype)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)

  def search(self, queries: np.ndarray, k: int, exclude_rows: np.ndarray):
    """Scores [Q, k] float32 (descending) and rows [Q, k] int32 of `queries` [Q, D] float32, never
    one of `exclude_rows` [Q, E] int32 (-1: nothing); `query_batch_size` queries per call."""
    num_queries = len(queries)
    batch = query_batch(num_queries, self.query_batch_size)
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

  def __init__(self, embeddings: np.ndarray | HostRows, dtype: np.dtype,
               mesh: Mesh | None = None, *, recall_target: float = RECALL_TARGET, **options):
    if not 0 < recall_target <= 1:
      raise ValueError(f"recall_target={recall_target!r}: give a recall in (0, 1].")
    self.recall_target = recall_target
    super().__init__(embeddings, dtype, mesh, **options)
