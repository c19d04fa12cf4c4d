"""experiments/ask.py, realm_jax/eval/ask.py and the Colab notebook on one tiny fine-tuning run
(40 articles, NQ-Open questions from ../shared): the evidence shown is the system's own retrieval
(checked against a brute-force search of the index table), the JSON is the prediction, user
mistakes end in one `error:` line with status 2, and the notebook answers and plots."""

import glob
import io
import json
import os
import re
import shutil
import sys

import numpy as np
import pytest
import forked_runs
from conftest import NQ_OPEN as NQ
from conftest import damaged_best_copy, one_device_env

from realm_jax.eval import ask
from realm_jax.systems import open_qa

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "experiments", "colab", "realm_jax_demo.ipynb")
QUESTION = "who wrote the origin of species"
# Every test here reads the tiny fine-tuning run of conftest.tiny_qa_workdir (~35 s to make).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workdir(tiny_qa_workdir):
  return tiny_qa_workdir


@pytest.fixture(scope="module")
def system(workdir):
  return ask.load_system(workdir)[0]


def run_ask(*args):
  """experiments/ask.py as a user runs it: one device, no test flags."""
  return forked_runs.run([sys.executable, os.path.join(ROOT, "experiments", "ask.py"), *args],
                         capture_output=True, text=True, env=one_device_env(),
                         cwd=ROOT, timeout=300)


def read_titles(system, question):
  """Titles of the blocks read for `question`, by a brute-force search of the index table."""
  scores = system.table @ system.embed([question])[0]                         # [N]
  rows = np.argsort(-scores, kind="stable")[:system.reader_blocks]
  return [system.corpus[int(r)]["title"] for r in rows], system.models.score_scale * scores[rows]


def test_a_loaded_system_answers_without_compiling(system):
  """The seconds ask.py prints are the answer's, not XLA's: loading compiles the one program there
  is (every question padded to one length), so questions of other lengths afterwards trace and
  compile nothing (counted by jax's own compile events, not timed). First in the module: nothing
  but the load has run on `system` yet."""
  import jax
  events = []
  listener = lambda event, duration, **kwargs: events.append(event)
  compiles = lambda: [e for e in events if e.startswith("/jax/core/compile/")]
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    for question in ("who", QUESTION + " and in which year was it first printed in london"):
      ask.answer_one(system, question)
    answering = compiles()
    jax.jit(lambda x: x + 1)(np.float32(len(events)))  # (the events are seen: a new program)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert not answering, answering
  assert compiles()


def test_ask_prints_the_answer_and_the_retrieved_evidence(workdir, system):
  got = run_ask(f"--workdir={workdir}", f"--question={QUESTION}")
  assert got.returncode == 0, got.stderr
  titles, _ = read_titles(system, QUESTION)
  shown = re.findall(r"^ [ *] ?\d+\. (.+?)    \(retrieval", got.stdout, flags=re.M)
  assert shown == titles
  expected = system.answer([QUESTION])[0]
  answer, score, seconds = re.search(r"^A: (.*)    \(score (-?[\d.]+), .*, ([\d.]+) s\)$",
                                     got.stdout, flags=re.M).groups()
  assert answer == (expected["answer"] or "(no answer)")
  np.testing.assert_allclose(float(score), expected["score"], atol=0.01)
  assert float(seconds) >= 0.0  # (how fast: test_a_loaded_system_answers_without_compiling)
  # The answer's block is the one marked.
  assert re.findall(r"^ \* ?(\d+)\. ", got.stdout, flags=re.M) == [str(expected["block_rank"] + 1)]


def test_ask_json_is_the_prediction(workdir, system):
  got = run_ask(f"--workdir={workdir}", f"--question={QUESTION}", "--json", "--top_k=1")
  assert got.returncode == 0, got.stderr
  lines = got.stdout.splitlines()
  assert len(lines) == 1
  pred = json.loads(lines[0])
  titles, logits = read_titles(system, QUESTION)
  assert [e["title"] for e in pred["evidence"]] == titles[:1]
  np.testing.assert_allclose(pred["evidence"][0]["retrieval_score"], logits[0], rtol=1e-4)
  expected = system.answer([QUESTION])[0]
  assert pred["answer"] == expected["answer"] and pred["block_id"] == expected["block_id"]
  np.testing.assert_allclose(pred["score"], expected["score"], rtol=1e-4)
  assert pred["seconds"] > 0  # (how fast: test_a_loaded_system_answers_without_compiling)
  if pred["answer"]:  # the answer is cut from its block's own text
    row = int(system.corpus.rows_of(np.array([pred["block_id"]]))[0])
    block = system.corpus[row]
    assert pred["answer"] in block["title"] + " " + block["body"]


CASES = {"empty_question": "empty", "long_question": "10,000 characters",
         "no_config": "config.json does not exist", "no_index": "No index",
         "corrupt_index": "manifest.json is corrupt: not valid JSON (Expecting value: line 1, "
                          "column 1)",
         "no_model": "no fine-tuned model", "no_question": "--interactive",
         "bad_top_k": "--top_k=0"}


def mistake(case, workdir, tmp_path):
  """(ask.py arguments, expected message) of a user mistake."""
  question = {"empty_question": "  ", "long_question": "x" * 10_000}.get(case, QUESTION)
  where = workdir
  if case in ("no_config", "no_index", "corrupt_index", "no_model"):
    where = str(tmp_path / "w")
    if case == "no_model":  # everything but the fine-tuned model
      shutil.copytree(workdir, where, ignore=shutil.ignore_patterns(open_qa.BEST, "checkpoints"))
    else:
      os.makedirs(where)
      if case in ("no_index", "corrupt_index"):
        shutil.copy(os.path.join(workdir, "config.json"), where)
      if case == "corrupt_index":  # its one index damaged, which was reported as missing
        shutil.copytree(os.path.join(workdir, "index"), os.path.join(where, "index"))
        for manifest in glob.glob(os.path.join(where, "index", "index-*", "manifest.json")):
          with open(manifest, "w") as f:
            f.write("#" * 100)
  kwargs = dict(workdir=where, question=None if case == "no_question" else question,
                top_k=0 if case == "bad_top_k" else None)
  return kwargs, CASES[case]


@pytest.mark.parametrize("case", sorted(CASES))
def test_user_mistakes_are_clear_errors(workdir, tmp_path, case):
  """Each mistake is a ValueError / FileNotFoundError naming what to fix, raised before any
  model is loaded (the ask command turns these into one `error:` line, below)."""
  kwargs, message = mistake(case, workdir, tmp_path)
  with pytest.raises((ValueError, FileNotFoundError), match=re.escape(message)):
    ask.run(**kwargs)


@pytest.mark.parametrize("case", ["long_question", "no_index"])
def test_user_mistakes_end_in_one_error_line(workdir, tmp_path, case):
  """experiments/ask.py as a user runs it: one `error:` line on stderr, status 2, no traceback."""
  kwargs, message = mistake(case, workdir, tmp_path)
  args = [f"--workdir={kwargs['workdir']}", f"--question={kwargs['question']}"]
  got = run_ask(*args)
  assert got.returncode == 2, (got.stdout, got.stderr)
  assert got.stderr.startswith("error: ") and "Traceback" not in got.stderr, got.stderr
  assert len(got.stderr.strip().splitlines()) == 1 and got.stdout == ""
  assert message in got.stderr


def test_interactive_loop_answers_and_goes_on_after_an_error(system):
  out, err = io.StringIO(), io.StringIO()
  lines = io.StringIO(f"{QUESTION}\n\n  what is the capital of france \nquit\nnever asked\n")
  assert ask.ask_loop(system, lines, out, err) == 2
  asked = re.findall(r"^(?:question> )*Q: (.*)$", out.getvalue(), flags=re.M)
  assert asked == [QUESTION, "what is the capital of france"]
  assert out.getvalue().count(ask.PROMPT) == 4  # stopped at "quit"
  assert re.fullmatch(r"error: The question is empty[^\n]*\n", err.getvalue())
  # As JSON lines: stdout holds only predictions; EOF ends the loop.
  out, err = io.StringIO(), io.StringIO()
  assert ask.ask_loop(system, io.StringIO(QUESTION), out, err, as_json=True, top_k=1) == 1
  pred = json.loads(out.getvalue())
  assert pred["question"] == QUESTION and len(pred["evidence"]) == 1


def test_non_finite_scores_are_never_answers(workdir, system):
  """Damaged index embeddings (here: infinite) gave the answer score inf, printed as an answer.
  The question is refused instead, naming the index; the interactive loop reports that as an
  error line."""
  from realm_jax.retrieval.index_store import latest_index_dir
  damaged = open_qa.OpenQa(system.batcher, system.models, system.params, system.index,
                           np.full_like(system.table, np.inf), reader_blocks=system.reader_blocks,
                           batch_size=system.batch_size)
  with pytest.raises(ValueError, match=(
      rf"No answer to '{QUESTION}': the retrieval scores of its blocks are not finite .*The index "
      rf"{re.escape(latest_index_dir(os.path.join(workdir, 'index')))} holds damaged "
      "embeddings")):
    damaged.answer([QUESTION])
  out, err = io.StringIO(), io.StringIO()
  assert ask.ask_loop(damaged, io.StringIO(f"{QUESTION}\n"), out, err) == 0
  assert "A:" not in out.getvalue() and err.getvalue().startswith("error: No answer to")


def test_notebook_fine_tunes_answers_and_plots(workdir, system, tiny_reader, tmp_path, monkeypatch):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
  assert len(params) == 1
  # A copy of the finished run: the notebook's fine-tuning resumes it (nothing left to do).
  copy = str(tmp_path / "qa")
  shutil.copytree(workdir, copy)
  params[0].source = "\n".join([
      'variant = "tiny"', f"workdir = {copy!r}", f"questions_dir = {NQ!r}", "num_steps = 2",
      "retriever_steps = None", f"questions = [{QUESTION!r}]",
      'plot_question = "who painted the mona lisa"', "plot_top_k = 5", "num_eval = 8"])
  # The shared run's reader (conftest.tiny_reader), which the tiny config does not name.
  (tune,) = [c for c in nb.cells if "best = finetune.finetune(config, workdir)" in c.source]
  tune.source = tune.source.replace("best = finetune.finetune(", f"config.reader_weights = "
                                    f"{tiny_reader!r}\nbest = finetune.finetune(")
  monkeypatch.setenv("XLA_FLAGS", one_device_env()["XLA_FLAGS"])  # one device, like Colab's
  nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}}).execute()
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                 for o in c.outputs if o.output_type == "stream")
  shown = re.search(rf"^Q: {re.escape(QUESTION)}\nA: .+\(score .*\nEvidence:\n((?:.*\n)+?)\n", text,
                    flags=re.M)
  assert shown, text
  titles = re.findall(r"^ [ *] ?\d+\. (.+?)    \(retrieval", shown.group(1), flags=re.M)
  assert titles == read_titles(system, QUESTION)[0]
  assert re.search(r"^8 held-out questions: EM [\d.]+%, recall@1 [\d.]+%", text, flags=re.M), text
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "image/png" in o.get("data", {})]
  assert len(images) == 1


def test_a_damaged_model_ends_in_one_error_line(workdir, tmp_path):
  """A data file of the kept model deleted: one `error:` line naming best/ and what to do, status
  2, no orbax traceback; nothing in the work directory is changed (ask only reads)."""
  where, step = damaged_best_copy(workdir, tmp_path)
  got = run_ask(f"--workdir={where}", f"--question={QUESTION}")
  assert got.returncode == 2, (got.stdout, got.stderr)
  errors = [line for line in got.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and "Traceback" not in got.stderr and got.stdout == "", got.stderr
  assert f"No checkpoint in {where}/{open_qa.BEST} can be read (step {step.name}: " in errors[0]
  assert "Nothing was changed. Restore" in errors[0] and "another --workdir" in errors[0]
  assert step.is_dir() and not (where / f"{open_qa.BEST}-damaged").exists()
