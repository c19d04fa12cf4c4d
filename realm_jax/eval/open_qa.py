"""Answering questions end to end: question tower -> index -> reader -> answer text and evidence.

    qa = OpenQa(batcher, models, params, index, table, reader_blocks=5)
    qa.answer(["who wrote the origin of species"])
    # [{"question": ..., "answer": "Charles Darwin", "score": 17.3, "block_id": ...,
    #   "evidence": [{"block_id", "title", "retrieval_score", "span", "context"}, ...]}]
    evaluate_open_qa(qa, questions)   # EM (regex match for CuratedTREC), recall@k, predictions

The answer is the best span over the read blocks, scored as in fine-tuning: span score + the
block's retriever logit (score_scale * <q, z>). Its text is cut from the block's own text with the
tokenizer's character offsets, so it keeps the original spelling, accents and punctuation.
Retrieval can also come from elsewhere (`rows=`): the BM25 baseline reads BM25's blocks with the
same reader, each block scored with the same retriever logit.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence

import jax
import numpy as np

from realm_jax.data.qa_batches import QaBatcher, ReaderLayout, answers_of
from realm_jax.eval.answers import exact_match, regex_exact_match
from realm_jax.eval.retrieval import recall_at_k
from realm_jax.train.qa_step import QaModels, qa_predict_step

CONTEXT_CHARS = 120


def is_correct(prediction: str, question: dict) -> bool:
  answers, kind = answers_of(question)
  return regex_exact_match(prediction, answers) if kind == "regex" else exact_match(
      prediction, answers)


class OpenQa:
  """A trained open-QA system (see the module docstring).

  Args:
    batcher: builds question and reader inputs from the corpus.
    models: question tower, reader and score scale.
    params: {"query_tower", "reader"}.
    index: `DocIndex` over the frozen document embeddings.
    table: [N, D] the same embeddings by corpus row (the read blocks' retriever logits).
    reader_blocks: blocks read per question.
    batch_size: questions per device call (a fixed shape: one compile).
  """

  def __init__(self, batcher: QaBatcher, models: QaModels, params: dict, index, table: np.ndarray,
               reader_blocks: int = 5, batch_size: int = 16):
    self.batcher, self.models, self.index, self.table = batcher, models, index, table
    self.corpus = batcher.corpus
    self.params = params
    self.reader_blocks, self.batch_size = reader_blocks, batch_size
    self._embed, self._predict = _compiled(models)
    self._offset_cache: dict[int, tuple] = {}

  # ------------------------------------------------------------------------------ retrieve
  def embed(self, texts: Sequence[str]) -> np.ndarray:
    """[B, D] question embeddings of the current question tower."""
    return np.asarray(self._embed(self.params["query_tower"], self.batcher.questions(texts)))

  def retrieve(self, texts: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
    """(retriever logits [B, k], corpus rows [B, k]) of the top k blocks, best first."""
    scores, ids = self.index.search(self.embed(texts), k)
    return self.models.score_scale * scores, self.corpus.rows_of(ids)

  # ---------------------------------------------------------------------------------- read
  def read(self, texts: Sequence[str], rows: np.ndarray) -> list[dict]:
    """The best answer of each question from its blocks rows [B, >= R] (first R read); a
    ValueError instead when a score is not finite (damaged index embeddings or weights)."""
    rows = np.asarray(rows)[:, :self.reader_blocks]
    out = []
    for lo in range(0, len(texts), self.batch_size):
      out += self._read_batch(list(texts[lo:lo + self.batch_size]), rows[lo:lo + self.batch_size])
    return out

  def _read_batch(self, texts: list[str], rows: np.ndarray) -> list[dict]:
    n, bs = len(texts), self.batch_size
    q_ids = [self.batcher.question_ids(t) for t in texts]
    if n < bs:  # pad to the fixed batch: one compiled program for any number of questions
      q_ids = q_ids + [q_ids[0]] * (bs - n)
      rows = np.concatenate([rows, np.full((bs - n, rows.shape[1]), -1, rows.dtype)])
    reader, layouts = self.batcher.reader_inputs(q_ids, rows)
    masks = {k: reader.pop(k) for k in ("block_mask", "word_start", "word_end")}
    batch = {"question": self.batcher._questions(q_ids), "reader": reader, **masks,
             "beam_mask": (rows >= 0).astype(np.int32),
             "beam_embeddings": self.table[np.maximum(rows, 0)].astype(np.float32)}
    got = jax.device_get(self._predict(self.params, batch))
    self._check_finite(texts, got)
    starts, ends = _span_table(reader["input_ids"].shape[-1], self.batcher.max_span_width)
    preds = []
    for i in range(n):
      best = int(got["best"][i])
      j, s = divmod(best, len(starts))
      evidence = []
      for jj, row in enumerate(rows[i]):
        if row < 0:
          continue
        blk = self.batcher.block(row)
        ev = {"block_id": int(self.corpus.block_ids[row]), "title": blk["title"],
              "retrieval_score": float(got["retriever_logits"][i, jj])}
        k = int(got["block_best"][i, jj])
        text, where, (a, b) = self._span_text(row, layouts[i][jj], int(starts[k]), int(ends[k]))
        ev.update(best_span=text, best_span_score=float(got["block_score"][i, jj]),
                  span={"field": where, "start": a, "end": b},
                  context=_context(blk[where] if where else "", a, b))
        evidence.append(ev)
      answer = ""
      if rows[i, j] >= 0 and layouts[i][j] is not None:
        answer = self._span_text(rows[i, j], layouts[i][j], int(starts[s]), int(ends[s]))[0]
      preds.append({"question": texts[i], "answer": answer, "score": float(got["best_score"][i]),
                    "block_id": int(self.corpus.block_ids[rows[i, j]]) if rows[i, j] >= 0 else -1,
                    "block_rank": j, "evidence": evidence})
    return preds

  def _check_finite(self, texts: list[str], got: dict) -> None:
    """ValueError unless every score of the questions `texts` is finite. A NaN or infinite score
    comes from damaged index embeddings or weights, and the span it picks means nothing."""
    n = len(texts)
    retrieval = np.isfinite(got["retriever_logits"][:n]).all(axis=1)
    reading = np.isfinite(got["block_score"][:n]).all(axis=1) & np.isfinite(got["best_score"][:n])
    if (retrieval & reading).all():
      return
    i = int(np.argmin(retrieval & reading))
    if not retrieval[i]:
      index = f"index {self.index.directory}" if self.index.directory else "index"
      raise ValueError(
          f"No answer to {texts[i]!r}: the retrieval scores of its blocks are not finite (NaN or "
          f"infinite). The {index} holds damaged embeddings, or the question tower's weights are "
          "damaged: rebuild the index (experiments/build_index.py); if that does not help, "
          "restore a good checkpoint or fine-tune again.")
    raise ValueError(f"No answer to {texts[i]!r}: the reader's span scores are not finite (NaN or "
                     "infinite), so the reader's weights are damaged: restore a good checkpoint "
                     "or fine-tune again.")

  def _span_text(self, row: int, lay: ReaderLayout, start: int, end: int):
    """(text, "title" | "body", (char start, char end)) of reader positions [start, end]."""
    blk = self.batcher.block(row)
    title_off, body_off = self._offsets(row)
    parts = []
    for field, offsets, first, count in (("title", title_off, lay.title_start, lay.n_title),
                                         ("body", body_off, lay.body_start, lay.n_body)):
      lo, hi = max(start, first), min(end, first + count - 1)
      if lo <= hi and hi - first < len(offsets):
        a, b = offsets[lo - first][0], offsets[hi - first][1]
        parts.append((field, a, b))
    if not parts:
      return "", None, (0, 0)
    text = " ".join(blk[f][a:b] for f, a, b in parts)
    field, a, b = parts[-1] if len(parts) == 1 else parts[0]
    return text, field, (int(a), int(b))

  def _offsets(self, row: int):
    """Character offsets of the title's and the body's word pieces (cached per block)."""
    if row not in self._offset_cache:
      blk = self.batcher.block(row)
      (t_ids, t_off), (b_ids, b_off) = self.batcher.tokenizer.encode_batch_with_offsets(
          [blk["title"], blk["body"]])
      if list(t_ids) != blk["title_ids"] or list(b_ids) != blk["body_ids"]:
        logging.warning("Block row %d: re-tokenised text differs from the stored word pieces; "
                        "answer text may be cut imprecisely.", row)
      if len(self._offset_cache) > 65_536:
        self._offset_cache.clear()
      self._offset_cache[row] = (t_off, b_off)
    return self._offset_cache[row]

  def answer(self, texts: Sequence[str]) -> list[dict]:
    """Retrieve, then read: the best answer of each question with its evidence."""
    return self.read(texts, self.retrieve(texts, self.reader_blocks)[1])


@functools.lru_cache(maxsize=8)
def _compiled(models: QaModels):
  """(embed, predict) jitted once per set of models: systems that differ only in their
  parameters (evaluation of a baseline, each dev evaluation) share the compiled programs."""
  embed = jax.jit(lambda p, q: models.query_tower.apply(
      {"params": p}, q["input_ids"], q["attention_mask"], q["token_type_ids"]))
  return embed, jax.jit(functools.partial(qa_predict_step, models=models))


@functools.lru_cache(maxsize=64)
def _span_table(length: int, max_width: int):
  from realm_jax.models.reader import span_candidates
  return span_candidates(length, max_width)


def _context(text: str, a: int, b: int) -> str:
  lo, hi = max(0, a - CONTEXT_CHARS), min(len(text), b + CONTEXT_CHARS)
  return ("..." if lo > 0 else "") + text[lo:hi] + ("..." if hi < len(text) else "")


def check_ks(ks: Sequence[int], corpus_size: int) -> None:
  """ValueError (naming config.ks) unless every recall@k can be measured on the corpus."""
  if not ks or min(ks) < 1 or max(ks) > corpus_size:
    raise ValueError(f"--config.ks={tuple(ks)}: recall@k needs 1 <= k <= {corpus_size}, the blocks "
                     "of the corpus; pass e.g. --config.ks='(1,5)'.")


def evaluate_open_qa(qa: OpenQa, questions: Sequence[dict], *, ks: Sequence[int] = (1, 5, 20),
                     bm25=None, read: bool = True, progress: bool = False) -> dict:
  """EM and recall@k of `qa` on questions; `bm25` (a BM25Index over the corpus rows) replaces the
  dense retriever (the BM25 + same reader baseline).

  Returns {"em": %, "recall": {k: %}, "count", "seconds", "predictions": [...]}, each prediction
  with the gold `answers`, `correct`, and `answer_in_read` (an answer occurs in a read block).
  read=False: retrieval only (em None, no predictions).
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
  if not read:
    return {"em": None, "recall": recall_at_k(hits, ks), "count": len(questions),
            "seconds": time.perf_counter() - start, "predictions": []}
  preds = []
  for lo in tqdm(range(0, len(texts), qa.batch_size), desc="reading", disable=not progress):
    preds += qa.read(texts[lo:lo + qa.batch_size], rows[lo:lo + qa.batch_size])
  correct = 0
  for i, (p, q) in enumerate(zip(preds, questions)):
    p["answers"] = answers_of(q)[0]
    p["correct"] = bool(is_correct(p["answer"], q))
    p["answer_in_read"] = bool(hits[i, :qa.reader_blocks].any())
    p["retrieved"] = [int(b) for b in qa.corpus.block_ids[rows[i][rows[i] >= 0]]]
    correct += p["correct"]
  n = max(len(questions), 1)
  return {"em": 100.0 * correct / n, "recall": recall_at_k(hits, ks), "count": len(questions),
          "seconds": time.perf_counter() - start, "predictions": preds}
