"""DPR's training examples (Karpukhin et al. 2020) from open-QA questions and a corpus, and their
batches.

    examples, counts = mine_examples(questions, bm25, has_answer, depth=100)
    it = dpr_batches(examples, corpus, tokenizer, batch_size=32, seed=0, ...)
    batch = next(it)   # question [B, Lq], positive [B, Lp], hard_negative [B, Lp] (model inputs)

A question's positive passage is the best-ranked of BM25's first `depth` blocks that holds an
answer string (DPR's choice where no gold passage is given); its hard negative is the
best-ranked of them that holds none. A question without either among the first `depth` is left
out (counted). "Holds an answer" is the open-QA definition (the normalised answer occurs in the
block's normalised title + body, or a CuratedTREC pattern matches it: `QaBatcher.has_answer`),
so no hard negative ever contains an answer string.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import grain

from realm_jax.data.qa_batches import answers_of
from realm_jax.text import BertTokenizer, join_bert


def mine_examples(questions: Sequence[dict], bm25, has_answer: Callable[[int, list, str], bool],
                  depth: int = 100, batch_size: int = 256) -> tuple[list[dict], dict]:
  """(examples, counts): one {"question", "answers", "positive", "hard_negative"} (corpus rows)
  per question that has both among BM25's first `depth` blocks, in the questions' order.

  Args:
    questions: dicts with "question" and "answers" (or "answer"; `answers_of`).
    bm25: a `BM25Index` whose documents are the corpus rows.
    has_answer: (row, answers, answer_type) -> whether the block holds an answer.
    depth: BM25 blocks looked at per question.
  Returns:
    counts: {"questions", "examples", "no_positive", "no_negative"}.
  """
  if depth < 2:
    raise ValueError(f"depth={depth}: look at 2 or more BM25 blocks per question.")
  depth = min(depth, len(bm25))
  examples, counts = [], {"questions": len(questions), "no_positive": 0, "no_negative": 0}
  for lo in range(0, len(questions), batch_size):
    part = questions[lo:lo + batch_size]
    _, rows = bm25.search([q["question"] for q in part], depth, batch_size=batch_size)
    for q, ranked in zip(part, rows):
      answers, kind = answers_of(q)
      positive = negative = -1
      for r in ranked:
        if r < 0:
          break  # BM25 found no more blocks sharing a word with the question
        if has_answer(int(r), answers, kind):
          positive = int(r) if positive < 0 else positive
        elif negative < 0:
          negative = int(r)
        if positive >= 0 and negative >= 0:
          break
      if positive < 0:
        counts["no_positive"] += 1
      elif negative < 0:
        counts["no_negative"] += 1
      else:
        examples.append({"question": q["question"], "answers": list(answers),
                         "answer_type": kind, "positive": positive, "hard_negative": negative})
  counts["examples"] = len(examples)
  return examples, counts


@dataclasses.dataclass(frozen=True)
class DprArrays:
  """grain map: example -> {"question" [Lq], "positive" [Lp], "hard_negative" [Lp]}, each as
  {input_ids, attention_mask, token_type_ids} int32. A question is `[CLS] question [SEP]` (cut to
  fit); a passage is laid out as the index embeds it (`Corpus.model_inputs`)."""
  corpus: object
  tokenizer: BertTokenizer
  question_length: int
  passage_length: int
  truncate: str

  def __call__(self, example: dict) -> dict:
    tok = self.tokenizer
    ids = tok.encode(example["question"])[:self.question_length - 2]
    passages = self.corpus.model_inputs([example["positive"], example["hard_negative"]],
                                        self.passage_length, tok, self.truncate)
    return {"question": join_bert(ids, None, self.question_length, tok.cls_id, tok.sep_id,
                                  tok.pad_id),
            "positive": {k: v[0] for k, v in passages.items()},
            "hard_negative": {k: v[1] for k, v in passages.items()}}


def dpr_batches(examples: Sequence[dict], corpus, tokenizer: BertTokenizer, *, batch_size: int,
                seed: int, question_length: int, passage_length: int, truncate: str = "longest",
                shuffle: bool = True, shard_index: int = 0, shard_count: int = 1,
                num_epochs: int | None = None, read_options=None):
  """A checkpointable iterator of DPR batches (this host's share of the examples).

  Args:
    examples: from `mine_examples`.
    batch_size: examples per batch (per host); the last partial batch is dropped.
    seed: the order (a new one each epoch when `shuffle`); same seed, same batches.
    question_length, passage_length: word pieces of a question / a passage input.
    truncate: how a passage is cut ("b": the body, "longest": HF longest_first), as the index.
    shard_index, shard_count: this host takes examples shard_index, shard_index + shard_count, ...
    num_epochs: None repeats forever.
  Returns:
    grain DatasetIterator of {"question", "positive", "hard_negative"}, each a dict of [B, L]
    int32 arrays; `get_state()` is JSON-serialisable and `set_state` resumes exactly.
  """
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index={shard_index} must be in [0, shard_count={shard_count}).")
  ds = grain.MapDataset.source(list(examples))[shard_index::shard_count]
  if not 1 <= batch_size <= len(ds):
    raise ValueError(f"batch_size={batch_size} must be between 1 and the {len(ds)} examples of "
                     f"shard {shard_index}/{shard_count}.")
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(num_epochs).map(DprArrays(corpus, tokenizer, question_length, passage_length,
                                           truncate))
  read_options = read_options or grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)
  return iter(ds.to_iter_dataset(read_options).batch(batch_size, drop_remainder=True))
