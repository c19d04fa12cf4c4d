"""The main job until pre-training lands: dense retrieval over the embedded Wikipedia corpus.

Builds (or reuses) the `wiki_vital_minilm` index: every article as the segment pair (title, text)
truncated to 256 word pieces, embedded with the real all-MiniLM-L6-v2 weights in the Flax BERT
(mean pooling, L2-normalised), searched exactly. Then answers the questions with the top-k titles.
Once built, a work directory is only read: it may be read-only.
"""

from __future__ import annotations

from collections.abc import Sequence

from realm_jax import config_checks
from realm_jax.configs import build_index as build_index_configs
from realm_jax.retrieval import build
from realm_jax.retrieval.recall import embed_questions


def check_questions(questions: Sequence[str], k: int) -> None:
  """Raises ValueError naming the flag when there is no question, an empty one, or k < 1."""
  if not questions:
    raise ValueError("No question given: pass at least one --question.")
  if k < 1:
    raise ValueError(f"--k={k}: ask for at least 1 article per question.")
  for q in questions:
    if not q.strip():
      raise ValueError("Empty question: ask something, e.g. --question='who painted the Mona Lisa'.")


def search(tower, index, corpus, questions: Sequence[str], k: int = 5):
  """Top-k [(title, score)] per question (k is cut to the size of the corpus)."""
  check_questions(questions, k)
  scores, ids = index.search(embed_questions(tower, questions), min(k, len(corpus)))
  rows = corpus.rows_of(ids)
  return [[(corpus[r]["title"], float(s)) for r, s in zip(row_r, row_s)]
          for row_r, row_s in zip(rows, scores)]


def run(workdir: str, questions: Sequence[str], k: int = 5, config=None):
  """Builds the index in `workdir` unless the one there is current (`build.build_index`), then
  prints the top-k titles. An unchanged work directory is only read."""
  check_questions(questions, k)  # before minutes of embedding
  config = config or build_index_configs.get_config("wiki_vital_minilm")
  config_checks.workdir(workdir)
  build.check_settings(config)
  towers = build.towers_of(config)
  corpus, index, _ = build.build_index(config, workdir, towers)
  results = search(towers["query"], index, corpus, questions, k)
  for question, hits in zip(questions, results):
    print(f"\nQ: {question}")
    for rank, (title, score) in enumerate(hits, 1):
      print(f"  {rank}. {score:.3f}  {title}")
  return results
