"""Embedding many texts fast: length buckets, batch sharded over every device, progress in docs/s.

Blocks are sorted by length and cut into batches whose padded length is the smallest bucket that
fits, so short blocks do not pay for padding; each (batch, bucket) shape compiles once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

Batch = dict[str, np.ndarray]


def bucket_lengths(max_length: int, step: int = 32) -> list[int]:
  """Padded lengths used for batches: multiples of `step` up to `max_length` (always included)."""
  return sorted(set(list(range(step, max_length, step)) + [max_length]))


def embed_in_buckets(embed_fn: Callable[[Batch], jax.Array], inputs: Batch, batch_size: int,
                     buckets: list[int] | None = None, mesh: Mesh | None = None,
                     desc: str = "embedding") -> np.ndarray:
  """Embeds N padded rows of `inputs` ([N, L] int arrays) and returns [N, D] float32 in input order.

  Args:
    embed_fn: jitted function of a batch dict ([B, l] arrays) -> [B, D].
    inputs: `input_ids`, `attention_mask`, `token_type_ids`, each [N, L] (padding at the end).
    batch_size: rows per step; rounded up to a multiple of the device count.
    buckets: padded lengths to choose from (default: multiples of 32 up to L).
    mesh: devices to shard the batch over (default: all local devices on one "data" axis).
  """
  n, max_len = inputs["input_ids"].shape
  if n == 0:
    raise ValueError("Nothing to embed: the corpus is empty.")
  mesh = mesh or Mesh(np.array(jax.devices()), ("data",))
  n_dev = mesh.devices.size
  batch_size = -(-batch_size // n_dev) * n_dev
  buckets = buckets or bucket_lengths(max_len)
  sharding = NamedSharding(mesh, P("data"))
  lengths = inputs["attention_mask"].sum(-1)
  order = np.argsort(lengths, kind="stable")
  out = None
  start_time, done = time.perf_counter(), 0
  with tqdm(total=n, desc=desc, unit="doc", smoothing=0.1) as bar:
    for lo in range(0, n, batch_size):
      rows = order[lo:lo + batch_size]
      pad_to = next(b for b in buckets if b >= lengths[rows].max())
      batch = {k: np.zeros((batch_size, pad_to), v.dtype) for k, v in inputs.items()}
      for k, v in inputs.items():
        batch[k][:len(rows)] = v[rows, :pad_to]
      emb = np.asarray(embed_fn(jax.device_put(batch, sharding)))[:len(rows)]
      if out is None:
        out = np.zeros((n, emb.shape[-1]), np.float32)
      out[rows] = emb
      done += len(rows)
      bar.update(len(rows))
      bar.set_postfix(docs_per_s=f"{done / (time.perf_counter() - start_time):.1f}")
  elapsed = time.perf_counter() - start_time
  logging.info("%s: %d docs in %.1f s (%.1f docs/s)", desc, n, elapsed, n / elapsed)
  return out
