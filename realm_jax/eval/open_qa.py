"""EM and recall@k of an open-QA system (realm_jax/systems/open_qa.py) on questions.

    qa = OpenQa(batcher, models, params, index, table, reader_blocks=5)
    evaluate_open_qa(qa, questions)   # EM (regex match for CuratedTREC), recall@k, predictions

A prediction is correct when it equals a gold answer after normalisation (`text.answers`), or, for
CuratedTREC, when an answer pattern matches it from its start. A question is recalled at k when an
answer occurs in one of its first k retrieved blocks (`QaBatcher.has_answer`). `bm25=` evaluates
the BM25 + same reader baseline: BM25's blocks, read by the same reader.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from realm_jax.data.mixture import by_dataset
from realm_jax.data.qa_batches import answers_of
from realm_jax.retrieval.recall import recall_at_k
from realm_jax.systems.open_qa import OpenQa
from realm_jax.text.answers import exact_match, regex_exact_match


def is_correct(prediction: str, question: dict) -> bool:
  answers, kind = answers_of(question)
  return regex_exact_match(prediction, answers) if kind == "regex" else exact_match(
      prediction, answers)


def check_ks(ks: Sequence[int], corpus_size: int) -> None:
  """ValueError (naming config.ks) unless every recall@k can be measured on the corpus."""
  if not ks or min(ks) < 1 or max(ks) > corpus_size:
    raise ValueError(f"--config.ks={tuple(ks)}: recall@k needs 1 <= k <= {corpus_size}, the blocks "
                     "of the corpus; pass e.g. --config.ks='(1,5)'.")


def evaluate_open_qa(qa: OpenQa, questions: Sequence[dict], *, ks: Sequence[int] = (1, 5, 20),
                     bm25=None, read: bool = True, progress: bool = False) -> dict:
  """EM and recall@k of `qa` on questions; `bm25` (a BM25Index over the corpus rows) replaces the
  dense retriever (the BM25 + same reader baseline).

  Returns {"em": %, "recall": {k: %}, "count", "seconds", "first_hit": [N], "predictions": [...]},
  `first_hit` the rank of each question's first retrieved block holding an answer (1-based; 0: none
  of the max(ks, reader_blocks) retrieved: recall@k of a question is 0 < first_hit <= k), each
  prediction with the gold `answers`, `correct`, `answer_in_read` (an answer occurs in a read
  block), `answer_readable` (the reader can select one there: `QaBatcher.answer_readable`) and
  its `first_hit`. read=False: retrieval only (em None, no predictions).
  """
  from tqdm.auto import tqdm
  check_ks(ks, len(qa.corpus))
  start = time.perf_counter()
  k = max(max(ks), qa.reader_blocks)
  texts = [q["question"] for q in questions]
  rows = np.zeros((len(texts), k), np.int64)
  for lo in tqdm(range(0, len(texts), 256), desc="retrieving", disable=not progress):
    chunk = texts[lo:lo + 256]
    if bm25 is None:
      rows[lo:lo + len(chunk)] = qa.retrieve(chunk, k)[1]
    else:
      rows[lo:lo + len(chunk)] = bm25.search(chunk, k)[1]
  hits = np.zeros(rows.shape, bool)
  for i, q in enumerate(questions):
    answers, kind = answers_of(q)
    for j, r in enumerate(rows[i]):
      hits[i, j] = r >= 0 and qa.batcher.has_answer(r, answers, kind)
  first_hit = np.where(hits.any(1), hits.argmax(1) + 1, 0)
  if not read:
    return {"em": None, "recall": recall_at_k(hits, ks), "count": len(questions),
            "seconds": time.perf_counter() - start, "first_hit": first_hit, "predictions": []}
  preds = []
  for lo in tqdm(range(0, len(texts), qa.batch_size), desc="reading", disable=not progress):
    preds += qa.read(texts[lo:lo + qa.batch_size], rows[lo:lo + qa.batch_size])
  correct = 0
  for i, (p, q) in enumerate(zip(preds, questions)):
    p["answers"] = answers_of(q)[0]
    p["correct"] = bool(is_correct(p["answer"], q))
    p["answer_in_read"] = bool(hits[i, :qa.reader_blocks].any())
    p["answer_readable"] = p["answer_in_read"] and qa.batcher.answer_readable(
        q, rows[i, :qa.reader_blocks])
    p["first_hit"] = int(first_hit[i])
    p["retrieved"] = [int(b) for b in qa.corpus.block_ids[rows[i][rows[i] >= 0]]]
    correct += p["correct"]
  n = max(len(questions), 1)
  return {"em": 100.0 * correct / n, "recall": recall_at_k(hits, ks), "count": len(questions),
          "seconds": time.perf_counter() - start, "first_hit": first_hit, "predictions": preds}


def per_dataset(result: dict, questions: Sequence[dict]) -> dict[str, dict]:
  """{dataset: {"em", "recall": {k: %}, "count"}} of an `evaluate_open_qa` result on `questions`,
  grouped by their "dataset" (in order of first appearance); em None when not read."""
  first_hit = np.asarray(result["first_hit"])
  out = {}
  for name, rows in by_dataset(questions).items():
    hit = first_hit[rows]
    em = None if result["em"] is None else 100.0 * float(
        np.mean([result["predictions"][i]["correct"] for i in rows]))
    out[name] = {"em": em, "recall": {k: 100.0 * float(np.mean((hit > 0) & (hit <= k)))
                                      for k in result["recall"]}, "count": len(rows)}
  return out
