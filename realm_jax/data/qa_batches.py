"""Reader inputs and open-QA fine-tuning batches: questions + their retrieved beam -> arrays.

Reader input of (question, block), with the block's title kept by default (titles often *are*
the answer):
    [CLS] question [SEP] title [SEP] body [SEP]        (token types 0 ... 0 | 1 ... 1)
or `[CLS] question [SEP] body [SEP]` for a block without a title, and for every block with
`reader_title=False`, the layout of ORQA/REALM's reader (320 = 288 + 32 word pieces; the title is
then neither read nor searched for answers). `block_mask` is 1 on the title and body word pieces
only, so every span the reader scores lies inside the title or inside the body (the reader
refuses a span over the hole at the [SEP] between them). The body is cut to fit `reader_length`;
the question to `question_length`; a title longer than the input is cut too (no body is read).

Gold spans: every occurrence in the title or the (cut) body of an answer's word pieces: of the
answer as written and of its normalised form (articles and punctuation dropped), as ORQA matched
answers by tokens. CuratedTREC answers are regular expressions: their matches in the block's
text are mapped to word pieces through the tokenizer's character offsets. A block "has an
answer" (the retriever's positives) when the normalised answer occurs in its normalised text
(title + body, or the body alone without `reader_title`), or a pattern matches it
(realm_jax/text/answers.py): the definition of open-QA recall@k (realm_jax/eval/open_qa.py). The
recall that `build_index.py` reports (realm_jax/retrieval/recall.py) always matches title + body.

Inputs are padded to the longest in the batch rounded up to `length_multiple`, so a batch of
short blocks does not pay for `reader_length` (one compiled step per length bucket). Questions are
padded to a power-of-two multiple of `question_multiple` (8, 16, 32, 64): every distinct shape
is another compiled step (a training step and an evaluation program, each held in memory for the
rest of the run), and the mixture's TriviaQA questions, 16 word pieces at the median and 62 at
most, spread the batches' longest over 7 multiples of 8 where NQ-Open's fill 2 (docs/open_qa.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from realm_jax.text import BertTokenizer
from realm_jax.text.answers import (compile_pattern, find_subsequences, has_answer,
                                    normalize_answer, regex_match)

ANSWER_TYPES = ("text", "regex")
MAX_QUESTION_CHARS = 2_000  # TriviaQA has questions of ~1,000 characters


def check_question(question: str) -> str:
  """The question stripped; ValueError when it is not text, empty or over MAX_QUESTION_CHARS."""
  if not isinstance(question, str) or not question.strip():
    raise ValueError("The question is empty: ask something, e.g. 'who wrote the origin of "
                     "species'.")
  if len(question) > MAX_QUESTION_CHARS:
    raise ValueError(f"The question has {len(question):,} characters: ask it in at most "
                     f"{MAX_QUESTION_CHARS:,}.")
  return question.strip()


def doubling_bucket(n: int, multiple: int, cap: int) -> int:
  """The smallest multiple x 2^k (k >= 0) that holds n, or cap if that is smaller: lengths padded to
  these take log2(cap / multiple) + 1 values, so a program compiled per shape is compiled that
  many times at most."""
  length = multiple
  while length < n:
    length *= 2
  return min(length, cap)


def answers_of(question: dict) -> tuple[list[str], str]:
  """(answers, answer_type) of a question dict from `load_questions` ("answers") or
  `load_qa_jsonl` ("answer")."""
  answers = question.get("answers", question.get("answer"))
  if answers is None:
    raise ValueError(f"Question {question.get('question')!r} has no 'answers' field.")
  if isinstance(answers, str):
    answers = [answers]
  kind = question.get("answer_type", "text")
  if kind not in ANSWER_TYPES:
    raise ValueError(f"answer_type={kind!r} of question {question.get('question')!r}: use one of "
                     f"{ANSWER_TYPES}.")
  return list(answers), kind


def answer_pieces(tokenizer: BertTokenizer, answers: Sequence[str]) -> list[tuple[int, ...]]:
  """Distinct non-empty word-piece sequences of each answer and of its normalised form."""
  texts = []
  for a in answers:
    texts += [a, normalize_answer(a)]
  texts = [t for t in dict.fromkeys(texts) if t.strip()]
  if not texts:
    return []
  return list(dict.fromkeys(tuple(ids) for ids in tokenizer.encode_batch(texts) if ids))


def char_spans_to_pieces(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
                         ) -> list[tuple[int, int]]:
  """Character spans [a, b) -> inclusive word-piece spans covering them (via piece offsets).

  `offsets` must be those of the whole text: a span past the last piece given would be clamped to
  it. Keep the spans that end inside a cut (e < n) afterwards.
  """
  if not offsets:
    return []
  begins = np.asarray([o[0] for o in offsets])
  ends = np.asarray([o[1] for o in offsets])
  out = []
  for a, b in spans:
    if b <= a:
      continue
    s = int(np.searchsorted(ends, a, side="right"))     # first piece ending after a
    e = int(np.searchsorted(begins, b, side="left")) - 1  # last piece starting before b
    if s <= e < len(offsets):
      out.append((s, e))
  return sorted(set(out))


def regex_char_spans(text: str, patterns: Sequence[str]) -> list[tuple[int, int]]:
  return [(m.start(), m.end()) for p in patterns for m in compile_pattern(p).finditer(text)]


@dataclasses.dataclass(frozen=True)
class ReaderLayout:
  """Where a block's pieces sit in one reader input: title pieces at [title_start, title_start +
  n_title), body pieces (the first n_body of the block's) at [body_start, body_start + n_body)."""
  title_start: int
  n_title: int
  body_start: int
  n_body: int


class QaBatcher:
  """Builds reader inputs and fine-tuning batches from a corpus.

  Args:
    corpus: a `Corpus` (blocks by row, with title/body text and word pieces).
    tokenizer: the reader's tokenizer (the corpus's vocabulary).
    question_length, reader_length: word-piece budgets of `[CLS] q [SEP]` and of a reader input.
    max_answer_spans: gold spans kept per block (A).
    max_span_width: the reader's longest span; longer gold spans cannot be predicted and are
      dropped.
    length_multiple: reader inputs are padded to a multiple of this.
    question_multiple: question inputs are padded to this times a power of two.
    reader_title: read each block's title before its body (False: the body alone, as ORQA and
      REALM's reader; answers are then looked for in the body only).
  """

  def __init__(self, corpus, tokenizer: BertTokenizer, *, question_length: int = 64,
               reader_length: int = 288, max_answer_spans: int = 8, max_span_width: int = 10,
               length_multiple: int = 32, question_multiple: int = 8, reader_title: bool = True):
    if reader_length < question_length + 4:
      raise ValueError(f"reader_length={reader_length} leaves no room for a block after a question "
                       f"of up to question_length={question_length} pieces.")
    self.corpus, self.tokenizer = corpus, tokenizer
    self.question_length, self.reader_length = question_length, reader_length
    self.max_answer_spans, self.max_span_width = max_answer_spans, max_span_width
    self.length_multiple, self.question_multiple = length_multiple, question_multiple
    self.reader_title = reader_title
    self._continuation = tokenizer.continuation
    self._block = functools.lru_cache(maxsize=65_536)(self._load_block)
    self._normalized = functools.lru_cache(maxsize=65_536)(
        lambda row: normalize_answer(self.answer_text(row)))

  # ------------------------------------------------------------------------------- blocks
  def _load_block(self, row: int) -> dict:
    b = self.corpus[int(row)]
    return {"title": b["title"], "body": b["body"], "text": b["title"] + " " + b["body"],
            "title_ids": [int(x) for x in b["title_token_ids"]],
            "body_ids": [int(x) for x in b["token_ids"]]}

  def block(self, row: int) -> dict:
    """{title, body, text, title_ids, body_ids} of a corpus row (cached)."""
    return self._block(int(row))

  def question_ids(self, question: str) -> list[int]:
    """Word pieces of a question, cut to fit `[CLS] q [SEP]` in question_length."""
    check_question(question)
    ids = self.tokenizer.encode(question)
    if not ids:
      raise ValueError(f"The question {question!r} has no word pieces.")
    return ids[:self.question_length - 2]

  def answer_text(self, row: int) -> str:
    """The text the reader sees of a block, where its answers are looked for."""
    b = self.block(row)
    return b["text"] if self.reader_title else b["body"]

  def has_answer(self, row: int, answers: Sequence[str], answer_type: str) -> bool:
    if answer_type == "regex":
      return regex_match(self.answer_text(row), answers)
    return has_answer("", answers, normalized_text=self._normalized(int(row)))

  # ----------------------------------------------------------------------- reader inputs
  def layout(self, q_ids: Sequence[int], row: int) -> ReaderLayout:
    b = self.block(row)
    n_title = len(b["title_ids"]) if self.reader_title else 0
    title_start = len(q_ids) + 2
    # A title too long for the input is cut to leave room for its [SEP] and the last one.
    n_title = max(0, min(n_title, self.reader_length - title_start - 2))
    body_start = title_start + n_title + (1 if n_title else 0)
    n_body = max(0, min(len(b["body_ids"]), self.reader_length - body_start - 1))
    return ReaderLayout(title_start, n_title, body_start, n_body)

  def reader_row(self, q_ids: Sequence[int], row: int, length: int) -> tuple[dict, ReaderLayout]:
    """One reader input of `length` pieces: input_ids, attention_mask, token_type_ids, block_mask."""
    b, lay = self.block(row), self.layout(q_ids, row)
    tok = self.tokenizer
    ids = [tok.cls_id, *q_ids, tok.sep_id]
    if lay.n_title:
      ids += [*b["title_ids"][:lay.n_title], tok.sep_id]
    ids += [*b["body_ids"][:lay.n_body], tok.sep_id]
    n = len(ids)
    out = {k: np.zeros(length, np.int32) for k in ("input_ids", "attention_mask",
                                                    "token_type_ids", "block_mask")}
    out["input_ids"][:n] = ids
    out["attention_mask"][:n] = 1
    out["token_type_ids"][len(q_ids) + 2:n] = 1
    out["block_mask"][lay.title_start:lay.title_start + lay.n_title] = 1
    out["block_mask"][lay.body_start:lay.body_start + lay.n_body] = 1
    return out, lay

  def padded_length(self, q_ids_list: Sequence[Sequence[int]], rows: np.ndarray) -> int:
    """The bucketed length that fits every (question, block) of a batch."""
    longest = self.max_span_width
    for q_ids, row_list in zip(q_ids_list, rows):
      for r in row_list:
        if r >= 0:
          lay = self.layout(q_ids, r)
          longest = max(longest, lay.body_start + lay.n_body + 1)
    m = self.length_multiple
    return min(-(-longest // m) * m, max(self.reader_length, self.max_span_width))

  def reader_inputs(self, q_ids_list: Sequence[Sequence[int]], rows: np.ndarray
                    ) -> tuple[dict, list[list[ReaderLayout | None]]]:
    """Reader arrays [B, R, L] for rows [B, R] (-1 = no block: all-zero input) and the layouts."""
    rows = np.asarray(rows)
    length = self.padded_length(q_ids_list, rows)
    b, r = rows.shape
    out = {k: np.zeros((b, r, length), np.int32) for k in ("input_ids", "attention_mask",
                                                            "token_type_ids", "block_mask")}
    layouts: list[list[ReaderLayout | None]] = []
    for i, (q_ids, row_list) in enumerate(zip(q_ids_list, rows)):
      layouts.append([])
      for j, row in enumerate(row_list):
        if row < 0:
          out["input_ids"][i, j, 0] = self.tokenizer.cls_id
          out["attention_mask"][i, j, 0] = 1  # a lone [CLS]: finite attention, no valid span
          layouts[-1].append(None)
          continue
        one, lay = self.reader_row(q_ids, row, length)
        for k, v in one.items():
          out[k][i, j] = v
        layouts[-1].append(lay)
    # Spans start and end on whole words: not on a "##" piece, not before one.
    cont = self._continuation[out["input_ids"]]
    nxt = np.concatenate([cont[..., 1:], np.zeros_like(cont[..., :1])], axis=-1)
    out["word_start"] = (out["block_mask"] > 0) & ~cont
    out["word_end"] = (out["block_mask"] > 0) & ~nxt
    out["word_start"] = out["word_start"].astype(np.int32)
    out["word_end"] = out["word_end"].astype(np.int32)
    return out, layouts

  # -------------------------------------------------------------------------- gold spans
  def gold_spans(self, row: int, lay: ReaderLayout, answers: Sequence[str], answer_type: str,
                 pieces: Sequence[Sequence[int]] | None = None) -> list[tuple[int, int]]:
    """Reader-input positions (inclusive) of the answers in block `row` laid out as `lay`."""
    b = self.block(row)
    found = []
    segments = ((b["title"], b["title_ids"], lay.title_start, lay.n_title),
                (b["body"], b["body_ids"][:lay.n_body], lay.body_start, lay.n_body))
    for text, ids, start, n in segments:
      if n == 0:
        continue
      if answer_type == "regex":
        # The offsets of the whole text, not only the kept pieces': a match running past the cut
        # ends at a piece e >= n and is dropped below, as a text answer's would be.
        _, offsets = self.tokenizer.encode_batch_with_offsets([text])[0]
        spans = char_spans_to_pieces(offsets, regex_char_spans(text, answers))
      else:
        spans = find_subsequences(ids, pieces if pieces is not None
                                  else answer_pieces(self.tokenizer, answers))
      found += [(start + s, start + e) for s, e in spans
                if e < n and e - s + 1 <= self.max_span_width]
    return sorted(set(found))[:self.max_answer_spans]

  # ----------------------------------------------------------------------- train batches
  def train_batch(self, questions: Sequence[dict], beam_rows: np.ndarray,
                  embeddings: np.ndarray, reader_blocks: int) -> dict:
    """The batch of `realm_jax.train.qa_step` for questions and their beams.

    Args:
      questions: B question dicts (question, answers, answer_type).
      beam_rows: [B, Z] corpus rows of each question's retrieved beam, best first (-1 = none).
      embeddings: [N, D] frozen document embeddings by corpus row.
      reader_blocks: R, the beam's first R blocks are read; 0 = a retriever-only batch.
    """
    beam_rows = np.asarray(beam_rows)
    b, z = beam_rows.shape
    if reader_blocks > z:
      raise ValueError(f"reader_blocks={reader_blocks} is more than the beam of {z}.")
    q_ids = [self.question_ids(q["question"]) for q in questions]
    beam_mask = (beam_rows >= 0).astype(np.int32)
    has = np.zeros((b, z), np.int32)
    for i, q in enumerate(questions):
      answers, kind = answers_of(q)
      for j in np.flatnonzero(beam_mask[i]):
        has[i, j] = self.has_answer(beam_rows[i, j], answers, kind)
    out = {"question": self._questions(q_ids),
           "beam_embeddings": (embeddings[np.maximum(beam_rows, 0)] * beam_mask[..., None]
                               ).astype(np.float32),
           "beam_mask": beam_mask, "beam_has_answer": has}
    if reader_blocks == 0:  # retriever-only batch
      return out
    read = beam_rows[:, :reader_blocks]
    reader, layouts = self.reader_inputs(q_ids, read)
    a = self.max_answer_spans
    gold_starts = np.full((b, reader_blocks, a), -1, np.int32)
    gold_ends = np.full((b, reader_blocks, a), -1, np.int32)
    for i, q in enumerate(questions):
      answers, kind = answers_of(q)
      pieces = answer_pieces(self.tokenizer, answers) if kind == "text" else None
      for j in range(reader_blocks):
        if layouts[i][j] is None or not has[i, j]:
          continue
        spans = self.gold_spans(read[i, j], layouts[i][j], answers, kind, pieces)
        for k, (s, e) in enumerate(spans):
          gold_starts[i, j, k], gold_ends[i, j, k] = s, e
    masks = {k: reader.pop(k) for k in ("block_mask", "word_start", "word_end")}
    return {**out, "reader": reader, **masks, "gold_starts": gold_starts, "gold_ends": gold_ends}

  def _questions(self, q_ids: Sequence[Sequence[int]]) -> dict:
    """`[CLS] q [SEP]` arrays [B, Lq], padded to the longest rounded up to question_multiple
    times a power of two (at most question_length)."""
    length = doubling_bucket(max(len(x) for x in q_ids) + 2, self.question_multiple,
                             max(self.question_length, 8))
    out = {k: np.zeros((len(q_ids), length), np.int32)
           for k in ("input_ids", "attention_mask", "token_type_ids")}
    for i, ids in enumerate(q_ids):
      row = [self.tokenizer.cls_id, *ids, self.tokenizer.sep_id]
      out["input_ids"][i, :len(row)] = row
      out["attention_mask"][i, :len(row)] = 1
    return out

  def questions(self, texts: Sequence[str]) -> dict:
    return self._questions([self.question_ids(t) for t in texts])

  def any_answer_in(self, question: dict, rows: Sequence[int]) -> bool:
    answers, kind = answers_of(question)
    return any(self.has_answer(r, answers, kind) for r in rows if r >= 0)

  def answer_readable(self, question: dict, rows: Sequence[int]) -> bool:
    """Whether the reader can point at an answer in one of `rows` read for `question`: a gold
    span (`gold_spans`) in what its input keeps of the block (the body cut to reader_length), no
    longer than max_span_width. `any_answer_in` looks at the whole block: an answer past the cut
    is in the block but not readable."""
    answers, kind = answers_of(question)
    q_ids = self.question_ids(question["question"])
    pieces = answer_pieces(self.tokenizer, answers) if kind == "text" else None
    return any(self.gold_spans(r, self.layout(q_ids, r), answers, kind, pieces)
               for r in rows if r >= 0 and self.has_answer(r, answers, kind))
