"""RETRO's neighbour search: the k nearest database chunks of every query chunk, each query barred
from a contiguous range of chunks (those of its own training sequence's documents).

`search_neighbours` asks a `DocIndex` whose block ids are the chunk rows 0..N-1, in resumable
on-disk shards (as embed.py's `embed_corpus`); `brute_force_neighbours` is the numpy reference.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
from tqdm.auto import tqdm

from realm_jax.io_utils import as_path, atomic_write, read_json, write_json
from realm_jax.retrieval.index import DocIndex


def save_npy(path: str, array: np.ndarray) -> None:
  """Writes `array` to the .npy file `path` atomically, without pickles."""
  def write(tmp):
    with open(tmp, "wb") as f:  # a file object: np.save would add ".npy" to the temporary name
      np.save(f, np.asarray(array), allow_pickle=False)
  atomic_write(path, write)


def exclusion_ids(ranges: np.ndarray) -> np.ndarray:
  """[Q, E] int64 chunk ids of inclusive ranges [Q, 2] ((-1, -1): none), padded with -1.

  E is the longest range rounded up to a power of two: a search compiles once per E, so a few
  widths serve every shard."""
  ranges = np.asarray(ranges, np.int64).reshape(-1, 2)
  sizes = np.where(ranges[:, 0] >= 0, ranges[:, 1] - ranges[:, 0] + 1, 0)
  width = 1 << int(max(1, sizes.max(initial=1)) - 1).bit_length()
  ids = ranges[:, :1] + np.arange(width)
  return np.where(np.arange(width) < sizes[:, None], ids, -1)


def brute_force_neighbours(keys: np.ndarray, queries: np.ndarray, k: int, ranges: np.ndarray,
                           ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Exact neighbours in numpy: scores [Q, k] float32 (descending) and ids [Q, k] int64.

  Args:
    keys: [N, D] database keys; `ids` [N] their chunk ids (default 0..N-1).
    queries: [Q, D].
    ranges: [Q, 2] inclusive chunk-id range each query may not return ((-1, -1): none).
  """
  keys, queries = np.asarray(keys, np.float32), np.asarray(queries, np.float32)
  ids = np.arange(len(keys)) if ids is None else np.asarray(ids, np.int64)
  ranges = np.asarray(ranges, np.int64)
  scores = queries @ keys.T                                                   # [Q, N]
  barred = (ids >= ranges[:, :1]) & (ids <= ranges[:, 1:]) & (ranges[:, :1] >= 0)
  scores = np.where(barred, -np.inf, scores)
  top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
  return np.take_along_axis(scores, top, 1), ids[top]


def search_neighbours(index: DocIndex, queries: np.ndarray, ranges: np.ndarray, k: int, *,
                      out_dir: str | None = None, shard_size: int = 4096, fingerprint: str = "",
                      desc: str = "neighbours") -> np.ndarray:
  """The k best chunk ids of each query, never one in its excluded range: [Q, k] int64.

  Args:
    index: over the database keys, block ids = chunk ids.
    queries: [Q, D] float32 query keys.
    ranges: [Q, 2] inclusive chunk-id range barred to each query ((-1, -1): none).
    out_dir: where shard s, the neighbours of queries [s * shard_size, (s + 1) * shard_size), is
      kept as `shard-SSSSS-of-TTTTT.npy` (written under a temporary name, then renamed): a killed
      run resumes at the first missing shard. None: nothing is kept. A directory made for another
      `fingerprint` (or count, k, shard size) is refused.
  """
  num_queries = len(queries)
  num_shards = -(-num_queries // shard_size)
  name = lambda s: f"shard-{s:05d}-of-{num_shards:05d}.npy"
  present = set()
  if out_dir is not None:
    meta = {"fingerprint": fingerprint, "count": num_queries, "k": k, "shard_size": shard_size}
    meta_path = os.path.join(out_dir, "neighbours.json")
    if as_path(meta_path).exists():
      old = read_json(meta_path)
      if old != meta:
        raise ValueError(f"{out_dir} holds neighbours searched with other settings ({old}, now "
                         f"{meta}): delete {out_dir} to search again.")
    else:
      write_json(meta_path, meta)
    for p in as_path(out_dir).iterdir():
      if p.name.startswith(".tmp-"):  # a shard a killed run was writing: searched again
        p.unlink(missing_ok=True)
      else:
        present.add(p.name)
  shards = []
  start, searched = time.perf_counter(), 0
  done = sum(min(num_queries, (s + 1) * shard_size) - s * shard_size
             for s in range(num_shards) if name(s) in present)
  with tqdm(total=num_queries, initial=done, desc=desc, unit="query", smoothing=0.1) as bar:
    for s in range(num_shards):
      lo, hi = s * shard_size, min(num_queries, (s + 1) * shard_size)
      if name(s) in present:
        shard = np.load(os.path.join(out_dir, name(s)), allow_pickle=False)
        if shard.shape != (hi - lo, k):
          raise ValueError(f"{os.path.join(out_dir, name(s))} has shape {shard.shape}, not "
                           f"{(hi - lo, k)}: it is damaged. Delete it: only it is searched again.")
      else:
        _, shard = index.search(queries[lo:hi], k, exclude_ids=exclusion_ids(ranges[lo:hi]))
        if out_dir is not None:
          save_npy(os.path.join(out_dir, name(s)), shard)
        searched += hi - lo
        bar.update(hi - lo)
        bar.set_postfix(queries_per_s=f"{searched / (time.perf_counter() - start):.0f}")
      shards.append(shard.astype(np.int64))
  if searched:
    elapsed = time.perf_counter() - start
    logging.info("%s: %d queries searched in %.1f s (%.0f queries/s)", desc, searched, elapsed,
                 searched / elapsed)
  return np.concatenate(shards) if shards else np.zeros((0, k), np.int64)
