"""Answer normalisation, matching and span finding for open-domain QA (the SQuAD / ORQA
convention).

normalize: lower-case, Unicode NFD, drop punctuation, drop the articles a/an/the, collapse spaces.
It also drops the combining marks NFD splits off (accents: "Zürich" -> "zurich"), as the uncased
BERT tokenizer does, so that answers match the word pieces the reader reads; ORQA/DrQA keep them.
On NQ-Open dev (64 answers with accents) the MiniLM baseline's recall@1/5/20 is the same either
way (6.93 / 13.96 / 20.25 over the 10,033 articles).
A text "has" an answer when the normalised answer occurs in the normalised text as whole words.
CuratedTREC answers are regular expressions: they are matched, not compared.
`find_subsequences` finds word pieces in word pieces: an answer's in a block (the reader's gold
spans), a masked salient span's in a pre-training candidate.
"""

from __future__ import annotations

import functools
import re
import string
import unicodedata
from collections.abc import Iterable, Sequence

import numpy as np

_ARTICLES = re.compile(r"\b(a|an|the)\b")


@functools.cache
def _dropped() -> dict[int, None]:
  """str.translate's table: ASCII punctuation and every combining mark (category Mn) deleted."""
  marks = (c for c in range(0x110000) if unicodedata.category(chr(c)) == "Mn")
  return dict.fromkeys([*map(ord, string.punctuation), *marks])


def normalize_answer(text: str) -> str:
  text = unicodedata.normalize("NFD", text).lower().translate(_dropped())
  text = _ARTICLES.sub(" ", text)
  return " ".join(text.split())


def _answer_list(answers: Iterable[str]) -> Iterable[str]:
  if isinstance(answers, (str, bytes)):  # would be read character by character
    raise TypeError(f"answers must be a list of strings, not the single string {answers!r}: "
                    "wrap it in a list.")
  return answers


def has_answer(text: str, answers: Iterable[str], normalized_text: str | None = None) -> bool:
  """Whether any answer occurs in `text` as a sequence of whole normalised words."""
  answers = _answer_list(answers)
  hay = " " + (normalized_text if normalized_text is not None else normalize_answer(text)) + " "
  for a in answers:
    needle = normalize_answer(a)
    if needle and (" " + needle + " ") in hay:
      return True
  return False


def exact_match(prediction: str, answers: Iterable[str]) -> bool:
  """Whether the prediction equals an answer after `normalize_answer`, as the official ORQA and
  NQ-Open evaluations compare them, so that scores compare with published ones. As there, a gold
  answer that normalises to nothing (NQ-Open dev has "A+", "---", ")", "*") equals any prediction
  that does too ("the", "(")."""
  p = normalize_answer(prediction)
  return any(p == normalize_answer(a) for a in _answer_list(answers))


@functools.lru_cache(maxsize=4096)
def compile_pattern(pattern: str) -> re.Pattern:
  """A CuratedTREC answer pattern, compiled case-insensitively; ValueError naming a bad one."""
  try:
    return re.compile(pattern, flags=re.IGNORECASE | re.UNICODE)
  except re.error as e:
    raise ValueError(f"Answer pattern {pattern!r} is not a valid regular expression ({e}).") from None


def regex_match(text: str, patterns: Iterable[str]) -> bool:
  """CuratedTREC: whether any answer pattern matches somewhere in `text` (case-insensitive)."""
  return any(compile_pattern(p).search(text) for p in patterns)


def regex_exact_match(prediction: str, patterns: Iterable[str]) -> bool:
  """CuratedTREC EM: a pattern matches the prediction from its start (DrQA's convention)."""
  return any(compile_pattern(p).match(prediction) for p in patterns)


def find_subsequences(haystack: Sequence[int], needles: Sequence[Sequence[int]]
                      ) -> list[tuple[int, int]]:
  """Inclusive (start, end) of every occurrence of every needle in `haystack`, sorted."""
  hay = np.asarray(haystack)
  found = set()
  for needle in needles:
    n = len(needle)
    if n == 0 or n > len(hay):
      continue
    starts = np.flatnonzero(hay[:len(hay) - n + 1] == needle[0])
    for s in starts:
      if tuple(hay[s:s + n]) == tuple(needle):
        found.add((int(s), int(s + n - 1)))
  return sorted(found)
