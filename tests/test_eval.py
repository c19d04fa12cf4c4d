"""Answer normalisation, matching and recall@k, checked on hand-made cases."""

import os
import json

import forked_runs
import numpy as np
import pytest

from realm_jax.data.qa import load_qa_jsonl
from realm_jax.retrieval.recall import recall_at_k
from realm_jax.text.answers import exact_match, has_answer, normalize_answer, regex_match


@pytest.mark.parametrize("text,want", [
    ("The Beatles", "beatles"),
    ("  An  apple, a day!  ", "apple day"),
    ("Théâtre du Châtelet", "theatre du chatelet"),
    ("U.S.A.", "usa"),
    ("Anthem", "anthem"),           # "an" inside a word stays
    ("rock 'n' roll", "rock n roll"),
    ("1,000", "1000"),
    ("ÅNGSTRÖM", "angstrom"),
])
def test_normalize_answer(text, want):
  assert normalize_answer(text) == want


def test_normalize_answer_equals_a_plain_loop_over_real_text(articles):
  """The normaliser (translate, and a per-character look only where text is not ASCII) equals the
  rule written out character by character, over Wikipedia summaries (some with accents, dashes,
  quotes), NQ-Open dev answers and hand-picked marks."""
  import json
  import re
  import string
  import unicodedata
  from conftest import NQ_OPEN

  def plain(text):
    text = unicodedata.normalize("NFD", text).lower()
    kept = ""
    for c in text:
      if c not in string.punctuation and unicodedata.category(c) != "Mn":
        kept += c
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", kept).split())

  with open(os.path.join(NQ_OPEN, "NQ-open.dev.jsonl")) as f:
    answers = [a for line in f for a in json.loads(line)["answer"]]
  texts = [t for a in articles[:300] for t in (a["title"], a["text"])] + answers + [
      "Ça va — «naïve» café's", "Ångström\u0301s", "İstanbul", "x\u200by", "re-élan"]
  assert sum(not t.isascii() for t in texts) >= 20
  assert [normalize_answer(t) for t in texts] == [plain(t) for t in texts]


def test_has_answer_matches_whole_words_only():
  text = "The 1988 World Series was won by the Los Angeles Dodgers."
  assert has_answer(text, ["1988"]) and has_answer(text, ["the Dodgers"])
  assert has_answer(text, ["los angeles dodgers!"])
  assert not has_answer(text, ["198"]) and not has_answer(text, ["Dodger"])
  assert not has_answer(text, ["", "a"])  # empty after normalisation never matches
  assert has_answer("Salzburg, Austria", ["Vienna", "Austria"])
  # A bare string would be matched character by character ("1" occurs as a word here).
  for check in (has_answer, exact_match):
    with pytest.raises(TypeError, match="not the single string '1945': wrap it in a list"):
      check("Chapter 1 covers the war", "1945")


def test_exact_match_and_regex_match():
  assert exact_match("the Eiffel Tower.", ["Eiffel tower"])
  assert not exact_match("Eiffel", ["Eiffel tower"])
  assert regex_match("It was built in 1889 by Eiffel", [r"18[89]\d"])
  assert regex_match("the EIFFEL tower", [r"eiffel\s+tower"])
  assert not regex_match("built in 1901", [r"18[89]\d"])
  with pytest.raises(ValueError, match=r"Answer pattern '\(unclosed' is not a valid regular"):
    regex_match("x", ["(unclosed"])


def test_exact_match_of_answers_that_normalise_to_nothing_is_the_official_one():
  """As in the official ORQA / NQ-Open evaluation (normalised strings compared): gold answers that
  normalisation erases ("A+", "---") equal predictions it erases too ("the", "(")."""
  for prediction, answers in (("", ["A+", "AB+"]), ("the", ["---"]), ("(", [")"])):
    assert exact_match(prediction, answers), (prediction, answers)
  assert exact_match("a+", ["A+"]) and not exact_match("B", ["A+"])


def test_recall_at_k_by_hand():
  hits = np.array([[False, True, False], [False, False, False], [True, False, True],
                   [False, False, True]])
  assert recall_at_k(hits, (1, 2, 3)) == {1: 25.0, 2: 50.0, 3: 75.0}


def test_retrieval_hits_by_hand():
  """Normalised whole words for text answers, patterns for regex answers (CuratedTREC); ids
  not in the corpus are no hit."""
  from realm_jax.retrieval.recall import retrieval_hits

  class Blocks:  # two blocks with ids 10 and 20
    texts = [("Eiffel Tower", "It was built in 1889."), ("Paris", "The capital of France.")]

    def rows_of(self, ids):
      return np.vectorize({10: 0, 20: 1}.get)(ids, -1)

    def __getitem__(self, row):
      return dict(zip(("title", "body"), self.texts[row]))

  ids = np.array([[10, 20], [20, 10], [99, 20]])
  hits = retrieval_hits(Blocks(), ids, [["the eiffel tower"], [r"18[89]\d"], ["France"]],
                        ["text", "regex", "text"])
  np.testing.assert_array_equal(hits, [[True, False], [False, True], [False, True]])


def test_qa_jsonl_loader(tmp_path):
  p = tmp_path / "q.jsonl"
  p.write_text('{"question": "who?", "answer": ["me"]}\n{"question": "what", "answer": []}\n')
  with pytest.raises(ValueError, match=r"q.jsonl:2: expected"):
    load_qa_jsonl(str(p))
  assert load_qa_jsonl(str(p), limit=1) == [{"question": "who?", "answer": ["me"]}]
  with pytest.raises(FileNotFoundError, match="Question file .*nope.jsonl does not exist"):
    load_qa_jsonl(str(tmp_path / "nope.jsonl"))
  p.write_text(json.dumps({"question": "x" * 2001, "answer": ["me"]}) + "\n")
  with pytest.raises(ValueError, match=r"q.jsonl:1: the question has 2,001 characters"):
    load_qa_jsonl(str(p))


def test_shared_nq_open_dev_loads():
  import os
  path = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "nq_open",
                      "NQ-open.dev.jsonl")
  if not os.path.exists(path):
    pytest.skip("../shared/data/nq_open is not here")
  qs = load_qa_jsonl(path)
  assert len(qs) == 3610 and qs[0]["answer"] == ["14 December 1972 UTC", "December 1972"]


def test_evaluate_refuses_a_negative_limit(tmp_path):
  """experiments/evaluate.py --limit=-1 evaluated all questions but the last (a Python slice)
  and reported that as the split: refused, in one error line, before anything is loaded."""
  import os
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  got = forked_runs.run([sys.executable, os.path.join(root, "experiments", "evaluate.py"),
                        f"--workdir={tmp_path}", "--limit=-1"], cwd=root, capture_output=True,
                        text=True, timeout=120)
  assert got.returncode == 2 and got.stdout == ""
  assert got.stderr.strip() == "error: --limit=-1: pass a number of questions >= 1, or 0 for all."


def test_evaluate_refuses_an_eval_directory_it_cannot_write_before_loading(tmp_path):
  """experiments/evaluate.py answered every question, then failed to write eval/: refused first,
  in one error line naming the directory, before the corpus, the index or the models are read.
  eval/ is made unwritable by a file of that name, which stops root too (chmod does not)."""
  import os
  import sys
  from realm_jax.configs.finetune import get_config
  from realm_jax.retrieval.index import DocIndex
  from realm_jax.retrieval.index_store import publish_index
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  workdir = tmp_path / "w"
  workdir.mkdir()
  (workdir / "config.json").write_text(get_config("tiny").to_json())
  publish_index(workdir / "index", DocIndex(np.eye(2, 4, dtype=np.float32), np.arange(2)), 0,
                model_fingerprint="m", corpus_fingerprint="c")
  (workdir / "best" / "4").mkdir(parents=True)  # what a finished fine-tuning run leaves
  (workdir / "eval").write_text("")
  before = sorted(p.name for p in workdir.iterdir())
  got = forked_runs.run([sys.executable, os.path.join(root, "experiments", "evaluate.py"),
                        f"--workdir={workdir}"], cwd=root, capture_output=True, text=True,
                        timeout=120)
  assert got.returncode == 2 and got.stdout == "", got.stderr[-3000:]
  assert got.stderr.strip().splitlines() == [
      f"error: {workdir}/eval/test cannot be written (Not a directory); the predictions and "
      "results.json go there. Make it writable (or move away a file that stands where one of its "
      "folders should be), or evaluate a writable copy of the work directory."]
  assert sorted(p.name for p in workdir.iterdir()) == before  # no corpus built, nothing loaded


def test_a_writable_output_directory_is_made_and_left_empty(tmp_path):
  from realm_jax.eval.report import check_writable
  check_writable(str(tmp_path / "eval" / "test"))
  assert list((tmp_path / "eval" / "test").iterdir()) == []


def test_paired_differences_by_hand():
  """Two systems on four questions: recall@k from the rank of the first hit, EM from `correct`;
  the difference is the difference of the two systems' figures, and a system identical to the
  base differs by exactly nothing in every resample."""
  from realm_jax.eval import report
  per_question = {"a": (np.array([1.0, 0, 0, 1]), np.array([1, 3, 0, 2])),
                  "b": (np.array([0.0, 0, 1, 1]), np.array([2, 0, 0, 6])),
                  "recall_only": (None, np.array([1, 3, 0, 2]))}
  d = report.paired_differences(per_question, "a", ks=(1, 2, 5), samples=500)
  assert set(d) == {"b", "recall_only"}
  # a: recall@1 1/4, @2 2/4, @5 3/4; b: 0, 1/4, 1/4; EM both 2/4.
  assert [d["b"]["recall"][k][0] for k in (1, 2, 5)] == pytest.approx([-25.0, -25.0, -50.0])
  assert d["b"]["em"][0] == pytest.approx(0.0) and d["b"]["em"][1] < 0 < d["b"]["em"][2]
  assert d["recall_only"]["em"] is None
  assert all(d["recall_only"]["recall"][k] == (0.0, 0.0, 0.0) for k in (1, 2, 5))
  with pytest.raises(ValueError, match="--paired_with=c: it must be one of"):
    report.check_paired_with("c", ["a", "b"])
