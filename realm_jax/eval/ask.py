"""Asking a fine-tuned open-QA system questions: loading it, answering, showing the evidence.

    system, meta = load_system("work/qa_wiki_vital")    # the best checkpoint, warmed up
    pred, seconds = answer_one(system, "who wrote the origin of species")
    print(format_prediction(pred, seconds))
    ask_loop(system, sys.stdin, sys.stdout, sys.stderr)  # "question> " until EOF / quit / exit

`run` is experiments/ask.py without its flags. Everything but the loading is text in, text out,
so it is tested without a terminal.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TextIO

from realm_jax.data.qa_batches import check_question  # noqa: F401  (checked before loading)

PROMPT = "question> "
QUIT = ("quit", "exit")
WARM_UP_QUESTION = "who wrote the first dictionary of the english language"


def load_system(workdir: str):
  """(OpenQa, meta) of the best fine-tuned model in `workdir`, its jitted functions compiled.

  Raises FileNotFoundError (with what to run) when `workdir` has no config.json, no index or no
  fine-tuned model; the index is never built here. A damaged model (files of best/ missing or
  unreadable) is a ValueError naming best/ and what to do, or, when an older kept model reads,
  that one with a warning; nothing in `workdir` is changed.
  """
  from realm_jax.systems.open_qa import QaSetup, check_best, check_index, load_workdir_config
  config = load_workdir_config(workdir)
  check_index(workdir)  # both before the seconds of loading the corpus, the index and the models
  check_best(workdir)
  # One question at a time: a batch of one reads only its own blocks, not a padded batch's.
  config.eval_batch_size = 1
  setup = QaSetup(config, workdir, build_missing=False)
  params, meta = setup.best_params()
  # Every question and reader input padded to its full length: one shape, so the warm-up compiles
  # the only program there is (a shape per length bucket would recompile for seconds on CPU).
  setup.batcher.question_multiple = config.question_length
  setup.batcher.length_multiple = config.reader_length
  system = setup.system(params)
  system.answer([WARM_UP_QUESTION])
  return system, meta


def answer_one(system, question: str, top_k: int | None = None) -> tuple[dict, float]:
  """(prediction, seconds) for one question, its evidence cut to the first `top_k` blocks; a
  ValueError, never an answer, when its scores are not finite (a damaged index or checkpoint)."""
  question = check_question(question)
  start = time.perf_counter()
  pred = system.answer([question])[0]
  seconds = time.perf_counter() - start
  if top_k is not None:
    pred["evidence"] = pred["evidence"][:top_k]
  return pred, seconds


def format_prediction(pred: dict, seconds: float | None = None) -> str:
  """A prediction of `OpenQa.answer` as text: the answer, its score, then one entry per evidence
  block (rank, title, retrieval score, best span, context); `*` marks the answer's block."""
  took = f", {seconds:.2f} s" if seconds is not None else ""
  answer = pred["answer"] or "(no answer)"
  lines = [f"Q: {pred['question']}",
           f"A: {answer}    (score {pred['score']:.2f}, from block rank "
           f"{pred['block_rank'] + 1}{took})"]
  if pred["evidence"]:
    lines.append("Evidence:")
  for rank, ev in enumerate(pred["evidence"], 1):
    mark = "*" if ev["block_id"] == pred["block_id"] else " "
    lines.append(f" {mark}{rank:>2}. {ev['title']}    (retrieval {ev['retrieval_score']:.2f}, "
                 f"best span {ev['best_span']!r} {ev['best_span_score']:.2f})")
    lines.append(f"       {' '.join(ev['context'].split())}")
  return "\n".join(lines)


def prediction_json(pred: dict, seconds: float | None = None) -> str:
  """A prediction as one JSON line, with the seconds it took."""
  return json.dumps({**pred, "seconds": seconds}, ensure_ascii=False)


def ask_loop(system, lines: TextIO, out: TextIO, err: TextIO, *, top_k: int | None = None,
             as_json: bool = False, prompt: str = PROMPT) -> int:
  """Answers the questions of `lines`, one a line, until EOF or "quit" / "exit".

  Prompts on `out` (on `err` with as_json, so that `out` holds only JSON lines). A question that
  cannot be asked (empty, too long) or answered (non-finite scores) is reported as `error: ...`
  on `err` and the loop goes on.

  Returns:
    The number of questions answered.
  """
  shown = err if as_json else out
  answered = 0
  while True:
    shown.write(prompt)
    shown.flush()
    line = lines.readline()
    if not line:  # EOF
      shown.write("\n")
      return answered
    if line.strip().lower() in QUIT:
      return answered
    try:
      pred, seconds = answer_one(system, line, top_k)
    except ValueError as e:
      err.write(f"error: {e}\n")
      err.flush()
      continue
    out.write((prediction_json(pred, seconds) if as_json else format_prediction(pred, seconds))
              + "\n")
    out.flush()
    answered += 1


def run(workdir: str, question: str | None = None, interactive: bool = False,
        top_k: int | None = None, as_json: bool = False, stdin: TextIO | None = None,
        out: TextIO | None = None, err: TextIO | None = None) -> None:
  """experiments/ask.py: answers `question`, or the lines of `stdin` when interactive.

  Raises ValueError / FileNotFoundError for what the user can fix (flags, question, workdir),
  before loading the model when the flags alone show it. The streams default to sys's.
  """
  stdin, out, err = stdin or sys.stdin, out or sys.stdout, err or sys.stderr
  if not workdir:
    raise ValueError("--workdir is required: the work directory of experiments/finetune.py.")
  if (question is None) == (not interactive):
    raise ValueError("Pass either --question=\"...\" or --interactive.")
  if top_k is not None and top_k < 1:
    raise ValueError(f"--top_k={top_k}: show at least 1 block.")
  if question is not None:
    question = check_question(question)
  start = time.perf_counter()
  system, meta = load_system(workdir)
  print(f"Loaded the model of step {meta.get('step')} from {workdir} in "
        f"{time.perf_counter() - start:.1f} s.", file=err)
  if interactive:
    ask_loop(system, stdin, out, err, top_k=top_k, as_json=as_json)
    return
  pred, seconds = answer_one(system, question, top_k)
  print(prediction_json(pred, seconds) if as_json else format_prediction(pred, seconds), file=out)
