"""Saved indexes on disk: their files (one directory each), publishing, LATEST, pruning.

A saved index is a directory holding `index.safetensors` (the [N, D] embeddings and their [N] int64
block ids) and `manifest.json` (format version, training step, fingerprints of the retriever
weights and of the corpus, dtype, shape, a save id and the CRC-32 of the arrays). It is written
locally into a temporary directory renamed into place, on gs:// with the manifest uploaded last
(realm_jax/io_utils.py), and counts as saved only once its manifest exists. Reading checks the
CRC-32: a file damaged after it was saved (even with its size unchanged) is refused, not searched.
Both directions go a slice of rows at a time (realm_jax/retrieval/rows.py): saving a 13.35M x 128
index does not gather a second copy of it on the host, and loading reads the file straight into
the searcher's memory.

An asynchronously refreshed index is published as `root/index-<step>` with `root/LATEST` naming
the current one (`publish_index`, `latest_index_dir`); old ones are pruned (`prune_indexes`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import re
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from realm_jax.io_utils import as_path, atomic_write_dir, local_file, read_json, write_json
from realm_jax.retrieval.rows import (HostRows, as_rows, crc32_of_chunks, read_all,
                                      read_safetensors_header, safetensors_rows, write_safetensors)

if TYPE_CHECKING:
  from realm_jax.retrieval.index import DocIndex

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ARRAYS = "index.safetensors"
LATEST = "LATEST"
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(jnp.bfloat16)}  # storage dtypes
_INDEX_DIR = re.compile(r"index-(\d+)")


def arrays_crc32(*arrays: np.ndarray | HostRows) -> str:
  """CRC-32 of the arrays' bytes in C order, one after another, as 8 hex digits: a check for
  files damaged on disk or in transfer (not for tampering). `HostRows` are read a slice at a
  time."""
  # CRC-32 rather than SHA-256 or BLAKE2b: the check must not slow the load of a many-GB index
  # below disk speed. Over 200 MB on one core of a Xeon with SHA instructions, zlib.crc32 ran at
  # 1.6-2.3 GB/s, hashlib's sha256 at 0.9-1.6 and blake2b at 0.7-1.0 (sha256 is slower still
  # without SHA instructions).
  return f"{crc32_of_chunks(part for a in arrays for part in _pieces(a)):08x}"


def _pieces(array: np.ndarray | HostRows):
  return (part for _, part in array.chunks()) if isinstance(array, HostRows) else [array]


def write_index(directory: str | os.PathLike, fields: dict, embeddings: np.ndarray | HostRows,
                block_ids: np.ndarray) -> None:
  """Writes `index.safetensors` and `manifest.json` into `directory`, atomically (replacing it).

  Args:
    directory: local or gs://; it appears complete or not at all (on gs:// the manifest is
      uploaded after the arrays: an index without one is not complete).
    fields: the manifest's step, fingerprints, dtype, count and dim (see `read_manifest`); the
      format version, a new save id and the arrays' CRC-32 are added here.
    embeddings: [N, D] in the storage dtype, an array or `HostRows` (written a slice at a time).
    block_ids: [N] int64.
  """
  rows = as_rows(embeddings)
  block_ids = np.ascontiguousarray(block_ids, np.int64)
  # A new id for each save, in the manifest and in the arrays' header: `read_arrays` can tell a
  # manifest from the arrays of another save of the same directory (a reader racing a writer),
  # and an upload to gs:// is never skipped as unchanged.
  save_id = uuid.uuid4().hex
  crc = [0]

  def counted(chunks):  # the CRC-32 of what is written, as it is written
    for part in chunks:
      crc[0] = crc32_of_chunks([part], crc[0])
      yield part

  def write(tmp):
    write_safetensors(os.path.join(tmp, ARRAYS), {
        "embeddings": (rows.shape, rows.dtype, lambda: counted(p for _, p in rows.chunks())),
        "block_ids": (block_ids.shape, block_ids.dtype, lambda: counted([block_ids]))},
        metadata={"save_id": save_id})
    write_json(os.path.join(tmp, MANIFEST), {"format_version": FORMAT_VERSION, **fields,
                                             "save_id": save_id,
                                             "arrays_crc32": f"{crc[0]:08x}"})

  atomic_write_dir(directory, write, marker=MANIFEST)


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


def read_arrays(directory: str, manifest: dict) -> tuple[np.ndarray, np.ndarray]:
  """The embeddings [N, D] and block ids [N] of `directory` in memory, as its (validated)
  `manifest` promises them (see `open_arrays`)."""
  with open_arrays(directory, manifest) as (rows, ids):
    return read_all(rows), ids


def updated_rows(block_ids: np.ndarray, directory: str, manifest: dict,
                 embed_rows: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, str]:
  """The rows [N, D] float32 of `block_ids` (a new version of the corpus) from the index in
  `directory` (of an older one): a block it holds keeps its row, the others (new and edited
  blocks) come from `embed_rows(positions in block_ids)`; and what was done ("embedded 15 new
  blocks, reused 90 (10 removed)"). Blocks are matched by id: a block's id hashes its title and
  text, so an unchanged block keeps it and an edited one gets a new one."""
  old_emb, old_ids = read_arrays(directory, manifest)
  block_ids = np.asarray(block_ids, np.int64)
  old_rows = np.full(len(block_ids), -1, np.int64)
  if len(old_ids):
    order = np.argsort(old_ids, kind="stable")
    pos = np.minimum(np.searchsorted(old_ids[order], block_ids), len(order) - 1)
    old_rows = np.where(old_ids[order][pos] == block_ids, order[pos], -1)
  kept = old_rows >= 0
  new = np.flatnonzero(~kept)
  emb = np.empty((len(block_ids), old_emb.shape[1]), np.float32)
  emb[kept] = old_emb[old_rows[kept]]
  if len(new):
    emb[new] = embed_rows(new)
  reused = int(kept.sum())
  return emb, (f"embedded {len(new):,} new blocks, reused {reused:,} "
               f"({len(old_ids) - reused:,} removed)")


def rebuild_advice(directory: str) -> str:
  """What a damaged index's error tells the user to do, unless the one that owns the index (a
  RETRO database, a kNN-LM datastore) passes its own `remedy`: REALM's block indexes are built
  by experiments/build_index.py (and pre-training's refreshes)."""
  return f"Delete {directory} and rebuild the index (e.g. experiments/build_index.py)."


@contextlib.contextmanager
def open_arrays(directory: str, manifest: dict,
                remedy: str | None = None) -> Iterator[tuple[HostRows, np.ndarray]]:
  """(embeddings [N, D] as `HostRows` read from the file a slice at a time, block ids [N]) of
  `directory`, checked against its (validated) `manifest`: same shape and dtype, same save, same
  CRC-32 (indexes saved before manifests had a CRC-32 are not checked); a clear error otherwise,
  ending with `remedy` (what to do; default `rebuild_advice`). The rows can be read while the
  context is open (a gs:// file is a local copy until then)."""
  remedy = remedy or rebuild_advice(directory)
  with local_file(os.path.join(directory, ARRAYS)) as path:  # a gs:// file is downloaded
    try:
      header = read_safetensors_header(path)
      rows = safetensors_rows(path, "embeddings", header) if "embeddings" in header[0] else None
      id_rows = (safetensors_rows(path, "block_ids", _as_column(header, "block_ids"))
                 if "block_ids" in header[0] else None)
    except (ValueError, OSError, KeyError, TypeError) as e:
      raise ValueError(f"{directory}/{ARRAYS} cannot be read ({e}): the file is truncated or "
                       f"corrupt. {remedy}") from e
    if (rows is None or id_rows is None or rows.shape != (manifest["count"], manifest["dim"])
        or len(id_rows) != manifest["count"] or rows.dtype != DTYPES[manifest["dtype"]]
        or id_rows.dtype != np.int64):
      raise ValueError(f"{directory}/{ARRAYS} does not hold the [{manifest['count']}, "
                       f"{manifest['dim']}] {manifest['dtype']} embeddings and block ids its "
                       f"manifest promises. {remedy}")
    save_id = (header[0].get("__metadata__") or {}).get("save_id")
    if save_id != manifest.get("save_id"):  # both None for indexes saved before save_id existed
      raise ValueError(f"{directory} was saved again while it was being read (its manifest and "
                       "arrays come from different saves); load it again.")
    ids = read_all(id_rows).reshape(-1)
    _check_crc(directory, manifest, rows, ids, remedy)
    yield rows, ids


def _as_column(header: tuple[dict, int], name: str) -> tuple[dict, int]:
  """`header` with the 1-D tensor `name` seen as [N, 1] (so that it is read as rows)."""
  tensors, start = header
  info = dict(tensors[name])
  if len(info["shape"]) != 1:
    raise ValueError(f"tensor {name!r} has shape {info['shape']}, not [N]")
  info["shape"] = [info["shape"][0], 1]
  return {**tensors, name: info}, start


def _check_crc(directory: str, manifest: dict, rows: HostRows, ids: np.ndarray,
               remedy: str) -> None:
  """ValueError unless the arrays read have the CRC-32 of the manifest (none before it existed).
  The rows are read a slice at a time."""
  want = manifest.get("arrays_crc32")
  if want is None:  # saved before realm_jax wrote checksums
    logging.info("%s has no checksum in its manifest (saved by an older realm_jax): its arrays "
                 "are not verified. Rebuild it to have them verified.", directory)
    return
  got = arrays_crc32(rows, ids)
  if got != want:
    raise ValueError(
        f"{directory}/{ARRAYS} is corrupt: its arrays' CRC-32 is {got}, but its manifest says "
        f"{want} (the file was damaged after it was saved). {remedy}")


def index_path(root: str | os.PathLike, step: int) -> str:
  """Where `publish_index` puts the index of training step `step`."""
  return os.path.join(os.fspath(root), f"index-{step:08d}")


def publish_index(root: str | os.PathLike, index: DocIndex, step: int, *, model_fingerprint: str,
                  corpus_fingerprint: str, embeddings: np.ndarray | None = None,
                  extra: dict | None = None) -> str:
  """Saves `index` as `root/index-{step:08d}`, then points `root/LATEST` at it; returns its path.

  The index directory is complete (manifest written last) before LATEST names it, and LATEST is
  replaced in one piece, so a reader that follows LATEST never sees a partial index. `embeddings`,
  `extra`: see `DocIndex.save`.
  """
  path = index_path(root, step)
  index.save(path, step=step, model_fingerprint=model_fingerprint,
             corpus_fingerprint=corpus_fingerprint, embeddings=embeddings, extra=extra)
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
