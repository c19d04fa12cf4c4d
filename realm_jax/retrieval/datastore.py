"""kNN-LM's datastore (Khandelwal et al. 2020): one entry per scored token of a chunk database's
train split, key = a trained decoder's context representation there (the input of its last
feed-forward block after the LayerNorm: `RetroModel(..., return_hidden=True)`), value = the next
token; searched by squared L2 distance through a `DocIndex`.

    config, params, _ = retro_export.load("work/retro_demo/baseline/export")
    build_datastore(config, params, db, "work/retro_demo/datastore-baseline")
    store = Datastore.open("work/retro_demo/datastore-baseline", searcher="scann")
    distances, values = store.search(queries, k=1024)   # [Q, k]: exact squared L2, next tokens

The decoder reads each train sequence as it was trained on it: a RETRO export with the sequence's
own neighbours (or, with `neighbours=False`, without them: its CCA layers skipped), the baseline
without. Squared L2 is searched as an inner product: a key k is
stored as [k, |k|^2] and a query q asked as [2q, -1], whose product 2 q.k - |k|^2 = |q|^2 -
|q - k|^2 ranks the keys nearest first; the distances of the neighbours found are then recomputed
from the stored keys in float32 (never from that difference of large numbers).

The build is resumable and writes, in `directory`:

  settings.json     the model's and the database's fingerprints (and where they were read), the
                    storage dtype, sequences per shard and batch size: another build with other
                    ones is refused, naming both
  shards/shard-SSSSS-of-TTTTT.safetensors   keys [n, H] float32 and values [n] int32 of train
                    sequences [s S, (s+1) S), the CRC-32 and compute seconds in the header; each
                    written under a temporary name, then renamed: a killed build resumes at the
                    first missing shard (the shards go once the datastore is complete)
  index/            the DocIndex (retrieval/index_store.py) of the augmented keys; ids = entries
  values.npy        [N] int32 the next token of each entry
  datastore.json    the manifest, written last (a directory without it is not complete): the
                    fingerprints, count, dim, dtype, bytes, build seconds, CRC-32 of values.npy
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict
from tqdm.auto import tqdm

from realm_jax import config_checks, io_utils
from realm_jax.checkpoints.decoder import is_decoder_param
from realm_jax.models.retro import RetroConfig, RetroModel
from realm_jax.retrieval.index import DocIndex
from realm_jax.retrieval.index_store import DTYPES, arrays_crc32, write_index
from realm_jax.retrieval.neighbours import save_npy

VERSION = 1
MANIFEST = "datastore.json"
SETTINGS = "settings.json"
SHARD_SEQUENCES = 256   # train sequences per resumable shard (65k entries of the demo's)
_DISTANCE_BATCH = 256   # queries whose [batch, k, H] neighbour keys are gathered at once


def model_fingerprint(config: RetroConfig, params, neighbours: bool = True) -> str:
  """16 hex digits identifying a decoder: its config and the CRC-32 of its parameters. A RETRO
  decoder read without its neighbours (`neighbours=False`: its CCA layers skipped) is its decoder
  alone: the config without CCA layers and the decoder's parameters only (so the RETROfits of one
  frozen decoder, whatever their seeds, share one fingerprint)."""
  flat = flatten_dict(params)
  what = []
  if not neighbours and config.retrieval:
    flat = {k: v for k, v in flat.items() if is_decoder_param(k)}
    config = dataclasses.replace(config, cca_layers=(), zero_init_cca=False,
                                 encoder_input_norm=False, cca_memory="encoder",
                                 encoder_layers=0, encoder_size=0, num_neighbours=0)
    what = ["without neighbours"]
  crc = arrays_crc32(*[np.asarray(flat[k], np.float32) for k in sorted(flat)])
  text = json.dumps([dataclasses.asdict(config), crc] + what, sort_keys=True, default=list)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def augment_keys(keys: np.ndarray) -> np.ndarray:
  """[N, H] keys -> [N, H + 1] float32 rows [k, |k|^2] (see the module docstring)."""
  keys = np.asarray(keys, np.float32)
  return np.concatenate([keys, np.square(keys).sum(1, keepdims=True)], axis=1)


def augment_queries(queries: np.ndarray) -> np.ndarray:
  """[Q, H] queries -> [Q, H + 1] float32 rows [2q, -1]: their inner product with an augmented
  key is |q|^2 - |q - k|^2."""
  queries = np.asarray(queries, np.float32)
  return np.concatenate([2 * queries, -np.ones((len(queries), 1), np.float32)], axis=1)


@jax.jit
def _squared_distances(keys: jax.Array, queries: jax.Array, rows: jax.Array) -> jax.Array:
  """|q - keys[row]|^2 in float32: keys [N, H], queries [Q, H], rows [Q, k] -> [Q, k]."""
  diff = queries[:, None, :] - keys[rows].astype(jnp.float32)   # [Q, k, H]
  return jnp.sum(jnp.square(diff), axis=-1)


def num_entries(db) -> int:
  """The entries a datastore of `db` holds: its train split's scored tokens (each document's
  text tokens; not the eos that begins it, nor the padding)."""
  return int(db.manifest["counts"]["train"]["tokens"])


def check_options(*, dtype: str = "float32", batch_size: int = 8,
                  shard_size: int = SHARD_SEQUENCES) -> None:
  """Cheap checks of the build's settings, naming their flags."""
  if dtype not in DTYPES:
    raise ValueError(f"--key_dtype={dtype!r}: use one of {tuple(DTYPES)}.")
  config_checks.whole_number("--batch_size", batch_size, 1, None, " (sequences per call)")
  config_checks.whole_number("shard_size", shard_size, 1, None, " (sequences per shard)")


def datastore_settings(config: RetroConfig, params, db, *, source: str = "",
                       dtype: str = "float32", batch_size: int = 8,
                       shard_size: int = SHARD_SEQUENCES, neighbours: bool = True) -> dict:
  """What a datastore is built from and how (settings.json): `source` says where the decoder
  came from (its export directory), for the messages; `neighbours`: whether a RETRO decoder
  reads its neighbours while its keys are computed (part of the model's fingerprint)."""
  return {"version": VERSION, "model_fingerprint": model_fingerprint(config, params, neighbours),
          "db_fingerprint": db.fingerprint, "model": os.path.abspath(source) if source else "",
          "db": os.path.abspath(db.directory), "dtype": dtype, "batch_size": batch_size,
          "shard_size": shard_size}


def check_directory(directory: str, settings: dict, flag: str = "--datastore_dir") -> bool:
  """Whether `directory` holds the complete datastore of `settings` (False: none, or an
  unfinished build of the same one). ValueError when it holds one of another model or database
  (naming both), one of another dtype, or an unfinished one cut into other batches or shards
  (naming them): checked before any expensive work."""
  path = os.path.join(directory, SETTINGS)
  if not os.path.exists(path):
    if os.path.exists(os.path.join(directory, MANIFEST)):
      raise ValueError(f"{flag}={directory}: {MANIFEST} without {SETTINGS}: not a datastore this "
                       f"realm_jax wrote. Delete {directory}, or give another {flag}.")
    return False
  old = io_utils.read_json(path)
  fix = f"give another {flag}, or delete {directory} to build it again"
  if (old.get("model_fingerprint"), old.get("db_fingerprint")) != (
      settings["model_fingerprint"], settings["db_fingerprint"]):
    raise ValueError(
        f"{flag}={directory} holds the kNN-LM datastore of another model or database: model "
        f"{old.get('model_fingerprint')} ({old.get('model')}) over database "
        f"{old.get('db_fingerprint')} ({old.get('db')}); asked for model "
        f"{settings['model_fingerprint']} ({settings['model']}) over database "
        f"{settings['db_fingerprint']} ({settings['db']}): {fix}.")
  complete = os.path.exists(os.path.join(directory, MANIFEST))
  # How the shards were cut matters only to a build still under way.
  keys = ("version", "dtype") + (() if complete else ("batch_size", "shard_size"))
  diff = [k for k in keys if old.get(k) != settings[k]]
  if diff:
    said = ", ".join(f"{k}={old.get(k)!r} (now {settings[k]!r})" for k in diff)
    raise ValueError(f"{flag}={directory} holds a datastore of this model built with other "
                     f"settings: {said}. Pass those (--key_dtype, --batch_size), or {fix}.")
  return complete


def _train_batch(db, lo: int, hi: int, batch_size: int, num_neighbours: int):
  """Train sequences [lo, hi) as one batch of `batch_size` (filled up with copies whose targets
  are all unscored): inputs, segments (the inputs' documents), targets [B, L], scored [B, L]
  bool, neighbours [B, n, k, 2m]."""
  seqs = [db.read_sequence("train", s) for s in range(lo, hi)]
  seqs += [seqs[-1]] * (batch_size - len(seqs))
  scored = np.stack([s["target_docs"] >= 0 for s in seqs])
  scored[hi - lo:] = False
  return (np.stack([s["inputs"] for s in seqs]), np.stack([s["input_docs"] for s in seqs]),
          np.stack([s["targets"] for s in seqs]), scored,
          np.stack([s["neighbours"][:, :num_neighbours] for s in seqs]))


def _shard_name(s: int, num_shards: int) -> str:
  return f"shard-{s:05d}-of-{num_shards:05d}.safetensors"


def _read_shard(path: str) -> tuple[np.ndarray, np.ndarray, float]:
  from safetensors import SafetensorError, safe_open
  try:
    with safe_open(path, framework="numpy") as f:
      keys, values, meta = f.get_tensor("keys"), f.get_tensor("values"), f.metadata() or {}
  except (SafetensorError, OSError) as e:
    raise ValueError(f"{path} cannot be read ({e}): delete it, and only it is computed "
                     "again.") from e
  if arrays_crc32(keys, values) != meta.get("arrays_crc32"):
    raise ValueError(f"{path} is corrupt (its CRC-32 does not match): delete it, and only it is "
                     "computed again.")
  return keys, values, float(meta.get("seconds", 0.0))


def build_datastore(config: RetroConfig, params, db, directory: str, *, source: str = "",
                    dtype: str = "float32", batch_size: int = 8,
                    shard_size: int = SHARD_SEQUENCES, neighbours: bool = True,
                    flag: str = "--datastore_dir") -> dict:
  """Builds the datastore of a decoder over `db`'s train split in `directory`, or finishes an
  interrupted build, or finds a complete one; returns its manifest (with "reused": whether it
  was complete before this call).

  Args:
    config, params: a RETRO or baseline decoder (retro_export.load) trained on `db` (the caller
      checks that: `db.check_compatible`).
    db: a `RetroDb`.
    source: where the decoder came from (its export directory), recorded for the messages.
    dtype: storage dtype of the index's keys, "float32" or "bfloat16" (distances are recomputed
      from the stored keys in float32; bfloat16 halves the memory and ranks less exactly).
    batch_size: train sequences per decoder call.
    shard_size: train sequences per resumable shard.
    neighbours: False: a RETRO decoder's keys are computed without its neighbours (its CCA layers
      skipped; for a RETROfit with a frozen decoder, the keys of the pre-trained decoder).

  Raises:
    ValueError naming `flag` when `directory` holds the datastore of another model or database
    (both named), or one built with other settings.
  """
  from safetensors.numpy import save_file
  check_options(dtype=dtype, batch_size=batch_size, shard_size=shard_size)
  if io_utils.is_remote(directory):
    raise ValueError(f"{flag}={directory}: the datastore is built on a local disk; give a local "
                     "directory.")
  settings = datastore_settings(config, params, db, source=source, dtype=dtype,
                                batch_size=batch_size, shard_size=shard_size,
                                neighbours=neighbours)
  if check_directory(directory, settings, flag):
    manifest = io_utils.read_json(os.path.join(directory, MANIFEST))
    logging.info("kNN-LM datastore in %s: complete, reusing it (%d entries).", directory,
                 manifest["count"])
    return {**manifest, "reused": True}
  os.makedirs(directory, exist_ok=True)
  io_utils.write_json(os.path.join(directory, SETTINGS), settings)
  for p in glob.glob(os.path.join(directory, ".tmp-*")) + glob.glob(
      os.path.join(directory, "shards", ".tmp-*")):  # what a killed write left
    shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)

  shard_dir = os.path.join(directory, "shards")
  os.makedirs(shard_dir, exist_ok=True)
  num_seqs = db.num_sequences("train")
  num_shards = -(-num_seqs // shard_size)
  present = set(os.listdir(shard_dir))
  todo = [s for s in range(num_shards) if _shard_name(s, num_shards) not in present]
  done = sum(min(num_seqs, (s + 1) * shard_size) - s * shard_size for s in range(num_shards)
             if s not in todo)
  if done:
    logging.info("kNN-LM datastore in %s: resuming, %d of %d shards done.", directory,
                 num_shards - len(todo), num_shards)
  module = RetroModel(config)
  hidden_fn = jax.jit(lambda p, t, n, g: module.apply({"params": p}, t, n, return_hidden=True,
                                                     segments=g)[1])
  params = jax.device_put(params)
  k_read = config.num_neighbours or 1
  with tqdm(total=num_seqs, initial=done, desc="kNN-LM datastore", unit="sequence") as bar:
    for s in todo:
      start = time.perf_counter()
      lo, hi = s * shard_size, min(num_seqs, (s + 1) * shard_size)
      keys, values = [], []
      for b in range(lo, hi, batch_size):
        inputs, segments, targets, scored, read = _train_batch(
            db, b, min(hi, b + batch_size), batch_size, k_read)
        hidden = np.asarray(hidden_fn(params, inputs, read if config.retrieval and neighbours
                                      else None, segments))
        keys.append(hidden[scored].astype(np.float32))   # [n, H], sequence-major
        values.append(targets[scored].astype(np.int32))
        bar.update(min(batch_size, hi - b))
      keys, values = np.concatenate(keys), np.concatenate(values)
      seconds = time.perf_counter() - start
      meta = {"arrays_crc32": arrays_crc32(keys, values), "seconds": f"{seconds:.3f}"}
      io_utils.atomic_write(os.path.join(shard_dir, _shard_name(s, num_shards)),
                            lambda p, k=keys, v=values, m=meta: save_file(
                                {"keys": k, "values": v}, p, metadata=m))
  return _finish(directory, shard_dir, num_shards, settings, db, config)


def _finish(directory, shard_dir, num_shards, settings, db, config) -> dict:
  """The shards joined into the index and values.npy, then the manifest; the shards removed."""
  start = time.perf_counter()
  parts = [_read_shard(os.path.join(shard_dir, _shard_name(s, num_shards)))
           for s in range(num_shards)]
  keys = np.concatenate([k for k, _, _ in parts])
  values = np.concatenate([v for _, v, _ in parts])
  if len(keys) != num_entries(db):
    raise ValueError(f"The datastore in {directory} has {len(keys)} entries, but the train split "
                     f"of {db.directory} scores {num_entries(db)} tokens: delete {directory} and "
                     "build it again.")
  dtype = DTYPES[settings["dtype"]]
  write_index(os.path.join(directory, "index"),
              {"step": 0, "model_fingerprint": settings["model_fingerprint"],
               "corpus_fingerprint": settings["db_fingerprint"], "dtype": dtype.name,
               "count": len(keys), "dim": keys.shape[1] + 1},
              augment_keys(keys).astype(dtype), np.arange(len(keys), dtype=np.int64))
  save_npy(os.path.join(directory, "values.npy"), values)
  files = [os.path.join(directory, "values.npy")] + glob.glob(
      os.path.join(directory, "index", "*"))
  manifest = {
      "version": VERSION, "model_fingerprint": settings["model_fingerprint"],
      "db_fingerprint": settings["db_fingerprint"], "model": settings["model"],
      "db": settings["db"], "count": len(keys), "dim": int(keys.shape[1]),
      "dtype": settings["dtype"], "vocab_size": config.vocab_size,
      "bytes": sum(os.path.getsize(f) for f in files),
      "seconds": round(sum(t for _, _, t in parts) + time.perf_counter() - start, 2),
      "values_crc32": arrays_crc32(values)}
  io_utils.write_json(os.path.join(directory, MANIFEST), manifest)
  shutil.rmtree(shard_dir)
  logging.info("kNN-LM datastore in %s: %d entries of dimension %d, %.1f MB, built in %.1f s.",
               directory, manifest["count"], manifest["dim"], manifest["bytes"] / 1e6,
               manifest["seconds"])
  return {**manifest, "reused": False}


class Datastore:
  """A complete datastore, opened for search: `index` (a DocIndex over the augmented keys),
  `values` [N] int32, `manifest`."""

  def __init__(self, index: DocIndex, values: np.ndarray, manifest: dict):
    self.index, self.values, self.manifest = index, values, manifest
    self.count, self.dim = manifest["count"], manifest["dim"]
    self._keys = jax.device_put(np.asarray(index.embeddings())[:, :self.dim])   # [N, H]

  @classmethod
  def open(cls, directory: str, *, model_fingerprint: str | None = None,
           db_fingerprint: str | None = None, searcher: str = "exact",
           flag: str = "--datastore_dir", **options) -> "Datastore":
    """Opens a complete datastore (`options` go to the searcher, as `DocIndex` takes them); the
    fingerprints, when given, must be its own."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
      raise FileNotFoundError(f"{flag}={directory}: no complete kNN-LM datastore there (no "
                              f"{MANIFEST}): build it with build_datastore (an interrupted build "
                              "resumes).")
    manifest = io_utils.read_json(path)
    for key, want in (("model_fingerprint", model_fingerprint), ("db_fingerprint", db_fingerprint)):
      if want is not None and manifest[key] != want:
        raise ValueError(f"{flag}={directory} is the datastore of {key} {manifest[key]}, not "
                         f"{want}: give the datastore of this model and database.")
    index = DocIndex.load(os.path.join(directory, "index"),
                          expected_corpus_fingerprint=manifest["db_fingerprint"],
                          expected_model_fingerprint=manifest["model_fingerprint"],
                          searcher=searcher,
                          remedy=f"Delete {directory} and build the datastore again "
                                 "(experiments/knnlm_eval.py builds it).", **options)
    values = np.load(os.path.join(directory, "values.npy"), allow_pickle=False)
    if values.shape != (manifest["count"],) or arrays_crc32(values) != manifest["values_crc32"]:
      raise ValueError(f"{directory}/values.npy is damaged (not the [{manifest['count']}] values "
                       f"of its CRC-32): delete {directory} and build it again.")
    return cls(index, values, manifest)

  def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest entries of each query [Q, H]: squared L2 distances [Q, k] float32 (exact,
    from the stored keys; ascending up to the searcher's ordering) and their values [Q, k] int32."""
    queries = np.asarray(queries, np.float32)
    _, rows = self.index.search(augment_queries(queries), k)       # [Q, k] entry numbers
    distances = np.zeros(rows.shape, np.float32)
    for lo in range(0, len(queries), _DISTANCE_BATCH):
      q, r = queries[lo:lo + _DISTANCE_BATCH], rows[lo:lo + _DISTANCE_BATCH]
      pad = _DISTANCE_BATCH - len(q)   # one compiled shape (per k) for every call
      d = _squared_distances(self._keys, np.pad(q, ((0, pad), (0, 0))),
                             np.pad(r, ((0, pad), (0, 0))))
      distances[lo:lo + len(q)] = np.asarray(d)[:len(q)]
    return distances, self.values[rows]
