"""A corpus of REALM blocks as a TFDS dataset (array_record files; TensorFlow not needed).

    corpus = Corpus.build(data_dir, CorpusConfig(source="wiki_vital", vocab_file=...))
    corpus[17]                 # a block by row: block_id, title, body, token ids, sentence starts
    corpus.get(block_id)       # a block by its stable id
    corpus.model_inputs(rows, 288, tokenizer)  # [CLS] title [SEP] body [SEP] arrays for the embedder

Rows keep the generation order (documents in source order, blocks in document order), so a
row number is stable for a given corpus; the block ids are stored beside the dataset for lookups.

A gs:// `data_dir` works through a local copy: array_record (TFDS's file format here) writes local
files only, and every training step reads blocks at random. The corpus is built (or downloaded)
in `io_utils.local_dir(data_dir)` and uploaded to `data_dir`, so that other hosts and later runs
download it instead of building it again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Sequence

import numpy as np
import tensorflow_datasets as tfds
import tensorflow_datasets.core  # noqa: F401  (tfds.core is not imported by the package itself)

from realm_jax import io_utils
from realm_jax.data.blocks import BLOCKING_VERSION, BLOCKINGS, MIN_BODY_PIECES, pack_blocks
from realm_jax.data.prepare import LocalDatasetInfo, prepare
from realm_jax.data.sources import SOURCES, documents, jsonl_files
from realm_jax.text import BertTokenizer, batch_join, checkpoint_normalization

BLOCK_IDS = "block_ids.safetensors"
# Written by TFDS once a build is complete: the last file uploaded, and the first one looked for.
_MARKER = "dataset_info.json"


@dataclasses.dataclass(frozen=True)
class CorpusConfig:
  """What a corpus is made of. Its `fingerprint` names the built dataset."""
  source: str = "wiki_vital"
  paths: tuple[str, ...] = ()
  vocab_file: str = ""
  block_length: int = 288
  blocking: str = "sentences"
  max_docs: int | None = None
  tfds_name: str = "wikipedia/20230601.en"

  @classmethod
  def from_config(cls, corpus, vocab_file: str) -> "CorpusConfig":
    """From a config's `corpus` section (source, paths, block_length, blocking, max_docs: 0 =
    all, tfds_name) and the vocab of the model that embeds it."""
    return cls(source=corpus.source, paths=tuple(corpus.paths), vocab_file=vocab_file,
               block_length=corpus.block_length, blocking=corpus.blocking,
               max_docs=corpus.max_docs or None, tfds_name=corpus.tfds_name)

  def __post_init__(self):
    if self.source not in SOURCES:
      raise ValueError(f"corpus source={self.source!r}: use one of {SOURCES}.")
    if self.blocking not in BLOCKINGS:
      raise ValueError(f"corpus blocking={self.blocking!r}: use one of {BLOCKINGS}.")
    if self.blocking == "sentences" and self.block_length < MIN_BODY_PIECES + 4:
      raise ValueError(
          f"--config.corpus.block_length={self.block_length} leaves fewer than {MIN_BODY_PIECES} "
          f"word pieces for text after [CLS] title [SEP] ... [SEP]: use at least "
          f"{MIN_BODY_PIECES + 4} (REALM: 288).")
    if not self.vocab_file:
      raise ValueError("The corpus needs vocab_file: the vocab.txt of the model that embeds it.")
    if self.paths and self.source != "jsonl":
      raise ValueError(
          f"The corpus paths ({', '.join(self.paths)}) are read only with "
          f"--config.corpus.source=jsonl, but the source is {self.source!r}: set "
          f"--config.corpus.source=jsonl to index these files, or drop --config.corpus.paths to "
          f"index {self.source}.")

  @property
  def fingerprint(self) -> str:
    """12 hex digits of everything that makes the blocks: settings, tokenizer, source files."""
    h = hashlib.sha256()
    h.update(repr((BLOCKING_VERSION, self.source, self.block_length, self.blocking, self.max_docs,
                   self.tfds_name)).encode())
    h.update(io_utils.as_path(self.vocab_file).read_bytes())
    lowercase, strip_accents = checkpoint_normalization(self.vocab_file)
    if not lowercase:  # only then: uncased corpora keep their names
      h.update(b"cased")
    if strip_accents is not None and strip_accents != lowercase:  # (only when set otherwise)
      h.update(f"strip_accents={strip_accents}".encode())
    if self.source == "jsonl":  # the files' names, sizes and times: a changed file is a new corpus
      for p in jsonl_files(self.paths):
        if io_utils.is_remote(p):
          st = io_utils.as_path(p).stat()
          h.update(f"{p}|{st.length}|{st.mtime}".encode())
        else:
          st = os.stat(p)
          h.update(f"{os.path.abspath(p)}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


class RealmBlocks(tfds.core.GeneratorBasedBuilder):
  """TFDS builder of REALM blocks; one builder config per corpus fingerprint."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Sentence-packed REALM blocks with stable ids."}

  def __init__(self, *, corpus_config: CorpusConfig, **kwargs):
    self._corpus_config = corpus_config
    self._tokenizer = None
    self.fingerprint = corpus_config.fingerprint  # of the files as they were when it was made
    config = tfds.core.BuilderConfig(name=f"{corpus_config.source}_{self.fingerprint}",
                                     description=repr(corpus_config))
    super().__init__(config=config, file_format="array_record", **kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    ids = lambda: tfds.features.Tensor(shape=(None,), dtype=np.int32)
    return LocalDatasetInfo(
        builder=self,
        description="REALM blocks: [CLS] title [SEP] body [SEP] within a word-piece budget.",
        features=tfds.features.FeaturesDict({
            "block_id": np.int64, "title": tfds.features.Text(), "body": tfds.features.Text(),
            "title_token_ids": ids(), "token_ids": ids(), "sentence_starts": ids()}),
        disable_shuffling=True)  # rows in generation order

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples()}

  def _generate_examples(self):
    c = self._corpus_config
    tok = BertTokenizer(c.vocab_file)
    seen, row, duplicates, empty = set(), 0, 0, []
    for doc in documents(c.source, c.paths, c.tfds_name, c.max_docs):
      made = 0
      for block in pack_blocks(doc["title"], doc["text"], tok, c.block_length, c.blocking,
                               doc["where"]):
        made += 1
        if block["block_id"] in seen:  # the same title and body twice: keep the first
          duplicates += 1
          continue
        seen.add(block["block_id"])
        yield row, block
        row += 1
      if not made:
        empty.append(doc["where"])
    if duplicates:
      logging.warning("Skipped %d duplicate blocks (the same title and text as an earlier one).",
                      duplicates)
    if empty and row:
      logging.warning("Skipped %d documents without text, e.g. %s.", len(empty),
                      ", ".join(empty[:5]))
    if row == 0:
      raise ValueError(f"The corpus {c.source} {list(c.paths) or ''} holds no text: nothing to index.")


class Corpus:
  """Random access to the blocks of a built corpus, by row or by block id."""

  def __init__(self, source, block_ids: np.ndarray, config: CorpusConfig, data_dir: str,
               fingerprint: str):
    """`fingerprint`: the config's when the blocks were built (it reads the source files' sizes
    and times once, not at each use)."""
    self._source = source
    self.fingerprint = fingerprint
    self.block_ids = block_ids                      # [N] int64, by row
    self._order = np.argsort(block_ids, kind="stable")
    self._sorted = block_ids[self._order]
    self.config = config
    self.data_dir = data_dir

  @classmethod
  def build(cls, data_dir: str, config: CorpusConfig) -> "Corpus":
    """Builds the corpus in `data_dir` unless it is there already, then opens it (for a gs://
    `data_dir`, its local copy: see the module docstring)."""
    local = io_utils.local_dir(data_dir)
    remote = None
    if io_utils.is_remote(data_dir):
      built = RealmBlocks(corpus_config=config, data_dir=local).data_dir
      remote = os.path.join(data_dir, os.path.relpath(built, local))
      io_utils.download_dir(remote, built, marker=_MARKER)
    # Made after the download: a builder reads the dataset info that is there when it is made.
    builder = prepare(lambda: RealmBlocks(corpus_config=config, data_dir=local),
                      f"the {config.source} corpus")
    source = builder.as_data_source(split="train")
    path = os.path.join(builder.data_dir, BLOCK_IDS)
    from safetensors.numpy import load_file, save_file
    if os.path.exists(path):
      ids = load_file(path)["block_ids"]
    else:
      ids = np.fromiter((source[i]["block_id"] for i in range(len(source))), np.int64,
                        count=len(source))
      io_utils.atomic_write(path, lambda p: save_file({"block_ids": ids}, p))
    if remote is not None:
      io_utils.upload_dir(builder.data_dir, remote, marker=_MARKER)
    logging.info("Corpus %s: %d blocks in %s", builder.builder_config.name, len(ids),
                 builder.data_dir)
    return cls(source, ids, config, builder.data_dir, builder.fingerprint)

  def __len__(self) -> int:
    return len(self.block_ids)

  def __getitem__(self, row: int) -> dict:
    """The block at `row`; negative rows count from the end, as in a list."""
    n, row = len(self), int(row)
    if not -n <= row < n:  # IndexError ends `for block in corpus`
      raise IndexError(f"Row {row} is out of range: the corpus at {self.data_dir} has {n} blocks.")
    ex = self._source[row % n]
    return {**ex, "title": _text(ex["title"]), "body": _text(ex["body"])}

  def rows_of(self, block_ids) -> np.ndarray:
    """Rows of the given block ids (-1 where unknown), any shape."""
    ids = np.asarray(block_ids, np.int64)
    pos = np.clip(np.searchsorted(self._sorted, ids), 0, len(self._sorted) - 1)
    return np.where(self._sorted[pos] == ids, self._order[pos], -1)

  def get(self, block_id: int) -> dict:
    row = int(self.rows_of(block_id))
    if row < 0:
      raise KeyError(f"Block id {block_id} is not in the corpus at {self.data_dir}.")
    return self[row]

  def blocks(self, rows: Sequence[int]) -> list[dict]:
    return [self[r] for r in rows]

  def model_inputs(self, rows: Sequence[int], max_length: int, tokenizer: BertTokenizer,
                   truncate: str = "b") -> dict[str, np.ndarray]:
    """`[CLS] title [SEP] body [SEP]` as [R, L] arrays, also for a block without a title
    (`[CLS] [SEP] body [SEP]`, the body in segment 1): the layout the pre-training step gives the
    document tower (`CandidateBuilder`), so that an index and the step's scores agree. With
    truncate="b", as there, a title longer than max_length - 3 is cut too (then no body fits)."""
    pairs = []
    keep = max(0, max_length - 3) if truncate == "b" else None
    for r in rows:
      ex = self._source[int(r)]
      pairs.append((list(ex["title_token_ids"])[:keep], list(ex["token_ids"])))
    return batch_join(pairs, max_length, tokenizer, truncate)


def _text(v) -> str:
  return v.decode("utf-8") if isinstance(v, bytes) else str(v)
