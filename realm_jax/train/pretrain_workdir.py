"""What a pre-training work directory holds and must keep, shared by the trainer
(realm_jax/train/pretrain.py) and the index refresher (realm_jax/train/refresher.py): the fixed
settings, the corpus and the salient-span examples built from it.

The corpus is the files as they are now: a run started again after documents were added, edited
or removed retrieves from the new blocks (the trainer brings its index up to date, embedding only
the new blocks) but keeps training on the sentences of the corpus it started with, so that its
data stream resumes where it was.
"""

from __future__ import annotations

import logging
import os

import jax

from realm_jax import distributed
from realm_jax.data.corpus import Corpus, CorpusConfig
from realm_jax.data.pretrain import MANIFEST as EXAMPLES_MANIFEST
from realm_jax.data.pretrain import build_examples
from realm_jax.io_utils import (as_path, download_dir, is_remote, local_dir, read_json,
                                write_json)
from realm_jax.retrieval.index_store import latest_index_dir, read_manifest
from realm_jax.text import BertTokenizer

# Settings that change the shapes of parameters, of the optimiser state (a separate retriever
# rate adds a partition) or of the data, and the ablations' settings: a workdir keeps its own.
FIXED_SETTINGS = ("init", "model", "num_layers", "retriever_num_layers", "share_embedders",
                  "retriever_learning_rate", "corpus", "query_length", "max_masked", "tagger",
                  "heldout_percent", "masking", "null_document")
# Which corpus the run's training sentences were built from, written when it first opens its data:
# a run keeps training on them when the corpus files change, and retrieves from the new blocks.
EXAMPLES_RECORD = "examples.json"


def open_data(config, workdir: str, vocab_file: str):
  """(corpus, tokenizer, examples dir), building what is missing (on the first host; the others
  wait for it, then open what it built, downloading their local copy when it is in gs://)."""
  return distributed.first_host_first(
      "realm_jax:open_data", lambda: _open_data(config, workdir, vocab_file))


def check_num_candidates(num_candidates: int, corpus) -> None:
  """Refuses more candidates than the corpus has blocks: a query retrieves the others (never its
  own), so past len(corpus) the candidates are padding that costs memory and compute all the
  same."""
  if num_candidates > len(corpus):
    raise ValueError(
        f"--config.num_candidates={num_candidates} is more than the {len(corpus)} blocks of the "
        f"corpus in {corpus.data_dir}: a query has at most {len(corpus) - 1} other blocks to "
        f"retrieve, beside the null document. Pass --config.num_candidates={len(corpus)} or "
        "fewer, or a larger corpus.")


def _open_data(config, workdir: str, vocab_file: str):
  data_dir = config.data_dir or os.path.join(workdir, "data")
  tokenizer = BertTokenizer(vocab_file)
  corpus = Corpus.build(os.path.join(data_dir, "corpus"),
                        CorpusConfig.from_config(config.corpus, vocab_file))
  check_num_candidates(config.num_candidates, corpus)  # before the examples are built
  fingerprint = examples_corpus(workdir, corpus.fingerprint)
  settings = f"{config.query_length}-{config.max_masked}-{config.tagger}-{config.heldout_percent}"
  examples_dir = os.path.join(data_dir, f"examples-{fingerprint[:12]}-{settings}")
  if fingerprint == corpus.fingerprint:
    build_examples(corpus, tokenizer, examples_dir, query_length=config.query_length,
                   max_masked=config.max_masked, tagger=config.tagger,
                   heldout_percent=config.heldout_percent)
  elif not _have_examples(examples_dir):
    raise ValueError(
        f"{workdir} trains on the sentences of the corpus it started with ({fingerprint}), and "
        f"{examples_dir} no longer holds them: resume with the --config.data_dir the run was "
        "made with, or start anew with another --workdir.")
  else:
    logging.info("The corpus files changed (corpus %s, now %s): the run trains on the sentences "
                 "of the corpus it started with and retrieves from the new one.", fingerprint,
                 corpus.fingerprint)
  if jax.process_index() == 0 and not as_path(os.path.join(workdir, EXAMPLES_RECORD)).exists():
    write_json(os.path.join(workdir, EXAMPLES_RECORD), {
        "corpus_fingerprint": fingerprint, "examples": os.path.basename(examples_dir)})
  return corpus, tokenizer, examples_dir


def _have_examples(examples_dir: str) -> bool:
  """Whether `examples_dir` holds built examples (downloading its local copy from gs://)."""
  if is_remote(examples_dir):
    if not as_path(os.path.join(examples_dir, EXAMPLES_MANIFEST)).exists():
      return False
    download_dir(examples_dir, local_dir(examples_dir), marker=EXAMPLES_MANIFEST)
  return os.path.exists(os.path.join(local_dir(examples_dir), EXAMPLES_MANIFEST))


def examples_corpus(workdir: str, current: str) -> str:
  """The fingerprint of the corpus a run's training sentences come from: the one it started
  with (`EXAMPLES_RECORD`), also once the corpus files changed; for a run from before the record,
  the corpus of its newest index; for a new run, `current`."""
  record = os.path.join(workdir, EXAMPLES_RECORD)
  if as_path(record).exists():
    return read_json(record)["corpus_fingerprint"]
  latest = latest_index_dir(os.path.join(workdir, "index"))
  return read_manifest(latest)["corpus_fingerprint"] if latest else current
