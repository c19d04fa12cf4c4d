"""DPR's training examples (Karpukhin et al. 2020) from open-QA questions and a corpus, and their
batches.

    answers = PassageAnswers(corpus, tokenizer, passage_length=128, truncate="longest")
    examples, counts = mine_examples(questions, bm25, answers.in_passage, answers.in_block)
    it = dpr_batches(examples, corpus, tokenizer, batch_size=32, seed=0, ...)
    batch = next(it)   # question [B, Lq], positive [B, Lp], hard_negative [B, Lp] (model inputs)

A question's positive passage is the best-ranked of BM25's first `depth` blocks whose passage
holds an answer string (DPR's choice where no gold passage is given), judged on the text the
passage tower reads: the block's title and body cut where its input of `passage_length` word
pieces cuts them (`Corpus.model_inputs`), so a block whose answer lies past the cut is no
positive (the tower never sees it). Its hard negative is the best-ranked block that holds no
answer anywhere, also past the cut: at evaluation such a block is a hit (recall@k reads the whole
block), so the question must not learn to avoid it. A question without either among the first
`depth` is left out (counted). "Holds an answer" is the open-QA definition (the normalised answer
occurs as whole words in the normalised text, or a CuratedTREC pattern matches it:
`text.answers`).

Batches: every question is scored against every passage of the batch (in-batch negatives), so two
examples share a batch only if neither one's passages (positive or hard negative) is the other's
positive block or holds one of the other's answers (`clash`): no question ever learns to avoid a
passage that answers it. An example that clashes with the batch being filled waits for a later one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence

import grain
import numpy as np

from realm_jax.data.pretrain import default_read_options
from realm_jax.data.qa_batches import answers_of
from realm_jax.text import BertTokenizer, join_bert
from realm_jax.text.answers import has_answer, normalize_answer, regex_match

HasAnswer = Callable[[int, list, str], bool]  # (corpus row, answers, answer type) -> bool


class PassageAnswers:
  """Whether a block holds a question's answers: in the text the passage tower reads of it
  (`in_passage`), or anywhere in its title and body (`in_block`).

  Args:
    corpus: a `Corpus`.
    tokenizer: the passage tower's tokenizer (the corpus's vocabulary).
    passage_length, truncate: the passage input, as `Corpus.model_inputs` lays it out.
  """

  def __init__(self, corpus, tokenizer: BertTokenizer, passage_length: int, truncate: str):
    self.corpus, self.tokenizer = corpus, tokenizer
    self.passage_length, self.truncate = passage_length, truncate
    self._passage = functools.lru_cache(maxsize=65_536)(self._read_text)
    self._normalized = functools.lru_cache(maxsize=65_536)(
        lambda row, whole: normalize_answer(self.block_text(row) if whole else self._passage(row)))

  def block_text(self, row: int) -> str:
    """Title + body of block `row`, whole."""
    b = self.corpus[int(row)]
    return b["title"] + " " + b["body"]

  def _read_text(self, row: int) -> str:
    """The title and body as far as the tower's input keeps their word pieces, cut in the text
    at the end of the last piece kept."""
    inputs = self.corpus.model_inputs([row], self.passage_length, self.tokenizer, self.truncate)
    kept = inputs["attention_mask"][0] == 1
    types = inputs["token_type_ids"][0]
    # [CLS] title [SEP] in segment 0, body [SEP] in segment 1.
    counts = (int((kept & (types == 0)).sum()) - 2, int((kept & (types == 1)).sum()) - 1)
    b = self.corpus[row]
    encoded = self.tokenizer.encode_batch_with_offsets([b["title"], b["body"]])
    parts = []
    fields = zip((b["title"], b["body"]), (b["title_token_ids"], b["token_ids"]), counts, encoded)
    for text, ids, n, (got, offsets) in fields:
      if n <= 0:
        continue
      if list(got) == [int(x) for x in ids]:
        parts.append(text[:offsets[n - 1][1]])
      else:  # text and stored pieces disagree (another tokenizer): the pieces themselves
        logging.warning("Corpus row %d: its text tokenises otherwise than its stored word "
                        "pieces; its passage text is decoded from the pieces.", row)
        parts.append(self.tokenizer.decode([int(x) for x in ids[:n]]))
    return " ".join(parts)

  def passage_text(self, row: int) -> str:
    """What the passage tower reads of block `row`, as text (cached)."""
    return self._passage(int(row))

  def _holds(self, row: int, answers, kind: str, whole: bool) -> bool:
    row = int(row)
    if kind == "regex":
      return regex_match(self.block_text(row) if whole else self._passage(row), answers)
    return has_answer("", answers, normalized_text=self._normalized(row, whole))

  def in_passage(self, row: int, answers, kind: str) -> bool:
    """An answer in the text the passage tower reads of block `row`."""
    return self._holds(row, answers, kind, whole=False)

  def in_block(self, row: int, answers, kind: str) -> bool:
    """An answer anywhere in block `row` (title + body)."""
    return self._holds(row, answers, kind, whole=True)


def mine_examples(questions: Sequence[dict], bm25, in_passage: HasAnswer, in_block: HasAnswer,
                  depth: int = 100, batch_size: int = 256) -> tuple[list[dict], dict]:
  """(examples, counts): one {"question", "answers", "answer_type", "positive", "hard_negative"}
  (corpus rows) per question that has both among BM25's first `depth` blocks, in the questions'
  order.

  Args:
    questions: dicts with "question" and "answers" (or "answer"; `answers_of`).
    bm25: a `BM25Index` whose documents are the corpus rows.
    in_passage: (row, answers, answer_type) -> an answer in what the passage tower reads of the
      block: the positives.
    in_block: the same anywhere in the block: the hard negatives hold none.
    depth: BM25 blocks looked at per question.
  Returns:
    counts: {"questions", "examples", "no_positive", "no_negative", "past_the_cut"}; past_the_cut
      counts the questions without a positive whose answer is in one of those blocks, after the
      passage's cut.
  """
  if depth < 2:
    raise ValueError(f"depth={depth}: look at 2 or more BM25 blocks per question.")
  depth = min(depth, len(bm25))
  examples = []
  counts = {"questions": len(questions), "no_positive": 0, "no_negative": 0, "past_the_cut": 0}
  for lo in range(0, len(questions), batch_size):
    part = questions[lo:lo + batch_size]
    _, rows = bm25.search([q["question"] for q in part], depth, batch_size=batch_size)
    for q, ranked in zip(part, rows):
      answers, kind = answers_of(q)
      positive = negative = -1
      cut = False
      for r in ranked:
        if r < 0:
          break  # BM25 found no more blocks sharing a word with the question
        r = int(r)
        if not in_block(r, answers, kind):
          negative = r if negative < 0 else negative
        elif positive < 0 and in_passage(r, answers, kind):
          positive = r
        else:
          cut |= positive < 0
        if positive >= 0 and negative >= 0:
          break
      if positive < 0:
        counts["no_positive"] += 1
        counts["past_the_cut"] += cut
      elif negative < 0:
        counts["no_negative"] += 1
      else:
        examples.append({"question": q["question"], "answers": list(answers),
                         "answer_type": kind, "positive": positive, "hard_negative": negative})
  counts["examples"] = len(examples)
  return examples, counts


def clash(a: dict, b: dict, in_block: HasAnswer) -> bool:
  """Whether examples `a` and `b` may not share a batch: a passage of one (positive or hard
  negative) is the other's positive block or holds one of the other's answers."""
  for x, y in ((a, b), (b, a)):
    for row in (x["positive"], x["hard_negative"]):
      if row == y["positive"] or in_block(row, y["answers"], y["answer_type"]):
        return True
  return False


class _CleanBatchIterator(grain.DatasetIterator):
  """Groups the example indices of its parent into batches of examples that do not `clash`; an
  example that clashes with the batch being filled waits (in order) for the next batches. Its
  state is the parent's and the waiting examples'."""

  def __init__(self, parent, examples: Sequence[dict], batch_size: int, in_block: HasAnswer):
    super().__init__(parent)
    self._examples, self._batch_size, self._in_block = examples, batch_size, in_block
    self._waiting: list[int] = []

  def _fits(self, i: int, batch: list[int]) -> bool:
    return not any(clash(self._examples[i], self._examples[j], self._in_block) for j in batch)

  def __next__(self) -> list[int]:
    batch, still = [], []
    for i in self._waiting:
      (batch if len(batch) < self._batch_size and self._fits(i, batch) else still).append(i)
    self._waiting = still
    tried = set(still)  # the examples that do not fit the batch as it is
    while len(batch) < self._batch_size:
      i = int(next(self._parent))  # StopIteration: the last, partial batch is dropped
      if self._fits(i, batch):
        batch.append(i)
        tried.clear()
        continue
      self._waiting.append(i)
      tried.add(i)
      if len(tried) == len(self._examples):
        raise ValueError(
            f"The DPR examples clash too often to fill a batch of {self._batch_size}: none of the "
            f"{len(self._examples)} fits beside the {len(batch)} taken (a passage of one holds "
            "another's answer, or is its positive). Lower the batch size, or use more questions.")
    return batch

  def get_state(self) -> dict:
    return {"parent": self._parent.get_state(), "waiting": list(self._waiting)}

  def set_state(self, state: dict) -> None:
    self._parent.set_state(state["parent"])
    self._waiting = [int(i) for i in state["waiting"]]


class _CleanBatches(grain.IterDataset):
  def __init__(self, parent, examples: Sequence[dict], batch_size: int, in_block: HasAnswer):
    super().__init__(parent)
    self._args = (examples, batch_size, in_block)

  def __iter__(self):
    return _CleanBatchIterator(self._parent.__iter__(), *self._args)


def example_batches(examples: Sequence[dict], batch_size: int, in_block: HasAnswer, *, seed: int,
                    shuffle: bool = True, num_epochs: int | None = None,
                    read_options=None) -> grain.IterDataset:
  """Batches of indices into `examples` (lists of `batch_size`), no two of a batch clashing, in
  the order of a shuffle by `seed` (another each epoch) or as given; deterministic."""
  ds = grain.MapDataset.range(len(examples))
  if shuffle:
    ds = ds.shuffle(seed=seed)
  read_options = read_options or default_read_options()
  return _CleanBatches(ds.repeat(num_epochs).to_iter_dataset(read_options), examples, batch_size,
                       in_block)


@dataclasses.dataclass(frozen=True)
class DprArrays:
  """grain map: examples -> {"question" [B, Lq], "positive" [B, Lp], "hard_negative" [B, Lp]},
  each as {input_ids, attention_mask, token_type_ids} int32. A question is `[CLS] question [SEP]`
  (cut to fit); a passage is laid out as the index embeds it (`Corpus.model_inputs`)."""
  corpus: object
  tokenizer: BertTokenizer
  question_length: int
  passage_length: int
  truncate: str

  def __call__(self, examples: Sequence[dict]) -> dict:
    tok = self.tokenizer
    questions = [join_bert(tok.encode(e["question"])[:self.question_length - 2], None,
                           self.question_length, tok.cls_id, tok.sep_id, tok.pad_id)
                 for e in examples]
    out = {"question": {k: np.stack([q[k] for q in questions]) for k in questions[0]}}
    for part in ("positive", "hard_negative"):
      out[part] = self.corpus.model_inputs([e[part] for e in examples], self.passage_length, tok,
                                           self.truncate)
    return out


def dpr_batches(examples: Sequence[dict], corpus, tokenizer: BertTokenizer, *, batch_size: int,
                seed: int, question_length: int, passage_length: int, truncate: str = "longest",
                shuffle: bool = True, shard_index: int = 0, shard_count: int = 1,
                num_epochs: int | None = None, read_options=None,
                answers: PassageAnswers | None = None):
  """A checkpointable iterator of DPR batches (this host's share of the examples), no two
  examples of a batch clashing (`clash`; on several hosts, the examples of different hosts'
  shares are not checked against each other).

  Args:
    examples: from `mine_examples`.
    batch_size: examples per batch (per host); the last partial batch is dropped.
    seed: the order (a new one each epoch when `shuffle`); same seed, same batches.
    question_length, passage_length: word pieces of a question / a passage input.
    truncate: how a passage is cut ("b": the body, "longest": HF longest_first), as the index.
    shard_index, shard_count: this host takes examples shard_index, shard_index + shard_count, ...
    num_epochs: None repeats forever.
    answers: where answers are in the corpus (default: made here from the corpus).
  Returns:
    grain DatasetIterator of {"question", "positive", "hard_negative"}, each a dict of [B, L]
    int32 arrays; `get_state()` is JSON-serialisable and `set_state` resumes exactly.
  """
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index={shard_index} must be in [0, shard_count={shard_count}).")
  examples = list(examples)[shard_index::shard_count]
  if not 1 <= batch_size <= len(examples):
    raise ValueError(f"batch_size={batch_size} must be between 1 and the {len(examples)} examples "
                     f"of shard {shard_index}/{shard_count}.")
  answers = answers or PassageAnswers(corpus, tokenizer, passage_length, truncate)
  batches = example_batches(examples, batch_size, answers.in_block, seed=seed, shuffle=shuffle,
                            num_epochs=num_epochs, read_options=read_options)
  arrays = DprArrays(corpus, tokenizer, question_length, passage_length, truncate)
  return iter(batches.map(lambda batch: arrays([examples[i] for i in batch])))
