"""Which questions have an answer anywhere in a corpus: the questions that no retriever can bring
an answering block for, and that train nothing (their beam never holds an answer).

    finder = corpus_finder(batcher)           # a QaBatcher's corpus, as its reader reads it
    finder.in_corpus(["Charles Darwin"], "text")            # True
    counts = absent_counts(parts, finder)   # {dataset: {"train": {"questions", "absent"}, ...}}

"Holds an answer" is open-QA's definition, the one recall@k uses (`QaBatcher.has_answer`): the
normalised answer as whole words in a block's normalised text, or a CuratedTREC pattern matching
it. Text answers are looked for only in the blocks that hold their rarest word (an inverted index
of the normalised texts); patterns are searched block by block.
"""

from __future__ import annotations

from collections.abc import Sequence

from realm_jax.data.mixture import by_dataset
from realm_jax.data.qa_batches import answers_of
from realm_jax.text.answers import compile_pattern, normalize_answer


class AnswerFinder:
  """`in_corpus(answers, answer_type)` over the blocks' texts (as the reader reads them:
  `QaBatcher.answer_text`)."""

  def __init__(self, texts: Sequence[str]):
    self.texts = list(texts)
    self.normalized = [f" {normalize_answer(t)} " for t in self.texts]
    self.blocks_of: dict[str, list[int]] = {}  # word -> the blocks holding it
    for b, text in enumerate(self.normalized):
      for word in set(text.split()):
        self.blocks_of.setdefault(word, []).append(b)

  def in_corpus(self, answers: Sequence[str], answer_type: str = "text") -> bool:
    """Whether some block holds one of `answers`."""
    if answer_type == "regex":
      patterns = [compile_pattern(p) for p in answers]
      return any(p.search(text) for text in self.texts for p in patterns)
    for answer in answers:
      words = normalize_answer(answer).split()
      if not words:
        continue
      blocks = min((self.blocks_of.get(w, ()) for w in set(words)), key=len)
      needle = f" {' '.join(words)} "
      if any(needle in self.normalized[b] for b in blocks):
        return True
    return False

  def absent(self, questions: Sequence[dict]) -> list[bool]:
    """For each question, whether its answer is nowhere in the corpus."""
    return [not self.in_corpus(*answers_of(q)) for q in questions]


def absent_counts(parts: dict[str, Sequence[dict]], finder: AnswerFinder) -> dict[str, dict]:
  """{dataset: {part: {"questions": n, "absent": m}}} of {part: questions} (each question with its
  "dataset"), datasets in order of first appearance."""
  out: dict[str, dict] = {}
  for part, questions in parts.items():
    absent = finder.absent(questions)
    for name, rows in by_dataset(questions).items():
      out.setdefault(name, {})[part] = {"questions": len(rows),
                                        "absent": sum(absent[i] for i in rows)}
  return out


def corpus_finder(batcher) -> AnswerFinder:
  """An AnswerFinder over the corpus of a `QaBatcher`, each block as its reader reads it."""
  return AnswerFinder([batcher.answer_text(r) for r in range(len(batcher.corpus))])
