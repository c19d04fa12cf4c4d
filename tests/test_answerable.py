"""Answers anywhere in a corpus (realm_jax/data/answerable.py): the inverted index finds exactly the
questions a block-by-block `has_answer` / `regex_match` finds, counted per dataset and part; the
table of experiments/absent_answers.py."""

import random

from realm_jax.data.answerable import AnswerFinder, absent_counts
from realm_jax.eval.absent import format_table
from realm_jax.text.answers import has_answer, regex_match

TEXTS = ["Charles Darwin wrote On the Origin of Species (1859).",
         "The Rolling Stones formed in London, 1962.",
         "Zürich is the largest city of Switzerland.",
         "Superman first appeared in Action Comics #1.",
         "Mount Everest: 8,848 m above sea level."]


def _brute(answers, kind):
  if kind == "regex":
    return any(regex_match(t, answers) for t in TEXTS)
  return any(has_answer(t, answers) for t in TEXTS)


def test_finds_what_a_block_by_block_search_finds():
  finder = AnswerFinder(TEXTS)
  cases = [(["charles darwin"], "text", True), (["Origin of Species"], "text", True),
           (["the rolling stones"], "text", True),  # articles and case go
           (["Rolling Stone"], "text", False),      # whole words only
           (["man"], "text", False), (["Zurich"], "text", True),  # accents go
           (["1859"], "text", True), (["8848 m"], "text", True),
           (["darwin origin"], "text", False),      # words of two places are not an answer
           (["nowhere", "London"], "text", True), (["", "!"], "text", False),
           (["8,848\\s*m"], "regex", True), (["^Mount"], "regex", True),
           (["\\b1963\\b|Berlin"], "regex", False)]
  for answers, kind, want in cases:
    assert finder.in_corpus(answers, kind) == want == _brute(answers, kind), answers
  # Random answers: words of the texts, alone and in runs.
  rng = random.Random(0)
  words = " ".join(TEXTS).split()
  for _ in range(300):
    start = rng.randrange(len(words))
    answer = " ".join(words[start:start + rng.randint(1, 4)])
    if rng.random() < 0.3:
      answer = answer.upper() + " x"
    assert finder.in_corpus([answer], "text") == _brute([answer], "text"), answer


def test_absent_counts_per_dataset_and_the_table():
  finder = AnswerFinder(TEXTS)
  q = lambda dataset, answer, kind="text": {"question": "?", "answers": [answer],
                                            "answer_type": kind, "dataset": dataset}
  parts = {"train": [q("nq", "Darwin"), q("nq", "Newton"), q("trec", "Lond(on|res)", "regex")],
           "test": [q("nq", "Einstein"), q("trec", "Paris", "regex")]}
  counts = absent_counts(parts, finder)
  assert counts == {"nq": {"train": {"questions": 2, "absent": 1},
                           "test": {"questions": 1, "absent": 1}},
                    "trec": {"train": {"questions": 1, "absent": 0},
                             "test": {"questions": 1, "absent": 1}}}
  assert finder.absent(parts["train"]) == [False, True, False]
  table = format_table(counts)
  assert "| nq | 1 / 2 (50.0%) | 1 / 1 (100.0%) |" in table
  assert "| trec | 0 / 1 (0.0%) | 1 / 1 (100.0%) |" in table
