"""What a pre-training work directory holds and must keep, shared by the trainer
(realm_jax/train/pretrain.py) and the index refresher (realm_jax/train/refresher.py): the fixed
settings, the corpus and the salient-span examples built from it.
"""

from __future__ import annotations

import os

from realm_jax import distributed
from realm_jax.data.corpus import Corpus, CorpusConfig
from realm_jax.data.pretrain import build_examples
from realm_jax.retrieval.index_store import latest_index_dir, read_manifest
from realm_jax.text import BertTokenizer

# Settings that change the shapes of parameters, of the optimiser state (a separate retriever
# rate adds a partition) or of the data, and the ablations' settings: a workdir keeps its own.
FIXED_SETTINGS = ("init", "model", "num_layers", "retriever_num_layers", "share_embedders",
                  "retriever_learning_rate", "corpus", "query_length", "max_masked", "tagger",
                  "heldout_percent", "masking", "null_document")


def open_data(config, workdir: str, vocab_file: str):
  """(corpus, tokenizer, examples dir), building what is missing (on the first host; the others
  wait for it, then open what it built, downloading their local copy when it is in gs://)."""
  return distributed.first_host_first(
      "realm_jax:open_data", lambda: _open_data(config, workdir, vocab_file))


def check_workdir_corpus(workdir: str, fingerprint: str) -> None:
  """Refuses a work directory whose indexes were built from other blocks, before the corpus and
  examples are built (hours at Wikipedia scale): its checkpoints and data are of those blocks."""
  latest = latest_index_dir(os.path.join(workdir, "index"))
  corpus = latest and read_manifest(latest)["corpus_fingerprint"]
  if corpus and corpus != fingerprint:
    raise ValueError(
        f"{workdir} holds a run over other blocks (corpus {corpus}, now {fingerprint}: the "
        "corpus files changed, or a newer realm_jax cuts blocks differently). Resume it with the "
        "corpus and realm_jax it was made with, or start anew with another --workdir.")


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
  settings = f"{config.query_length}-{config.max_masked}-{config.tagger}-{config.heldout_percent}"
  examples_dir = os.path.join(data_dir, f"examples-{corpus.fingerprint[:12]}-{settings}")
  build_examples(corpus, tokenizer, examples_dir, query_length=config.query_length,
                 max_masked=config.max_masked, tagger=config.tagger,
                 heldout_percent=config.heldout_percent)
  return corpus, tokenizer, examples_dir
