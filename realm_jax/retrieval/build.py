"""Builds a document index from a config: corpus blocks -> tower embeddings -> published index."""

from __future__ import annotations

import hashlib
import logging
import os

import numpy as np

from realm_jax import config_checks, workdir_lock
from realm_jax.data.blocks import BLOCKINGS
from realm_jax.data.corpus import Corpus, CorpusConfig
from realm_jax.data.sources import SOURCES
from realm_jax.data.qa import load_qa_jsonl
from realm_jax.io_utils import as_path
from realm_jax.retrieval.embed import embed_corpus
from realm_jax.models.config import COMPUTE_DTYPES
from realm_jax.retrieval.index import DocIndex, index_options
from realm_jax.retrieval.index_store import (DTYPES, index_path, index_step,
                                             latest_index_dir, publish_index, read_manifest,
                                             updated_rows)
from realm_jax.retrieval.searcher import SEARCHERS
from realm_jax.retrieval.recall import evaluate_retrieval
from realm_jax.retrieval.towers import load_towers
from realm_jax.text.tokenizer import TRUNCATIONS

_AUTO = {"auto": None, "yes": True, "no": False}


def check_settings(config, flag: str = "--config") -> None:
  """Refuses index settings no build can use, naming the flag (`flag` is the prefix of this
  config's flags: --config, or --config.retrieval inside fine-tuning's config)."""
  config_checks.at_least(config, {"batch_size": 1, "max_length": 4, "shard_size": 1,
                                  "corpus.block_length": 4, "corpus.max_docs": 0}, flag)
  config_checks.one_of(config, {
      "truncate": TRUNCATIONS, "pooling": ("auto", "mean", "projected_cls"),
      "normalize": tuple(_AUTO), "dtype": COMPUTE_DTYPES, "corpus.source": SOURCES,
      "corpus.blocking": BLOCKINGS, "index.searcher": SEARCHERS, "index.dtype": tuple(DTYPES)},
      flag)


def towers_of(config, flag: str = "--config"):
  """{"query": Tower, "document": Tower} of the configured weights (read once); `flag` is the
  config's place on the command line (fine-tuning's: --config.retrieval)."""
  if config.normalize not in _AUTO:
    raise ValueError(f"{flag}.normalize={config.normalize!r}: use auto, yes or no.")
  return load_towers(config.weights, None if config.pooling == "auto" else config.pooling,
                     _AUTO[config.normalize], config.dtype, flag=f"{flag}.weights",
                     num_layers=config.get("num_layers", 0))


def open_corpus(config, workdir: str, vocab_file: str) -> Corpus:
  return Corpus.build(os.path.join(workdir, "corpus"),
                      CorpusConfig.from_config(config.corpus, vocab_file))


def embedding_settings(config, tokenizer) -> str:
  """What besides the tower's weights decides a block's embedding: the input length, the
  truncation and the tokenizer (its vocabulary and casing). Recorded in each published index's
  manifest: an updated corpus reuses the rows of an index made with the same settings only."""
  h = hashlib.sha1(as_path(tokenizer.vocab_file).read_bytes())
  h.update(f"|{tokenizer.lowercase}|{tokenizer.strip_accents}".encode())
  return f"{config.max_length}-{config.truncate}-{h.hexdigest()[:12]}"


class _Rows:
  """The rows `rows` of a corpus, as `embed_corpus` reads a corpus (len, data_dir,
  model_inputs): only an updated corpus's new and changed blocks are embedded."""

  def __init__(self, corpus, rows: np.ndarray):
    self.corpus, self.rows, self.data_dir = corpus, rows, corpus.data_dir

  def __len__(self) -> int:
    return len(self.rows)

  def model_inputs(self, rows, max_length, tokenizer, truncate="b"):
    return self.corpus.model_inputs(self.rows[np.asarray(rows)], max_length, tokenizer, truncate)


def build_index(config, workdir: str, towers=None, min_blocks: dict[str, int] | None = None,
                corpus_root: str | None = None):
  """Corpus + weights -> a published index in `workdir/index` (atomically: the newest one stays in
  use until the new one is complete). Returns (corpus, index, document tower).

  Every stage resumes: the corpus and finished embedding shards are reused. A corpus that changed
  since the published index (documents added, edited or removed) is an update: its unchanged
  blocks keep their ids and rows, only new and changed blocks are embedded, removed ones leave,
  and the result is published as the next index version (index-<n + 1>). An unchanged corpus
  writes nothing. An index embedded by another tower or with other settings (`embedding_settings`:
  length, truncation, tokenizer; the storage dtype) is refused, naming both: its rows cannot be
  mixed with the new tower's.

  `towers`: already loaded `towers_of(config)`. `min_blocks`: {flag: count} of the caller's
  settings that need that many blocks, refused once the corpus is known, before it is embedded.
  `corpus_root`: the directory whose corpus/ holds (or gets) the corpus, when another work
  directory's built corpus serves (default: `workdir`)."""
  check_settings(config)
  options = index_options(config.index)  # checked before the corpus is built and embedded
  tower = (towers or towers_of(config))["document"]
  corpus = open_corpus(config, corpus_root or workdir, tower.tokenizer.vocab_file)
  check_corpus_size(corpus, min_blocks or {})
  settings = embedding_settings(config, tower.tokenizer)
  root = os.path.join(workdir, "index")
  previous = latest_index_dir(root)
  manifest = read_manifest(previous) if previous else {}
  # An index published before the settings were recorded was made with the workdir's settings.
  same_tower = (manifest.get("model_fingerprint"), manifest.get("embedding_settings", settings),
                manifest.get("dtype")) == (tower.fingerprint, settings, options["dtype"])
  if previous and not same_tower:
    raise ValueError(
        f"{previous} was embedded by {manifest.get('weights', 'other weights')} (model "
        f"{manifest.get('model_fingerprint')}, settings "
        f"{manifest.get('embedding_settings', 'not recorded')}, {manifest.get('dtype')}); "
        f"--config.weights={config.weights} is model {tower.fingerprint}, settings {settings}, "
        f"{options['dtype']}: an update keeps the index's tower and settings. Use another "
        f"--workdir for the new tower, or delete {root} to embed every block again.")
  if same_tower and manifest["corpus_fingerprint"] == corpus.fingerprint:
    logging.info("The index in %s is current: nothing written.", previous)
    return corpus, DocIndex.load(previous, **options), tower
  fingerprint = f"{corpus.fingerprint}-{tower.fingerprint}-{config.max_length}-{config.truncate}"
  out_dir = os.path.join(workdir, "embeddings", fingerprint)
  embed = lambda part, directory, fp, in_slices=False: embed_corpus(
      part, tower.embed, tower.tokenizer, directory, config.max_length, config.truncate,
      config.shard_size, config.batch_size, fingerprint=fp, in_slices=in_slices)
  step = 0
  if same_tower:  # an update of the published index: embed only what it lacks
    emb, done = updated_rows(corpus.block_ids, previous, manifest, lambda new: embed(
        _Rows(corpus, new), f"{out_dir}-update",
        f"{fingerprint}|new blocks since {manifest['save_id']}"))
    step = index_step(previous) + 1
    message = f"Corpus update: {done}; publishing it as version {step} of {root}."
    logging.info(message)
    print(message)
  else:  # the shard files, read into the index a slice at a time
    emb = embed(corpus, out_dir, fingerprint, in_slices=True)
  index = DocIndex(emb, corpus.block_ids, **options)
  if step == 0 and _published(root, index, tower.fingerprint, corpus.fingerprint):
    logging.info("The index in %s is current: nothing written.", root)
    return corpus, index, tower
  path = publish_index(root, index, step=step, model_fingerprint=tower.fingerprint,
                       corpus_fingerprint=corpus.fingerprint,
                       extra={"embedding_settings": settings, "weights": config.weights})
  logging.info("Index of %d blocks x %d published at %s", len(corpus), emb.shape[1], path)
  return corpus, index, tower


def check_corpus_size(corpus, min_blocks: dict[str, int]) -> None:
  """Refuses a setting (by its flag) that needs more blocks than the corpus has."""
  for flag, count in min_blocks.items():
    if count > len(corpus):
      raise ValueError(f"{flag}={count} is more than the {len(corpus)} blocks of the corpus in "
                       f"{corpus.data_dir}: pass at most {len(corpus)}, or use a larger corpus.")


def _published(root: str, index: DocIndex, model_fingerprint: str, corpus_fingerprint: str) -> bool:
  """Whether `root`'s newest index is step 0 and holds exactly `index` (same blocks, weights,
  dtype and rows: max_length and truncate show in the rows), so that a run with unchanged
  settings writes nothing and works in a read-only directory. The rows are compared by the
  CRC-32 the manifest records (an index saved without one is written again), not read back."""
  path = latest_index_dir(root)
  if path != index_path(root, 0):  # none yet, or a training run's
    return False
  manifest = read_manifest(path)
  return (manifest["corpus_fingerprint"], manifest["model_fingerprint"], manifest["dtype"],
          manifest.get("arrays_crc32")) == (
              corpus_fingerprint, model_fingerprint, index.dtype.name,
              index.arrays_crc32())


def load_built_index(config, workdir: str, towers=None):
  """(corpus, index, query tower) of an index that `build_index` published in `workdir`.
  `towers`: already loaded `towers_of(config)`."""
  towers = towers or towers_of(config)
  query_tower = towers["query"]
  corpus = open_corpus(config, workdir, query_tower.tokenizer.vocab_file)
  path = latest_index_dir(os.path.join(workdir, "index"))
  if path is None:
    raise FileNotFoundError(
        f"No index in {workdir}/index: build one with experiments/build_index.py --workdir={workdir}.")
  index = DocIndex.load(path, expected_dim=query_tower.dim,
                        expected_corpus_fingerprint=corpus.fingerprint,
                        expected_model_fingerprint=towers["document"].fingerprint,
                        **index_options(config.index))
  return corpus, index, query_tower


def build_and_evaluate(config, workdir: str) -> dict | None:
  """`build_index`, then recall@k on `config.eval.questions` when given."""
  config_checks.workdir(workdir)
  check_settings(config)
  if as_path(os.path.join(workdir, "checkpoints")).exists():
    raise ValueError(
        f"{workdir} holds a training run (checkpoints/): building an index there would replace "
        "its index-00000000 and the LATEST pointer its trainer and refresher follow. Pass another "
        "--workdir.")
  # The questions are read first: a bad path or line fails before minutes of embedding.
  questions = (load_qa_jsonl(config.eval.questions, config.eval.limit or None)
               if config.eval.questions else None)
  ks = tuple(config.eval.ks)
  if questions is not None and (not ks or not all(isinstance(k, int) and k >= 1 for k in ks)):
    raise ValueError(f"--config.eval.ks={ks}: give the k of recall@k as positive integers, "
                     "e.g. --config.eval.ks='(1, 5, 20)'.")
  towers = towers_of(config)
  with workdir_lock.hold(workdir):  # one writer per workdir (a trainer, or another build)
    corpus, index, _ = build_index(config, workdir, towers)
  if questions is None:
    return None
  if max(ks) > len(corpus):
    raise ValueError(
        f"--config.eval.ks={ks} asks for recall@{max(ks)}, but the corpus in {corpus.data_dir} "
        f"has {len(corpus)} blocks: pass ks of at most {len(corpus)} (the index is built; running "
        "again reuses it).")
  query_tower = towers["query"]
  result = evaluate_retrieval(query_tower, index, corpus, questions, ks)
  line = " ".join(f"R@{k}={v:.1f}" for k, v in result["recall"].items())
  print(f"{config.eval.questions}: {len(questions)} questions, {line}")
  return result
