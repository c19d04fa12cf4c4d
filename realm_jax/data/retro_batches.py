"""RETRO's input pipeline: batches of sequences with their retrieved neighbours, from the
array_record files of a chunk database (realm_jax/retrieval/chunk_db.py).

    it = retro_batches(db, "train", batch_size=8, seed=0)
    batch = next(it)  # inputs, segments, targets, target_docs, loss_mask [B, L]; neighbours ...
    state = it.get_state()  # JSON-serialisable: save it with the model checkpoint
"""

from __future__ import annotations

import dataclasses
import os

import grain
import numpy as np

from realm_jax import io_utils
from realm_jax.data.chunks import SPLITS, decode_record
from realm_jax.data.pretrain import HostSlice, check_slice, default_read_options
from realm_jax.retrieval.chunk_db import read_manifest


@dataclasses.dataclass(frozen=True)
class DecodeSequence:
  """grain map: one record -> its arrays, the first `num_neighbours` neighbours, segments [L] int32
  (the record's input_docs: each input's document, -1 for padding), loss_mask [L] float32 = 1 where
  the target is a text token of a document (not an eos, not padding), and target_bytes [L]
  float32: the target's share of its document's bytes (`byte_weights`[doc] = its UTF-8 bytes / its
  text tokens: a document's scored targets add up to its bytes; bits per byte = summed nats / ln 2
  / summed target_bytes)."""
  layout: dict
  num_neighbours: int
  byte_weights: np.ndarray = dataclasses.field(compare=False)

  def __call__(self, record: bytes) -> dict[str, np.ndarray]:
    ex = decode_record(record, self.layout)
    ex["segments"] = ex.pop("input_docs")                                    # [L]
    ex["neighbours"] = ex["neighbours"][:, :self.num_neighbours]           # [n, k, 2m]
    ex["neighbour_ids"] = ex["neighbour_ids"][:, :self.num_neighbours]     # [n, k]
    scored = ex["target_docs"] >= 0
    ex["loss_mask"] = scored.astype(np.float32)                              # [L]
    ex["target_bytes"] = np.where(scored, self.byte_weights[np.maximum(ex["target_docs"], 0)],
                                  0).astype(np.float32)                      # [L]
    return ex


class PadToMultiple(grain.MapDataset):
  """The parent's elements, then copies of its last one with nothing to score (loss_mask 0,
  target_docs -1), up to a multiple of `multiple`: every element once, in whole batches."""

  def __init__(self, parent: grain.MapDataset, multiple: int):
    super().__init__(parent)
    self._count = len(parent)
    self._length = -(-self._count // multiple) * multiple

  def __len__(self) -> int:
    return self._length

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    if index < self._count:
      return self._parent[index]
    ex = dict(self._parent[self._count - 1])
    ex["loss_mask"] = np.zeros_like(ex["loss_mask"])
    ex["target_docs"] = np.full_like(ex["target_docs"], -1)
    ex["target_bytes"] = np.zeros_like(ex["target_bytes"])
    return ex


def retro_batches(db, split: str, *, batch_size: int, seed: int, shuffle: bool = True,
                  num_epochs: int | None = None, shard_index: int = 0, shard_count: int = 1,
                  num_neighbours: int | None = None, limit: int | None = None,
                  read_options=None):
  """A checkpointable iterator of this host's batches of one split.

  Args:
    db: a `RetroDb`, or the directory of a complete one.
    split: "train" or "heldout".
    batch_size: sequences per batch of this host.
    seed: the shuffle (a new order each epoch); same seed, same batches.
    shuffle: False for evaluation: sequences in order. With `num_epochs=1` as well, every sequence
      comes once, and the last global batch is filled up with copies whose loss_mask is 0 (so
      every batch has the same shape on every host); otherwise a last partial batch is dropped.
    num_epochs: None repeats forever.
    shard_index, shard_count: this host's rows [shard_index * batch_size, (shard_index + 1) *
      batch_size) of each global batch of batch_size * shard_count sequences: the global batches
      are the same on any number of hosts (data/pretrain.py: HostSlice).
    num_neighbours: neighbours per chunk to keep (default: all k stored), at most k.
    limit: only the split's first `limit` sequences (e.g. a quick evaluation during training).
    read_options: grain.ReadOptions (default: 2 threads, 8 batches prefetched).
  Returns:
    grain DatasetIterator of dicts of numpy arrays: inputs, segments (each input's document, -1
    for padding: attention stays inside a document), targets, target_docs (-1 unless scored)
    [B, L] int32; loss_mask, target_bytes [B, L] float32; neighbours [B, n, k, 2m] int32 (each
    neighbour chunk and its continuation in its document); neighbour_ids [B, n, k] int32.
    `get_state()` is JSON-serialisable and `set_state` on a fresh iterator with the same
    arguments resumes exactly.
  """
  directory = getattr(db, "directory", db)
  manifest = getattr(db, "manifest", None) or read_manifest(directory)
  if split not in SPLITS:
    raise ValueError(f"split={split!r}: use one of {SPLITS}.")
  stored = manifest["settings"]["num_neighbours"]
  num_neighbours = stored if num_neighbours is None else num_neighbours
  if not 1 <= num_neighbours <= stored:
    raise ValueError(f"--config.model.num_neighbours={num_neighbours}: the chunk database in "
                     f"{directory} stores {stored} neighbours per chunk; read 1 to {stored}, or "
                     "build a database with more (--config.db.num_neighbours).")
  check_slice(shard_index, shard_count, seed)
  ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(
      os.path.join(directory, f"{split}.array_record")))
  if limit is not None:
    ds = ds[:max(0, limit)]
  global_batch = batch_size * shard_count
  padded = not shuffle and num_epochs == 1
  most = global_batch if padded and len(ds) else len(ds)  # evaluation fills its last batch up
  if not 1 <= global_batch <= most:
    raise ValueError(
        f"A global batch of {batch_size} x {shard_count} hosts = {global_batch} sequences must be "
        f"between 1 and the {len(ds)} {split} sequences of the chunk database in {directory}: "
        "lower the batch size, or build the database from more documents (--config.db.max_docs, "
        "--config.db.heldout_percent).")
  if shuffle:
    ds = ds.shuffle(seed=seed)
  docs = io_utils.read_json(os.path.join(directory, f"{split}.documents.json"))
  weights = np.array([d["bytes"] / max(d["tokens"], 1) for d in docs] or [0.0], np.float32)
  ds = ds.repeat(num_epochs).map(DecodeSequence(manifest["layout"], num_neighbours, weights))
  if padded:
    ds = PadToMultiple(ds, global_batch)
  ds = HostSlice(ds, batch_size, shard_index, shard_count).batch(batch_size, drop_remainder=True)
  read_options = read_options or default_read_options()
  return iter(ds.to_iter_dataset(read_options))
