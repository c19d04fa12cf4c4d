"""Embedding many texts fast: length buckets, batch sharded over every device, progress in docs/s,
and resumable on-disk shards for whole corpora.

Blocks are sorted by length and cut into batches whose padded length is the smallest bucket that
fits, so short blocks do not pay for padding; each (batch, bucket) shape compiles once. The
buckets are chosen for the lengths at hand (`optimal_buckets`): every extra shape costs a
compilation, every coarser one costs padding.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from realm_jax.io_utils import as_path, atomic_write, is_remote, local_file, read_json, write_json
from realm_jax.retrieval.index_store import arrays_crc32
from realm_jax.retrieval.rows import (ArrayRows, ConcatRows, HostRows, read_all,
                                      read_safetensors_header, safetensors_rows)

Batch = dict[str, np.ndarray]


def bucket_lengths(max_length: int, step: int = 16) -> list[int]:
  """Padded lengths used for batches: multiples of `step` up to `max_length` (always included)."""
  return sorted(set(list(range(step, max_length, step)) + [max_length]))


def optimal_buckets(lengths: np.ndarray, max_length: int, step: int = 8,
                    shape_cost: float = 4096.0, attention_cost: float = 1.2e-3) -> list[int]:
  """The padded lengths (multiples of `step`, and `max_length`) that make embedding `lengths`
  cheapest, by dynamic programming over the sorted candidate lengths.

  The cost of a bucket of length l holding n rows is n * l * (1 + attention_cost * l) (the
  per-token cost of a BERT grows with l through attention) plus `shape_cost` for its
  compilation and its last, partly empty batch, both in token units. The defaults are measured
  on 2 CPU cores with MiniLM (a compilation ~0.47 s = ~4k tokens of embedding; 1k tokens take
  ~118 ms at l = 64 and ~145 ms at l = 256); on an accelerator, where compiling costs far more
  tokens, a larger `shape_cost` gives fewer buckets.
  """
  lengths = np.asarray(lengths)
  if len(lengths) and lengths.max() > max_length:
    raise ValueError(f"A row of length {lengths.max()} exceeds max_length={max_length}.")
  cands = bucket_lengths(max_length, step)
  # counts[j]: rows whose smallest candidate bucket is cands[j]
  counts = np.bincount(np.searchsorted(cands, lengths), minlength=len(cands))
  per_row = [l * (1.0 + attention_cost * l) for l in cands]
  best = [0.0] + [np.inf] * len(cands)   # best[j]: cost of the rows of cands[:j], a bucket at j-1
  back = [0] * (len(cands) + 1)
  for j in range(1, len(cands) + 1):
    if not counts[j - 1] and j < len(cands):
      continue  # a bucket no row needs (the next smaller one holds the same rows for less)
    rows = 0
    for i in range(j - 1, -1, -1):       # the bucket cands[j-1] takes the rows of cands[i:j]
      rows += counts[i]
      cost = best[i] + rows * per_row[j - 1] + (shape_cost if rows else 0.0)
      if cost < best[j]:
        best[j], back[j] = cost, i
  chosen, j = [], len(cands)
  while j > 0:
    chosen.append(cands[j - 1])
    j = back[j]
  return sorted(chosen)


def bucket_batches(lengths: np.ndarray, buckets: list[int], batch_size: int,
                   tokens_per_batch: int | None, multiple: int = 1) -> list[tuple[np.ndarray, int, int]]:
  """Plans the steps: [(rows, padded length, batch rows)], rows grouped by their smallest bucket.

  Each bucket gets one batch shape: `tokens_per_batch // length` rows (at most `batch_size`, at
  least `multiple`, rounded to a multiple of `multiple`), so short blocks go in wide batches and
  long ones in narrow batches.
  """
  bucket_of = np.searchsorted(np.asarray(buckets), lengths)  # smallest bucket >= length
  if bucket_of.max(initial=0) >= len(buckets):
    raise ValueError(f"A row of length {lengths.max()} exceeds the largest bucket {buckets[-1]}.")
  plan = []
  for b, length in enumerate(buckets):
    rows = np.nonzero(bucket_of == b)[0]
    if not len(rows):
      continue
    rows_per_batch = batch_size if tokens_per_batch is None else min(
        batch_size, max(1, tokens_per_batch // length))
    rows_per_batch = -(-rows_per_batch // multiple) * multiple
    for lo in range(0, len(rows), rows_per_batch):
      plan.append((rows[lo:lo + rows_per_batch], length, rows_per_batch))
  return plan


def embed_in_buckets(embed_fn: Callable[[Batch], jax.Array], inputs: Batch, batch_size: int,
                     buckets: list[int] | None = None, mesh: Mesh | None = None,
                     desc: str = "embedding", progress: tqdm | None = None,
                     tokens_per_batch: int | None = 1024) -> np.ndarray:
  """Embeds N padded rows of `inputs` ([N, L] int arrays) and returns [N, D] float32 in input order.

  Args:
    embed_fn: jitted function of a batch dict ([B, l] arrays) -> [B, D].
    inputs: `input_ids`, `attention_mask`, `token_type_ids`, each [N, L] (padding at the end).
    batch_size: most rows per step; rounded up to a multiple of the device count.
    buckets: padded lengths to choose from (default: `optimal_buckets` for these rows' lengths).
    mesh: devices to shard the batch over (default: all local devices on one "data" axis).
    progress: a tqdm bar to advance (default: a new one for these rows).
    tokens_per_batch: rows x length per step per device (None: always `batch_size` rows). On CPU
      ~1k tokens keeps every activation below glibc's mmap threshold, so no step page-faults its
      buffers in afresh (see realm_jax/host_memory.py): on 2 cores MiniLM embedded articles at
      59 docs/s with 1024, 46 with 4096, 31 with fixed batches of 64 rows.
  """
  n, max_len = inputs["input_ids"].shape
  if n == 0:
    raise ValueError("Nothing to embed: the corpus is empty.")
  mesh = mesh or Mesh(np.array(jax.local_devices()), ("data",))
  n_dev = mesh.devices.size
  sharding = NamedSharding(mesh, P("data"))
  lengths = inputs["attention_mask"].sum(-1)
  buckets = buckets or optimal_buckets(lengths, max_len)
  plan = bucket_batches(lengths, buckets, batch_size,
                        None if tokens_per_batch is None else tokens_per_batch * n_dev, n_dev)
  out = None
  start_time, done = time.perf_counter(), 0
  bar = progress if progress is not None else tqdm(total=n, desc=desc, unit="doc", smoothing=0.1)

  def collect(rows, result):
    nonlocal out, done
    emb = np.asarray(result)[:len(rows)]
    if out is None:
      out = np.zeros((n, emb.shape[-1]), np.float32)
    out[rows] = emb
    done += len(rows)
    bar.update(len(rows))
    bar.set_postfix(docs_per_s=f"{done / (time.perf_counter() - start_time):.1f}")

  with bar if progress is None else contextlib.nullcontext():
    pending = None
    for rows, pad_to, rows_per_batch in plan:
      batch = {k: np.zeros((rows_per_batch, pad_to), v.dtype) for k, v in inputs.items()}
      for k, v in inputs.items():
        batch[k][:len(rows)] = v[rows, :pad_to]
      # Dispatched, not waited for: the host lays out the next batch while this one runs.
      result = embed_fn(jax.device_put(batch, sharding))
      if pending is not None:
        collect(*pending)
      pending = (rows, result)
    collect(*pending)
  elapsed = time.perf_counter() - start_time
  if progress is None:
    logging.info("%s: %d docs in %.1f s (%.1f docs/s)", desc, n, elapsed, n / elapsed)
  return out


def _other_settings(out_dir: str, old: dict, new: dict) -> str:
  """The error for an embedding directory made with `old` settings, asked for `new` ones."""
  diff = sorted(k for k in new.keys() | old.keys() if old.get(k) != new.get(k))
  said = ", ".join(f"{k}={old.get(k)!r} (now {new.get(k)!r})" for k in diff)
  # The directory's name comes from the other settings: only the shard size can differ in it.
  reuse = (f"To reuse them pass --config.shard_size={old['shard_size']}; to re-embed instead, "
           if diff == ["shard_size"] else "To re-embed, ")
  return f"{out_dir} holds embeddings made with other settings: {said}. {reuse}delete {out_dir}."


def embed_corpus(corpus, embed_fn: Callable[[Batch], jax.Array], tokenizer, out_dir: str,
                 max_length: int = 288, truncate: str = "b", shard_size: int = 4096,
                 batch_size: int = 64, mesh: Mesh | None = None,
                 fingerprint: str = "", in_slices: bool = False) -> np.ndarray | HostRows:
  """Embeds every block of `corpus` into resumable shards under `out_dir`; returns [N, D]: an
  array, or with `in_slices` `HostRows` that read the shard files a slice at a time (what
  `DocIndex` fills a device index from without a host copy of it).

  Shard s holds rows [s * shard_size, (s + 1) * shard_size) as `shard-SSSSS-of-TTTTT.safetensors`,
  each written under a temporary name and renamed when complete (in a gs:// `out_dir`: uploaded as
  one object, which appears only when whole): a killed run resumes at the first missing shard and
  ends with the same result as an uninterrupted one. `fingerprint` (corpus + model + settings) is
  recorded in `out_dir/embedding.json`; a directory made for another fingerprint is refused rather
  than mixed. Each shard holds the CRC-32 of its rows in its header, checked when it is read back:
  a damaged shard is an error that names it. `shard_size` and `batch_size` are
  `--config.shard_size` / `--config.batch_size` of experiments/build_index.py, and are named so in
  errors.
  """
  from safetensors.numpy import save_file

  for flag, value in (("shard_size", shard_size), ("batch_size", batch_size)):
    if value < 1:
      raise ValueError(f"--config.{flag}={value!r}: must be a positive number of rows.")
  n = len(corpus)
  if n == 0:
    raise ValueError(f"Nothing to embed: the corpus at {corpus.data_dir} is empty.")
  num_shards = -(-n // shard_size)
  meta = {"fingerprint": fingerprint, "count": n, "shard_size": shard_size,
          "max_length": max_length, "truncate": truncate}
  meta_path = os.path.join(out_dir, "embedding.json")
  if as_path(meta_path).exists():
    old = read_json(meta_path)
    if old != meta:
      raise ValueError(_other_settings(out_dir, old, meta))
  else:
    write_json(meta_path, meta)
  shard_name = lambda s: f"shard-{s:05d}-of-{num_shards:05d}.safetensors"
  shard_path = lambda s: os.path.join(out_dir, shard_name(s))
  # One listing, not one request per shard (thousands for a big corpus in gs://). The directory
  # exists: embedding.json is in it. Temporary files (".tmp-shard-...") do not match a shard name;
  # those a killed run left (a shard it was writing) are deleted: that shard is embedded again.
  present = {p.name for p in as_path(out_dir).iterdir()}
  for name in present:
    if name.startswith(".tmp-shard-"):
      (as_path(out_dir) / name).unlink(missing_ok=True)
  todo = [s for s in range(num_shards) if shard_name(s) not in present]
  done_rows = n - sum(min(n, (s + 1) * shard_size) - s * shard_size for s in todo)
  if done_rows:
    logging.info("Resuming: %d of %d shards already embedded in %s", num_shards - len(todo),
                 num_shards, out_dir)
  start = time.perf_counter()
  shard_inputs = lambda s: corpus.model_inputs(
      np.arange(s * shard_size, min(n, (s + 1) * shard_size)), max_length, tokenizer, truncate)
  # One set of buckets for every shard, from the first shard's lengths: each shape compiles once,
  # and a resumed run pads every shard exactly as an uninterrupted one does.
  first, buckets = None, None
  if todo:
    first = shard_inputs(0)
    buckets = optimal_buckets(first["attention_mask"].sum(-1), max_length)
  with tqdm(total=n, initial=done_rows, desc="embedding corpus", unit="block", smoothing=0.1) as bar:
    for s in todo:
      inputs = first if s == 0 else shard_inputs(s)
      emb = embed_in_buckets(embed_fn, inputs, batch_size, buckets, mesh=mesh, progress=bar)
      # The checksum goes in the shard's own header, not in a file beside it: a shard stays one
      # file written in one piece, so a killed run never leaves one without its checksum.
      atomic_write(shard_path(s), lambda p, e=emb: save_file(
          {"embeddings": e}, p, metadata={"arrays_crc32": arrays_crc32(e)}))
  if todo:
    new_rows = n - done_rows
    elapsed = time.perf_counter() - start
    logging.info("Embedded %d blocks in %.1f s (%.1f blocks/s)", new_rows, elapsed,
                 new_rows / elapsed)

  unchecked = []

  def shard_rows(s: int) -> HostRows:
    """Shard s's rows, read from its file a slice at a time (a gs:// shard: in memory), its
    CRC-32 checked."""
    redo = ("Delete it and build the index again (experiments/build_index.py): only that shard "
            "is embedded again.")
    path = shard_path(s)
    try:
      if is_remote(path):
        with local_file(path) as local:  # safe_open reads local files: gs:// is downloaded
          header = read_safetensors_header(local)
          rows = ArrayRows(read_all(safetensors_rows(local, "embeddings", header)))
      else:
        header = read_safetensors_header(path)
        rows = safetensors_rows(path, "embeddings", header)
    except (ValueError, OSError, KeyError, TypeError) as e:
      raise ValueError(f"{path} cannot be read ({e}): the file is truncated or corrupt. "
                       f"{redo}") from e
    want = (header[0].get("__metadata__") or {}).get("arrays_crc32")
    if want is None:  # written by an older realm_jax
      unchecked.append(s)
      return rows
    got = arrays_crc32(rows)
    if got != want:
      raise ValueError(f"{path} is corrupt: its CRC-32 is {got}, but it was saved with "
                       f"{want} (the file was damaged after it was written). {redo}")
    return rows

  rows = ConcatRows([shard_rows(s) for s in range(num_shards)])
  if unchecked:
    logging.info("%d of the %d shards in %s have no checksum (written by an older realm_jax): "
                 "they are not verified.", len(unchecked), num_shards, out_dir)
  return rows if in_slices else read_all(rows)
