"""RETRO's chunk database (Borgeaud et al. 2021): chunks of a corpus, keyed by a frozen BERT, with
the neighbours of every chunk and the training and evaluation examples that carry them.

    db = build_database(config.db, "work/db")      # once; a killed build resumes where it stopped
    db = RetroDb.open("work/db")
    db.read_sequence("train", 0)  # inputs, targets, input_docs, target_docs [L], neighbours, ...

The build runs in stages, each recorded in `stage-<name>.json` once its files are written (each
atomically), with their CRC-32; a build that resumes skips a stage whose record exists and whose
files still have those CRCs (a damaged one is built again, with the stages after it). One build at
a time: it holds the lock `build.lock` of `db_dir` (realm_jax/workdir_lock.py). `retro_db.json`,
the manifest, is written last: a directory without it is incomplete.

A JSONL corpus is recorded with the database (each file's size, modification time and SHA-256):
a database whose corpus files changed since it was built is refused, naming them, rather than
used as if it held their new text (models would then be trained and evaluated on the old one).
Files in `db_dir`:

  settings.json                the settings asked for (another build with other ones is refused)
  {split}.stream.npy           [T] int32 the split's token stream (realm_jax/data/chunks.py)
  {split}.docs.npy             [T] int32 each token's document as an input (-1: padding)
  {split}.documents.json       per document: title, where, bytes (of its UTF-8 text), tokens (its
                               text tokens: the targets scored)
  {split}.keys.npy             [N, D] float32 each chunk's key: the key tower, mean pooled
  index/                       DocIndex over the keys of the non-empty train chunks (ids = rows)
  {split}.neighbours.npy       [N, k] int64 train chunk ids, best first
  {split}.array_record         one record per sequence: `layout` in the manifest
  retro_db.json                settings, fingerprint, counts (near_duplicates: train documents
                               dropped), key tower (key_name, key_fingerprint, key_dim),
                               tokenizer, layout, corpus (the JSONL files read), the seconds of
                               each stage and the CRC-32 of every file (checked on open)

Every chunk belongs to one document, and a neighbour's continuation never runs into another
(realm_jax/data/chunks.py). A train chunk never retrieves a chunk of a document its own sequence
reads or predicts; held-out chunks search the whole database, which holds train documents only:
none of the held-out titles, and none nearly copying a held-out document. The paper's leaky
Wikitext-103 condition, held-out chunks searching the held-out chunks too, is
`RetroDb.heldout_in_database_neighbours`.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import logging
import os
import shutil
import time

import numpy as np
from tqdm.auto import tqdm

from realm_jax import config_checks, io_utils, workdir_lock
from realm_jax.checkpoints.weights import resolve
from realm_jax.data.chunks import (JACCARD, SPLITS, chunk_documents, chunk_values, decode_record,
                                   excluded_chunk_ranges, record_layout, train_exclusions,
                                   write_sequences)
from realm_jax.data.sources import SOURCES, documents, jsonl_files
from realm_jax.retrieval.embed import embed_corpus, embed_in_buckets
from realm_jax.retrieval.index import DocIndex
from realm_jax.retrieval.index_store import arrays_crc32
from realm_jax.retrieval.neighbours import save_npy, search_neighbours
from realm_jax.retrieval.searcher import SEARCHERS
from realm_jax.text.lm_tokenizer import LmTokenizer, key_inputs, load_lm_tokenizer, shares_vocab

VERSION = 2   # 2: documents packed in chunk-aligned pieces, title split, near-duplicates dropped
MANIFEST = "retro_db.json"
SETTINGS = "settings.json"
# The settings that make a database; the others (dir, key_batch_size, shard_size) only say how.
_CHUNK_KEYS = ("source", "paths", "tfds_name", "max_docs", "heldout_percent", "tokenizer_file",
               "chunk_length", "seq_chunks")
CONTENT_KEYS = _CHUNK_KEYS + ("key_weights", "key_length", "searcher", "num_neighbours")
# In the settings only when not 0, so that a database made without them keeps the settings and
# fingerprint it had before they existed: key_layers (the key tower keeps only its first N
# layers) and own_document_share (read by the training neighbours alone).
_KEY_KEYS = _CHUNK_KEYS + ("key_weights", "key_length", "key_layers")
_INDEX_KEYS = CONTENT_KEYS + ("key_layers",)
_NEIGHBOUR_KEYS = _INDEX_KEYS + ("own_document_share",)
# The settings each stage's files depend on: those of a directory may still change while no
# finished stage depends on them (e.g. num_neighbours, after a k refused once the text was read).
STAGE_KEYS = {"chunks": _CHUNK_KEYS, "keys": _KEY_KEYS, "index": _INDEX_KEYS,
              "neighbours": _NEIGHBOUR_KEYS, "examples": _NEIGHBOUR_KEYS}


def check_settings(db, flag: str = "--config.db") -> None:
  """Cheap checks of `config.db` (configs/retro.py: database_config), before any work."""
  config_checks.one_of(db, {"source": SOURCES, "searcher": tuple(SEARCHERS)}, flag)
  for key, low in (("chunk_length", 1), ("seq_chunks", 1), ("num_neighbours", 1),
                   ("key_length", 3), ("key_batch_size", 1), ("shard_size", 1), ("max_docs", 0)):
    config_checks.whole_number(f"{flag}.{key}", db[key], low)
  config_checks.whole_number(f"{flag}.key_layers", key_layers(db), 0)
  config_checks.at_least(db, {"heldout_percent": 0}, flag)
  if db.heldout_percent > 100:
    raise ValueError(f"{flag}.heldout_percent={db.heldout_percent!r}: give a percentage, 0 to 100.")
  share = db.own_document_share
  if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
    raise ValueError(f"{flag}.own_document_share={share!r}: give the share of training sequences "
                     "that may read their own documents, 0 (the paper's rule) to 1.")
  if db.paths and db.source != "jsonl":
    raise ValueError(f"{flag}.paths are read only with {flag}.source=jsonl, not "
                     f"{db.source!r}: set the source to jsonl, or drop the paths.")
  if db.source == "jsonl":
    if not db.paths:
      raise ValueError(f"{flag}.source=jsonl reads {flag}.paths, which is empty: give JSONL files "
                       "or folders of them.")
    try:
      jsonl_files(db.paths)
    except FileNotFoundError as e:
      raise FileNotFoundError(f"{flag}.paths: {e}") from None


def key_layers(db) -> int:
  """`config.db.key_layers`, or a built database's (its settings): 0, all the key tower's layers,
  for one from before the setting."""
  return db.get("key_layers", 0)


def db_settings(db) -> dict:
  settings = {k: list(db[k]) if k == "paths" else db[k] for k in CONTENT_KEYS}
  if key_layers(db):
    settings["key_layers"] = key_layers(db)
  if db.own_document_share:
    settings["own_document_share"] = float(db.own_document_share)
  return settings


def file_crc32(path: str) -> str:
  """CRC-32 of a file's bytes (index_store.arrays_crc32)."""
  if os.path.getsize(path) == 0:
    return arrays_crc32(np.zeros(0, np.uint8))
  return arrays_crc32(np.memmap(path, np.uint8, mode="r"))


class _ChunkKeyTexts:
  """A split's chunks as `embed_corpus` takes a corpus: a length, a place, inputs by row."""

  def __init__(self, chunks, lm_tokenizer, same_vocab, data_dir):
    self.chunks, self.lm_tokenizer, self.same_vocab, self.data_dir = (
        chunks, lm_tokenizer, same_vocab, data_dir)

  def __len__(self) -> int:
    return len(self.chunks)

  def model_inputs(self, rows, max_length, tokenizer, truncate="b"):
    del truncate  # a key is one segment, cut at max_length
    return key_inputs(self.chunks[np.asarray(rows)], self.lm_tokenizer, tokenizer, max_length,
                      self.same_vocab)


def _rebuild_advice(db_dir: str) -> str:
  """What a damaged index of the database tells the user to do (not build_index.py's advice)."""
  return (f"Delete {db_dir} and build the database again (experiments/retro_train.py with the "
          "same --config.db).")


def _stage(db_dir: str, name: str, run) -> dict:
  """Runs a build stage unless its record exists and its files have the CRC-32 it records;
  returns the record (with its seconds). A damaged stage is run again, and the records of the
  stages after it (made from its files) are deleted, so that they are run again too."""
  path = os.path.join(db_dir, f"stage-{name}.json")
  if os.path.exists(path):
    record = io_utils.read_json(path)
    damaged = _damaged_files(db_dir, record.get("files", {}))
    if not damaged:
      logging.info("RETRO database, %s: done before, reusing it.", name)
      return record
    logging.warning("RETRO database, %s: %s; building it again, and the stages after it.", name,
                    "; ".join(damaged))
    for later in list(STAGE_KEYS)[list(STAGE_KEYS).index(name):]:
      with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(db_dir, f"stage-{later}.json"))
  start = time.perf_counter()
  record = run()
  record["seconds"], record["version"] = round(time.perf_counter() - start, 2), VERSION
  io_utils.write_json(path, record)
  logging.info("RETRO database, %s: %s in %.1f s", name, record["summary"], record["seconds"])
  return record


def _load(db_dir: str, split: str, name: str) -> np.ndarray:
  return np.load(os.path.join(db_dir, f"{split}.{name}.npy"), mmap_mode="r", allow_pickle=False)


def _crcs(db_dir: str, names) -> dict:
  return {n: file_crc32(os.path.join(db_dir, n)) for n in names}


def _damaged_files(db_dir: str, crcs: dict[str, str]) -> list[str]:
  """What is wrong with each file of `crcs` ({name: CRC-32 recorded}) that is missing or has
  changed since it was written ([] when none)."""
  damaged = []
  for name, want in crcs.items():
    path = os.path.join(db_dir, name)
    if not os.path.exists(path):
      damaged.append(f"{path} is missing")
    elif (got := file_crc32(path)) != want:
      damaged.append(f"{path} is corrupt: its CRC-32 is {got}, the build recorded {want}")
  return damaged


def corpus_files(db) -> dict[str, dict]:
  """{path: {"bytes", "mtime_ns", "sha256"}} of the JSONL files that `db` (config.db) reads; {}
  for the other sources (fixed by their name and version)."""
  if db.source != "jsonl":
    return {}
  return {path: {**_file_stat(path), "sha256": _file_sha256(path)}
          for path in jsonl_files(db.paths)}


def _file_stat(path: str) -> dict:
  if io_utils.is_remote(path):
    stat = io_utils.as_path(path).stat()
    return {"bytes": stat.length, "mtime_ns": int(stat.mtime * 1e9)}
  stat = os.stat(path)
  return {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _file_sha256(path: str) -> str:
  sha = hashlib.sha256()
  with io_utils.as_path(path).open("rb") as f:
    while block := f.read(1 << 24):
      sha.update(block)
  return sha.hexdigest()


def check_corpus(db, recorded: dict[str, dict], db_dir: str, flag: str = "--config.db") -> None:
  """Refuses (ValueError naming the files and what to do) a JSONL corpus whose files differ from
  those `recorded` when the database in `db_dir` was built. Cheap when nothing changed: a file of
  the size and modification time recorded is taken as unchanged, another is hashed."""
  if db.source != "jsonl" or not recorded:  # (databases built before corpora were recorded)
    return
  try:
    now = jsonl_files(db.paths)
  except FileNotFoundError:
    now = []
  changes = [f"{p}: removed" for p in recorded if p not in now]
  changes += [f"{p}: new" for p in now if p not in recorded]
  for path in (p for p in now if p in recorded):
    old, stat = recorded[path], _file_stat(path)
    if {k: old[k] for k in stat} != stat and _file_sha256(path) != old["sha256"]:
      changes.append(f"{path}: other text" + (
          f" ({old['bytes']:,} bytes then, {stat['bytes']:,} now)"
          if old["bytes"] != stat["bytes"] else " of the same size"))
  if changes:
    raise ValueError(
        f"{flag}.paths: the corpus changed since the chunk database in {db_dir} was built from it "
        f"({'; '.join(changes[:3])}{'; ...' if len(changes) > 3 else ''}), and the database "
        f"holds the old text. To train on the new text, delete {db_dir} (and the runs trained on "
        f"it) or give another {flag}.dir and --workdir; to go on with the database as it is, "
        "restore the corpus.")


def build_database(db_config, db_dir: str, *, flag: str = "--config.db") -> "RetroDb":
  """Builds the chunk database of `db_config` (configs/retro.py: database_config) in `db_dir`, or
  finishes an interrupted build, or opens a complete one; returns it opened.

  Raises:
    ValueError naming the `flag.<key>` settings that differ when `db_dir` was built with others,
    the corpus files changed since (check_corpus), and `flag.num_neighbours` when it exceeds the
    chunks a training chunk may retrieve.
    WorkdirInUseError when another process is building a database in `db_dir`.
  """
  check_settings(db_config, flag)
  if io_utils.is_remote(db_dir):
    raise ValueError(f"{flag}.dir={db_dir}: the chunk database is memory-mapped and needs a local "
                     "directory; build it on a local disk.")
  manifest = os.path.join(db_dir, MANIFEST)
  if os.path.exists(manifest):
    _claim(db_dir, db_settings(db_config), flag)
    check_corpus(db_config, io_utils.read_json(manifest).get("corpus", {}), db_dir, flag)
    return RetroDb.open(db_dir)
  # What the settings name is found before anything is written.
  weights = resolve(db_config.key_weights, flag=f"{flag}.key_weights")
  weights.check_layers(key_layers(db_config), f"{flag}.key_layers")
  tokenizer = load_lm_tokenizer(db_config.tokenizer_file,
                                weights.vocab() if not db_config.tokenizer_file else "",
                                f"{flag}.tokenizer_file")
  with workdir_lock.hold(db_dir, workdir_lock.DATABASE):
    if os.path.exists(manifest):  # built by another process meanwhile
      return build_database(db_config, db_dir, flag=flag)
    try:
      return _build(db_config, db_dir, weights, tokenizer, flag)
    except BaseException:
      # Refused before any stage was done (a bad corpus line): settings.json is all there is to
      # leave, and a new directory goes with the lock (workdir_lock.hold).
      if not glob.glob(os.path.join(db_dir, "stage-*.json")):
        with contextlib.suppress(FileNotFoundError):
          os.remove(os.path.join(db_dir, SETTINGS))
      raise


def _build(db, db_dir: str, weights, tokenizer: LmTokenizer, flag: str) -> "RetroDb":
  """The stages of build_database, each skipped when done before (the caller holds the lock)."""
  settings = db_settings(db)
  _claim(db_dir, settings, flag)
  chunk_record = os.path.join(db_dir, "stage-chunks.json")
  if os.path.exists(chunk_record):
    check_corpus(db, io_utils.read_json(chunk_record).get("corpus", {}), db_dir, flag)
  m, n, k = db.chunk_length, db.seq_chunks, db.num_neighbours

  def chunk_stage():
    corpus = corpus_files(db)
    splits, stats = chunk_documents(
        lambda: documents(db.source, db.paths, db.tfds_name, db.max_docs or None), tokenizer, m, n,
        db.heldout_percent, total=db.max_docs or None)
    counts = {}
    for split, s in splits.items():
      save_npy(os.path.join(db_dir, f"{split}.stream.npy"), s.stream)
      save_npy(os.path.join(db_dir, f"{split}.docs.npy"), s.docs)
      io_utils.write_json(os.path.join(db_dir, f"{split}.documents.json"), s.documents)
      counts[split] = {"documents": len(s.documents), "chunks": s.num_chunks,
                       "sequences": s.num_sequences,
                       "tokens": sum(d["tokens"] for d in s.documents),
                       "bytes": sum(d["bytes"] for d in s.documents)}
    if stats["skipped"]:
      logging.warning("Skipped %d documents without text, e.g. %s.", stats["skipped"],
                      ", ".join(stats["skipped_examples"]))
    if stats["near_duplicates"]:
      logging.warning("Dropped %d train documents nearly copying a held-out one (13-gram Jaccard "
                      ">= %.1f), e.g. %s.", stats["near_duplicates"], JACCARD,
                      stats["near_duplicate_examples"])
    names = [f"{s}.{x}" for s in SPLITS for x in ("stream.npy", "docs.npy", "documents.json")]
    return {"content_sha256": stats["content_sha256"], "corpus": corpus, "counts": counts,
            "skipped_documents": stats["skipped"], "near_duplicates": stats["near_duplicates"],
            "near_duplicate_examples": stats["near_duplicate_examples"],
            "files": _crcs(db_dir, names),
            "summary": f"{stats['documents']} documents read, {stats['near_duplicates']} train "
                       f"near-duplicates of held-out ones dropped, {counts}"}

  chunks = _stage(db_dir, "chunks", chunk_stage)
  indexed = _check_k(db_dir, db, flag)

  def key_stage():
    from realm_jax.retrieval.towers import load_tower
    layers = key_layers(db)
    tower = load_tower(db.key_weights, flag=f"{flag}.key_weights", num_layers=layers)
    same = shares_vocab(tokenizer, tower.tokenizer)
    for split in SPLITS:
      texts = _ChunkKeyTexts(_load(db_dir, split, "stream")[:chunks["counts"][split]["chunks"] * m]
                             .reshape(-1, m), tokenizer, same, db_dir)
      keys = np.zeros((0, tower.dim), np.float32)
      if len(texts):
        keys = embed_corpus(
            texts, tower.embed, tower.tokenizer,
            os.path.join(db_dir, f"keys-{split}.shards-{db.shard_size}"), db.key_length,
            shard_size=db.shard_size, batch_size=db.key_batch_size,
            fingerprint=f"{chunks['content_sha256'][:16]}-{tokenizer.name}-{tower.fingerprint}-"
                        f"{db.key_length}-{split}")
      save_npy(os.path.join(db_dir, f"{split}.keys.npy"), keys.astype(np.float32))
    for d in glob.glob(os.path.join(db_dir, "keys-*.shards-*")):
      shutil.rmtree(d)
    cut = f" (its first {layers} layer{'s' * (layers > 1)})" if layers else ""
    return {"key_fingerprint": tower.fingerprint, "key_name": weights.name, "dim": tower.dim,
            "same_vocab": same, "files": _crcs(db_dir, [f"{s}.keys.npy" for s in SPLITS]),
            "summary": f"{sum(c['chunks'] for c in chunks['counts'].values())} chunks embedded "
                       f"by {weights.name}{cut} ({'same' if same else 'decoded'} text)"}

  keys = _stage(db_dir, "keys", key_stage)
  text_settings = {k: v for k, v in settings.items() if k in _INDEX_KEYS}
  index_fingerprint = hashlib.sha256(json.dumps(
      [VERSION, text_settings, chunks["content_sha256"], tokenizer.name, keys["key_fingerprint"]],
      sort_keys=True).encode()).hexdigest()[:16]
  # The database's: its training neighbours' rule too (a model records it, train/retro.py).
  fingerprint = index_fingerprint if settings == text_settings else hashlib.sha256(
      json.dumps([index_fingerprint, settings], sort_keys=True).encode()).hexdigest()[:16]
  index_dir = os.path.join(db_dir, "index")

  def index_stage():
    train_keys = np.asarray(_load(db_dir, "train", "keys"))[indexed]
    DocIndex(train_keys, indexed, searcher=db.searcher).save(
        index_dir, step=0, model_fingerprint=keys["key_fingerprint"],
        corpus_fingerprint=index_fingerprint, embeddings=train_keys)
    return {"count": len(indexed), "summary": f"{len(indexed)} train chunks indexed"}

  index_record = _stage(db_dir, "index", index_stage)

  def neighbour_stage():
    index = DocIndex.load(index_dir, expected_corpus_fingerprint=index_fingerprint,
                          expected_model_fingerprint=keys["key_fingerprint"], searcher=db.searcher,
                          remedy=_rebuild_advice(db_dir))
    for split in SPLITS:
      queries = np.asarray(_load(db_dir, split, "keys"))
      ranges = (train_exclusions(_load(db_dir, split, "docs"), m, n, db.own_document_share)
                if split == "train"
                else np.full((len(queries), 2), -1, np.int64))
      found = search_neighbours(
          index, queries, ranges, k, out_dir=os.path.join(
              db_dir, f"neighbours-{split}.shards-{db.shard_size}"),
          shard_size=db.shard_size, fingerprint=fingerprint, desc=f"neighbours ({split})")
      save_npy(os.path.join(db_dir, f"{split}.neighbours.npy"), found)
    for d in glob.glob(os.path.join(db_dir, "neighbours-*.shards-*")):
      shutil.rmtree(d)
    return {"files": _crcs(db_dir, [f"{s}.neighbours.npy" for s in SPLITS]),
            "summary": f"{k} neighbours of every chunk"}

  neighbour_record = _stage(db_dir, "neighbours", neighbour_stage)
  layout = record_layout(m, n, k)

  def example_stage():
    train = {"train_stream": _load(db_dir, "train", "stream"),
             "train_docs": _load(db_dir, "train", "docs"),
             "num_train": chunks["counts"]["train"]["chunks"]}
    for split in SPLITS:
      io_utils.atomic_write(os.path.join(db_dir, f"{split}.array_record"), functools.partial(
          write_sequences, stream=_load(db_dir, split, "stream"), docs=_load(db_dir, split, "docs"),
          neighbours=_load(db_dir, split, "neighbours"), **train, chunk_length=m, seq_chunks=n,
          pad_id=tokenizer.pad_id))
    return {"files": _crcs(db_dir, [f"{s}.array_record" for s in SPLITS]),
            "summary": str({s: chunks["counts"][s]["sequences"] for s in SPLITS}) + " sequences"}

  examples = _stage(db_dir, "examples", example_stage)
  stages = {"chunks": chunks, "keys": keys, "index": index_record,
            "neighbours": neighbour_record, "examples": examples}
  manifest = {
      "version": VERSION, "settings": settings, "fingerprint": fingerprint,
      "index_fingerprint": index_fingerprint,
      "tokenizer": {"name": tokenizer.name, "vocab_size": tokenizer.vocab_size,
                    "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id},
      "key_name": keys["key_name"], "key_fingerprint": keys["key_fingerprint"],
      "key_dim": keys["dim"],
      "counts": {**chunks["counts"], "skipped_documents": chunks["skipped_documents"],
                 "near_duplicates": chunks["near_duplicates"],
                 "indexed_chunks": index_record["count"]},
      "near_duplicate_examples": chunks["near_duplicate_examples"],
      "corpus": chunks.get("corpus", {}),
      "layout": layout,
      "seconds": {name: r["seconds"] for name, r in stages.items()},
      "files": {f: c for r in stages.values() for f, c in r.get("files", {}).items()}}
  io_utils.write_json(os.path.join(db_dir, MANIFEST), manifest)
  return RetroDb(db_dir, manifest, tokenizer)


def _claim(db_dir: str, settings: dict, flag: str) -> None:
  """Makes `db_dir` the place of a database of `settings`, unless a finished stage of it depends
  on other settings (ValueError naming them) or was made by another version of this code;
  clears what a killed build left half written."""
  os.makedirs(db_dir, exist_ok=True)
  records = {n: os.path.join(db_dir, f"stage-{n}.json") for n in STAGE_KEYS}
  older = [n for n, p in records.items()
           if os.path.exists(p) and io_utils.read_json(p).get("version") != VERSION]
  if older:
    raise ValueError(f"{db_dir} holds a chunk database (stages {', '.join(older)}) made by another "
                     f"version of realm_jax, whose files this one (version {VERSION}) cannot use: "
                     f"delete {db_dir} and build it again, or give another {flag}.dir.")
  path = os.path.join(db_dir, SETTINGS)
  old = io_utils.read_json(path) if os.path.exists(path) else None
  if old != settings:
    done = [n for n in STAGE_KEYS if os.path.exists(os.path.join(db_dir, f"stage-{n}.json"))]
    fixed = {k for n in done for k in STAGE_KEYS[n]}
    diff = sorted(k for k in fixed if old.get(k) != settings.get(k)) if old else []
    if diff:
      said = ", ".join(f"{flag}.{k}={old.get(k)!r} (now {settings.get(k)!r})" for k in diff)
      raise ValueError(f"{db_dir} holds a chunk database built with other settings: {said}. Pass "
                       f"those settings to use it, another {flag}.dir for a new database, or "
                       f"delete {db_dir} to build it again.")
    io_utils.write_json(path, settings)
  # Temporary files of a killed write, and shards searched or embedded with other settings.
  patterns = [".tmp-*", ".old-*"] + (["*.shards-*"] if old != settings else [])
  for p in (p for pattern in patterns for p in glob.glob(os.path.join(db_dir, pattern))):
    if os.path.isdir(p):
      shutil.rmtree(p)
    else:
      os.remove(p)


def _nonempty(docs: np.ndarray, chunk_length: int, num_chunks: int) -> np.ndarray:
  """[N] bool: whether each chunk holds a document token (docs [T], `SplitStream.docs`)."""
  return (np.asarray(docs[:num_chunks * chunk_length]).reshape(-1, chunk_length) >= 0).any(1)


def _check_k(db_dir: str, db, flag: str) -> np.ndarray:
  """The ids of the non-empty train chunks (what the index holds), once k is known to fit."""
  docs, m, n = _load(db_dir, "train", "docs"), db.chunk_length, db.seq_chunks
  num_chunks = (len(docs) - 1) // m // n * n
  if num_chunks == 0:
    raise ValueError(f"The chunk database has no training text: every document of {db.source} is "
                     f"held out or empty. Lower {flag}.heldout_percent={db.heldout_percent} or "
                     f"raise {flag}.max_docs={db.max_docs}.")
  # A chunk of padding only (the rest of a sequence, a document's last chunk never) is no neighbour.
  nonempty = _nonempty(docs, m, num_chunks)
  ranges = excluded_chunk_ranges(docs, m, n)
  before = np.concatenate([[0], np.cumsum(nonempty)])  # non-empty chunks below each id
  barred = np.where(ranges[:, 0] >= 0, before[ranges[:, 1] + 1] - before[ranges[:, 0]], 0)
  returnable = int(nonempty.sum() - barred.max())
  if db.num_neighbours > returnable:
    raise ValueError(
        f"{flag}.num_neighbours={db.num_neighbours}: the database has {int(nonempty.sum())} "
        f"chunks, and a training chunk may not retrieve the up to {int(barred.max())} chunks of "
        f"its own sequence's documents, which leaves {returnable}. Ask for at most {returnable} "
        f"neighbours, or use more documents ({flag}.max_docs={db.max_docs}).")
  return np.flatnonzero(nonempty)


def read_manifest(db_dir: str) -> dict:
  """The manifest of a complete database; FileNotFoundError when it is not one."""
  path = os.path.join(db_dir, MANIFEST)
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"{db_dir} holds no complete chunk database (no {MANIFEST}): build it with "
        "realm_jax.retrieval.chunk_db.build_database (experiments/retro_train.py builds it first); "
        "an interrupted build resumes.")
  manifest = io_utils.read_json(path)
  if manifest.get("version") != VERSION:
    raise ValueError(f"{path} has version {manifest.get('version')!r}; this realm_jax reads "
                     f"version {VERSION}: delete {db_dir} and build it again.")
  return manifest


class RetroDb:
  """A complete chunk database, opened read-only (arrays memory-mapped)."""

  def __init__(self, directory: str, manifest: dict, tokenizer: LmTokenizer):
    self.directory, self.manifest, self.tokenizer = directory, manifest, tokenizer
    s = manifest["settings"]
    self.settings, self.layout, self.fingerprint = s, manifest["layout"], manifest["fingerprint"]
    self.chunk_length, self.seq_chunks = s["chunk_length"], s["seq_chunks"]
    self.num_neighbours = s["num_neighbours"]
    self.key_fingerprint = manifest["key_fingerprint"]
    # What a model trained on this database records (train/retro.py): another build, of other
    # settings or text, or of the same ones but with other files (a build that read a damaged
    # stage, or ran where floating point rounds otherwise), has another.
    self.files_fingerprint = hashlib.sha256(json.dumps(
        [self.fingerprint, manifest["files"]], sort_keys=True).encode()).hexdigest()[:16]
    self._sources, self._tower, self._documents = {}, None, {}

  @classmethod
  def open(cls, db_dir: str, *, verify: bool = True) -> "RetroDb":
    """Opens a complete database; `verify` checks the CRC-32 of every file (reads them all)."""
    manifest = read_manifest(db_dir)
    redo = f"delete {db_dir} and build the database again"
    damaged = _damaged_files(db_dir, manifest["files"]) if verify else []
    if damaged:
      raise ValueError(f"The chunk database in {db_dir} is damaged: {'; '.join(damaged)}. To "
                       f"use it, {redo} (experiments/retro_train.py builds it).")
    s = manifest["settings"]
    vocab = "" if s["tokenizer_file"] else resolve(s["key_weights"],
                                                   flag="--config.db.key_weights").vocab()
    tokenizer = load_lm_tokenizer(s["tokenizer_file"], vocab)
    if tokenizer.name != manifest["tokenizer"]["name"]:
      raise ValueError(f"--config.db.tokenizer_file={s['tokenizer_file']!r} now gives tokenizer "
                       f"{tokenizer.name}, but {db_dir} was built with "
                       f"{manifest['tokenizer']['name']}: restore that file, or {redo}.")
    return cls(db_dir, manifest, tokenizer)

  def _split(self, split: str) -> str:
    if split not in SPLITS:
      raise ValueError(f"split={split!r}: use one of {SPLITS}.")
    return split

  def num_sequences(self, split: str) -> int:
    return self.manifest["counts"][self._split(split)]["sequences"]

  def num_chunks(self, split: str) -> int:
    return self.manifest["counts"][self._split(split)]["chunks"]

  def documents(self, split: str) -> list[dict]:
    """Per document of the split: title, where, bytes, tokens (read once, then kept)."""
    if split not in self._documents:
      self._documents[split] = io_utils.read_json(
          os.path.join(self.directory, f"{self._split(split)}.documents.json"))
    return self._documents[split]

  def array(self, split: str, name: str) -> np.ndarray:
    """A split's memory-mapped array: "stream", "docs" [T], "keys" [N, D], "neighbours" [N, k]."""
    return _load(self.directory, self._split(split), name)

  @property
  def train_stream(self) -> np.ndarray:
    return self.array("train", "stream")

  def examples_path(self, split: str) -> str:
    return os.path.join(self.directory, f"{self._split(split)}.array_record")

  def read_sequence(self, split: str, s: int) -> dict[str, np.ndarray]:
    """Sequence `s` of a split: inputs, targets, input_docs, target_docs [L]; neighbours
    [n, k, 2m]; neighbour_ids [n, k] (int32; chunks.record_layout)."""
    if not 0 <= s < self.num_sequences(split):
      raise IndexError(f"Sequence {s} is out of range: {split} has {self.num_sequences(split)}.")
    if split not in self._sources:
      import grain
      self._sources[split] = grain.sources.ArrayRecordDataSource(self.examples_path(split))
    return decode_record(self._sources[split][s], self.layout)

  def values(self, chunk_ids: np.ndarray, split: str = "train") -> np.ndarray:
    """[..., 2m] int32 tokens of a split's chunks [...] (-1: all pad) and their continuations
    (the next chunk when it belongs to the same document, else pad)."""
    return chunk_values(self.array(split, "stream"), self.array(split, "docs"), chunk_ids,
                        self.chunk_length, self.num_chunks(split), self.tokenizer.pad_id)

  def indexed_chunks(self, split: str) -> np.ndarray:
    """[N'] int64 the ids of a split's chunks holding a document token (not padding only)."""
    return np.flatnonzero(_nonempty(self.array(split, "docs"), self.chunk_length,
                                    self.num_chunks(split)))

  def heldout_in_database_neighbours(self, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The paper's leaky condition (its Wikitext-103 runs, whose database holds the evaluation
    set): each held-out chunk's k nearest chunks among the train AND held-out chunks together, by
    the database's keys (the key tower's, made for both splits at the build) and exact search,
    leaving out only the query chunk itself. A chunk can so find the rest of its own document:
    figures with these neighbours measure copying from the evaluation text, and are not held-out
    figures (the records' own neighbours, train chunks only, are).

    Args:
      k: neighbours per chunk (default: the database's num_neighbours).
    Returns:
      values [Nh, k, 2m] int32 (each neighbour and its continuation, read from its own split's
      stream and document: `values`), and ids [Nh, k] int64: train chunk c as c, held-out chunk j
      as num_chunks("train") + j. Nh = num_chunks("heldout"): row s * n + v is chunk v of held-out
      sequence s, as the records' `neighbours` ([S, n, k, 2m] after a reshape).
    """
    k = self.num_neighbours if k is None else k
    num_train, num_heldout = self.num_chunks("train"), self.num_chunks("heldout")
    train, heldout = self.indexed_chunks("train"), self.indexed_chunks("heldout")
    keys = np.concatenate([np.asarray(self.array("train", "keys"))[train],
                           np.asarray(self.array("heldout", "keys"))[heldout]])
    ids = np.concatenate([train, num_train + heldout])
    if not 1 <= k < len(ids):
      raise ValueError(f"k={k}: the train and held-out chunks of {self.directory} number "
                       f"{len(ids)}, and a chunk may not find itself: ask for 1 to {len(ids) - 1}.")
    index = DocIndex(keys, ids, searcher="exact")
    _, found = index.search(np.asarray(self.array("heldout", "keys")), k,
                            exclude_ids=num_train + np.arange(num_heldout))       # [Nh, k]
    is_heldout = found >= num_train
    values = np.where(is_heldout[..., None],
                      self.values(np.where(is_heldout, found - num_train, -1), "heldout"),
                      self.values(np.where(is_heldout, -1, found), "train"))
    return values.astype(np.int32), found

  def chunk_title(self, chunk_id: int) -> str:
    """The title of the train document a train chunk belongs to ("" for padding)."""
    doc = int(self.array("train", "docs")[chunk_id * self.chunk_length])
    return self.documents("train")[doc]["title"] if doc >= 0 else ""

  def load_index(self, searcher: str | None = None, **options) -> DocIndex:
    return DocIndex.load(os.path.join(self.directory, "index"),
                         expected_corpus_fingerprint=self.manifest.get("index_fingerprint",
                                                                       self.fingerprint),
                         expected_model_fingerprint=self.key_fingerprint,
                         searcher=searcher or self.settings["searcher"],
                         remedy=_rebuild_advice(self.directory), **options)

  def key_tower(self):
    """The frozen tower that embedded the keys (loaded once), checked to be the same weights."""
    if self._tower is None:
      from realm_jax.retrieval.towers import load_tower
      weights = self.settings["key_weights"]
      tower = load_tower(weights, flag="--config.db.key_weights",
                         num_layers=key_layers(self.settings))
      if tower.fingerprint != self.key_fingerprint:
        raise ValueError(
            f"--config.db.key_weights={weights} now loads weights with fingerprint "
            f"{tower.fingerprint}, but the keys of {self.directory} were made by "
            f"{self.key_fingerprint}: restore those weights, or build the database again.")
      self._tower = (tower, shares_vocab(self.tokenizer, tower.tokenizer))
    return self._tower[0]

  def embed_keys(self, token_chunks: np.ndarray) -> np.ndarray:
    """Keys [Q, D] float32 of token chunks [Q, m] (the decoder's tokens), as the build made them."""
    tower = self.key_tower()
    token_chunks = np.asarray(token_chunks).reshape(-1, self.chunk_length)
    if len(token_chunks) == 0:
      return np.zeros((0, tower.dim), np.float32)
    inputs = key_inputs(token_chunks, self.tokenizer, tower.tokenizer, self.settings["key_length"],
                        self._tower[1])
    # One padded length: each batch size compiles once, however long the chunks' texts are.
    return embed_in_buckets(tower.embed, inputs, 256, [self.settings["key_length"]],
                            progress=tqdm(disable=True))

  def check_export(self, config, meta: dict) -> None:
    """check_compatible for a RETRO export: its model config and the meta it was saved with."""
    self.check_compatible(meta["tokenizer"], meta["key_fingerprint"],
                          config.chunk_length if config.retrieval else None,
                          meta.get("db_files_fingerprint"))

  def check_compatible(self, tokenizer_name: str | None = None,
                       key_fingerprint: str | None = None,
                       chunk_length: int | None = None,
                       files_fingerprint: str | None = None) -> None:
    """Refuses a model made with another tokenizer or key tower than this database's, one that
    reads neighbours in chunks of another length (`chunk_length`: a retrieval model's), or one
    trained on another build of it (`files_fingerprint`, as its export records; None: not
    recorded)."""
    if files_fingerprint is not None and files_fingerprint != self.files_fingerprint:
      raise ValueError(
          f"The model was trained on another build of the chunk database than the one in "
          f"{self.directory} now (its files' fingerprint was {files_fingerprint}, now "
          f"{self.files_fingerprint}: built again, or from other text): evaluate it with the "
          "database it was trained on, or train it again on this one (retro_train.py).")
    for flag, asked, own in (("--config.db.tokenizer_file", tokenizer_name, self.tokenizer.name),
                             ("--config.db.key_weights", key_fingerprint, self.key_fingerprint),
                             ("--config.db.chunk_length", chunk_length, self.chunk_length)):
      if asked is not None and asked != own:
        raise ValueError(
            f"The model was made with {flag} giving {asked}, but the chunk database in "
            f"{self.directory} with {own}: use the database built with the model's setting "
            f"({flag}), or train the model on this one.")
