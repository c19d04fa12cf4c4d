"""Retriever recall@k on open-QA questions: a hit = a normalised answer occurs in a retrieved block
(title + body, whole words; see `text.answers.has_answer`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from realm_jax.data.qa_batches import answers_of
from realm_jax.text import batch_join
from realm_jax.text.answers import has_answer, normalize_answer, regex_match


def embed_questions(tower, questions: Sequence[str], batch_size: int = 256) -> np.ndarray:
  """[Q, D] query embeddings: `[CLS] question [SEP]`, untruncated (padded to the longest + 8)."""
  tok = tower.tokenizer
  ids = tok.encode_batch(list(questions))
  for i, x in enumerate(ids):
    if not x:
      raise ValueError(f"Question #{i} {questions[i]!r} is empty.")
  length = -(-(max(len(x) for x in ids) + 2) // 8) * 8
  out = [np.asarray(tower.embed(batch_join([(x, None) for x in ids[lo:lo + batch_size]], length, tok)))
         for lo in range(0, len(ids), batch_size)]
  return np.concatenate(out)


def retrieval_hits(corpus, block_ids: np.ndarray, answers: Sequence[Sequence[str]],
                   answer_types: Sequence[str] | None = None) -> np.ndarray:
  """[Q, k] bool: whether retrieved block (q, j) contains an answer of question q (its title +
  body; answers of type "regex" are patterns matched in the text, the others normalised words)."""
  rows = corpus.rows_of(block_ids)
  text: dict[int, str] = {}
  norm: dict[int, str] = {}
  hits = np.zeros(block_ids.shape, bool)
  for q, row_list in enumerate(rows):
    regex = answer_types is not None and answer_types[q] == "regex"
    for j, r in enumerate(row_list):
      if r < 0:
        continue
      if r not in text:
        b = corpus[r]
        text[r] = b["title"] + " " + b["body"]
      if regex:
        hits[q, j] = regex_match(text[r], answers[q])
      else:
        if r not in norm:
          norm[r] = normalize_answer(text[r])
        hits[q, j] = has_answer("", answers[q], normalized_text=norm[r])
  return hits


def recall_at_k(hits: np.ndarray, ks: Sequence[int]) -> dict[int, float]:
  """Percentage of questions with a hit among the first k retrieved, for each k."""
  return {k: float(100.0 * hits[:, :k].any(axis=1).mean()) for k in ks}


def evaluate_retrieval(tower, index, corpus, questions: Sequence[dict],
                       ks: Sequence[int] = (1, 5, 20)) -> dict:
  """Recall@k of `index` (searched with `tower`'s query embeddings) on the questions: dicts with
  "question" and "answers" or "answer" (`data.qa_batches.answers_of`), optionally "answer_type"."""
  start = time.perf_counter()
  q_emb = embed_questions(tower, [q["question"] for q in questions])
  _, ids = index.search(q_emb, max(ks))
  answers, kinds = zip(*(answers_of(q) for q in questions)) if questions else ((), ())
  hits = retrieval_hits(corpus, ids, answers, kinds)
  recall = recall_at_k(hits, ks)
  logging.info("recall %s on %d questions in %.1f s", recall, len(questions),
               time.perf_counter() - start)
  return {"recall": recall, "hits": hits, "block_ids": ids}
