"""The held-out report of a fine-tuned open-QA system, next to its baselines (experiments/evaluate.py).

Systems, all on the same questions and the same frozen index:
  finetuned        the fine-tuned question tower retrieves, the fine-tuned reader reads;
  dense_untuned    the question tower as it started (all-MiniLM-L6-v2 for the embedded corpus),
                   with the same fine-tuned reader: the dense retrieval baseline;
  bm25             BM25 (k1 0.9, b 0.4) over title + text retrieves, the same reader reads.
Each gets EM (regex match for CuratedTREC) and retriever recall@k; predictions are written as
JSONL (question, gold answers, answer, score, correct, evidence blocks with title and text span).
With `paired_with`, each system's difference from that one, question by question (paired
bootstrap intervals: the systems answer the same questions, so the differences are tighter
than the two standard errors suggest).
"""

from __future__ import annotations

import json
import logging
import math
import os

import numpy as np

from realm_jax import io_utils
from realm_jax.data.mixture import by_dataset
from realm_jax.eval.open_qa import evaluate_open_qa
from realm_jax.eval.stats import paired_bootstrap
from realm_jax.retrieval.bm25 import BM25Index, corpus_bm25

SYSTEMS = ("finetuned", "dense_untuned", "bm25")
BM25_DIR = "bm25"


def bm25_of(setup) -> BM25Index:
  """A BM25 index over the corpus rows (title + " " + body), saved in the workdir once and
  rebuilt when the corpus is another (its fingerprint is saved with it)."""
  return corpus_bm25(setup.corpus, os.path.join(setup.workdir, BM25_DIR),
                     lambda r: setup.batcher.block(r)["text"])


def write_jsonl(path: str, rows) -> None:
  text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
  io_utils.write_text(path, text)


def check_writable(out_dir: str) -> None:
  """Makes `out_dir` (local or gs://) and writes and deletes a file in it, so that an output
  directory that cannot be written fails before the evaluation, not after it.

  Raises:
    OSError naming the directory and what to do.
  """
  io_utils.check_writable(out_dir, "the predictions and results.json go there. Make it writable "
                          "(or move away a file that stands where one of its folders should be), "
                          "or evaluate a writable copy of the work directory.")


def check_systems(systems, recall_only=()) -> None:
  """ValueError naming the systems (--systems / --recall_only) that are not in SYSTEMS."""
  unknown = [s for s in list(systems) + list(recall_only) if s not in SYSTEMS]
  if unknown:
    raise ValueError(f"--systems / --recall_only: unknown {unknown}; use some of {SYSTEMS}.")


def parse_named(values, flag: str, what: str, example: str, taken=()) -> dict[str, str]:
  """{name: value} of `--<flag>=NAME=VALUE,...` (ValueError naming the flag): names unique and
  none of SYSTEMS or `taken` (the systems of another flag)."""
  out = {}
  for value in values:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
      raise ValueError(f"--{flag}={value!r}: give NAME={what}, e.g. {example}.")
    if name in SYSTEMS or name in out or name in taken:
      raise ValueError(f"--{flag}: the name {name!r} is taken: pick one that is not in "
                       f"{SYSTEMS}, not another system's and not given twice.")
    out[name] = path
  return out


def parse_retrievers(values) -> dict[str, str]:
  """{name: weights} of `--retrievers=name=DIR,...` (ValueError naming the flag)."""
  return parse_named(values, "retrievers", "WEIGHTS", "dpr=work/dpr_wiki_vital/export")


def parse_runs(values, retrievers=()) -> dict[str, str]:
  """{name: workdir} of `--runs=name=WORKDIR,...`: other fine-tuning runs' best models."""
  return parse_named(values, "runs", "WORKDIR", "nq_only=work/qa_wiki_vital", taken=retrievers)


def standard_error(percent: float, count: int) -> float:
  """The standard error, in points, of a percentage of `count` questions (binomial)."""
  p = percent / 100.0
  return 100.0 * math.sqrt(p * (1 - p) / count) if count else float("nan")


def evaluate_systems(setup, questions, systems=SYSTEMS, ks=(1, 5, 20), out_dir: str | None = None,
                     params=None, progress: bool = True, recall_only=(),
                     retrievers: dict[str, str] | None = None, paired_with: str = "",
                     bootstrap_samples: int = 10000, runs: dict | None = None) -> dict:
  """{system: {"em", "recall": {k: %}, "count", "seconds"}} on `questions`; predictions and a
  results.json go to `out_dir` when given (an `out_dir` that cannot be written fails first).
  `params`: the fine-tuned parameters (default: the best checkpoint of the workdir). Systems in
  `recall_only` are not read (em None): reading is what takes the time on a CPU. `retrievers`:
  {name: weights} of more systems, each another retriever (its question tower and an index of
  the same corpus it builds once) read by the same fine-tuned reader. `runs`: {name: workdir, or
  its parameters already read (`run_params`)} of more systems, each another fine-tuning run's
  best model (its question tower and its reader) over this index (finetune.check_comparable_run
  says whether it can be). `paired_with`: one of the systems; every other one gets `vs_<it>`
  (`paired_differences`)."""
  retrievers, runs = dict(retrievers or {}), dict(runs or {})
  extra = [*retrievers, *runs]
  check_systems(systems, [r for r in recall_only if r not in extra])
  check_paired_with(paired_with, [*systems, *extra])
  if out_dir:
    check_writable(out_dir)
  if params is None:
    params, meta = setup.best_params()
    logging.info("Fine-tuned model: %s", meta)
  runs = run_params(setup, runs)
  untuned = {"query_tower": setup.init_params["query_tower"], "reader": params["reader"]}
  results, per_question = {}, {}
  for name in [*systems, *extra]:
    if name in retrievers:
      system = setup.retriever_system(name, retrievers[name], params["reader"])
    elif name in runs:
      system = setup.system(runs[name])
    else:
      system = setup.system(untuned if name == "dense_untuned" else params)
    bm25 = bm25_of(setup) if name == "bm25" else None
    read = name not in recall_only
    got = evaluate_open_qa(system, questions, ks=ks, bm25=bm25, read=read, progress=progress)
    results[name] = {k: got[k] for k in ("em", "recall", "count", "seconds")}
    results[name]["em_se"] = None if got["em"] is None else standard_error(got["em"], got["count"])
    results[name]["recall_se"] = {k: standard_error(v, got["count"])
                                  for k, v in got["recall"].items()}
    if read:
      results[name]["errors"] = error_breakdown(got["predictions"])
    logging.info("%s: EM %s, recall %s (%d questions, %.0f s)", name, got["em"], got["recall"],
                 got["count"], got["seconds"])
    if out_dir and read:
      write_jsonl(os.path.join(out_dir, f"predictions-{name}.jsonl"), got["predictions"])
    per_question[name] = (None if not read else
                          np.array([p["correct"] for p in got["predictions"]], np.float64),
                          np.asarray(got["first_hit"]))
  if paired_with:
    for name, diffs in paired_differences(per_question, paired_with, ks,
                                          bootstrap_samples).items():
      results[name][f"vs_{paired_with}"] = diffs
  if out_dir:
    io_utils.write_json(os.path.join(out_dir, "results.json"), results)
  return results


def error_breakdown(predictions) -> dict:
  """Where a read system's errors are: of the questions, how many have an answer in the blocks
  read (`answer_in_read`), how many of those the reader can select (`answer_readable`: a span of
  its input, not past the block's cut), and how many of those it answers right; counts and
  percentages (`right_when_readable` of the readable ones, None when there are none)."""
  n = len(predictions)
  in_read = sum(bool(p["answer_in_read"]) for p in predictions)
  readable = [p for p in predictions if p["answer_readable"]]
  right = sum(bool(p["correct"]) for p in readable)
  pct = lambda a, b: 100.0 * a / b if b else None
  return {"questions": n, "answer_in_read": in_read, "answer_readable": len(readable),
          "right_when_readable": right, "in_read_percent": pct(in_read, n),
          "readable_percent": pct(len(readable), n),
          "right_when_readable_percent": pct(right, len(readable))}


def run_params(setup, runs: dict) -> dict:
  """{name: parameters} of `runs` ({name: a work directory's kept model, or its parameters
  already read})."""
  out = {}
  for name, run in runs.items():
    if isinstance(run, str):
      run, meta = setup.best_params(run)
      logging.info("%s: the fine-tuned model of %s: %s", name, runs[name], meta)
    out[name] = run
  return out


def evaluate_by_dataset(setup, questions, systems=SYSTEMS, ks=(1, 5, 20),
                        out_dir: str | None = None, params=None, runs=None,
                        **kwargs) -> dict[str, dict]:
  """{dataset: `evaluate_systems` on its questions} for questions of one dataset or of several
  (their "dataset"), each dataset's predictions and results.json in out_dir/<dataset> when there
  are several, in out_dir itself when there is one."""
  groups = by_dataset(questions)
  if params is None:
    params, meta = setup.best_params()
    logging.info("Fine-tuned model: %s", meta)
  runs = run_params(setup, runs or {})  # read once, not once per dataset
  out = {}
  for name, rows in groups.items():
    where = out_dir and (os.path.join(out_dir, name) if len(groups) > 1 else out_dir)
    out[name] = evaluate_systems(setup, [questions[i] for i in rows], systems, ks, where,
                                 params=params, runs=runs, **kwargs)
  return out


def check_paired_with(paired_with: str, systems) -> None:
  if paired_with and paired_with not in systems:
    raise ValueError(f"--paired_with={paired_with}: it must be one of the systems evaluated "
                     f"({', '.join(systems)}).")


def paired_differences(per_question: dict, base: str, ks=(1, 5, 20), samples: int = 10000,
                       seed: int = 0) -> dict:
  """{system: {"em": (difference, low, high) or None, "recall": {k: (...)}}}: each system minus
  `base` in points, over the same questions, with 95% paired bootstrap intervals.
  `per_question`: {system: (correct [N] or None when not read, first_hit [N])}."""
  base_correct, base_first = per_question[base]
  ones = np.ones(len(base_first))
  hits = lambda first, k: ((first > 0) & (first <= k)).astype(np.float64)
  points = lambda d: tuple(100.0 * x for x in d)
  out = {}
  for name, (correct, first) in per_question.items():
    if name == base:
      continue
    em = None
    if correct is not None and base_correct is not None:
      em = points(paired_bootstrap(correct, ones, base_correct, ones, samples, seed))
    out[name] = {"em": em, "recall": {k: points(paired_bootstrap(
        hits(first, k), ones, hits(base_first, k), ones, samples, seed)) for k in ks}}
  return out


def format_table(results: dict, ks=(1, 5, 20)) -> str:
  """A markdown table: system, EM, recall@k, each with its standard error when known."""
  head = "| system | questions | EM | " + " | ".join(f"R@{k}" for k in ks) + " |"
  lines = [head, "|" + "---|" * (3 + len(ks))]
  se = lambda value, err: f"{value:.1f}" if err is None else f"{value:.1f} ± {err:.1f}"
  for name, r in results.items():
    errors = r.get("recall_se") or {}
    recall = " | ".join(se(r["recall"][k], errors.get(k)) for k in ks)
    em = "-" if r["em"] is None else se(r["em"], r.get("em_se"))
    lines.append(f"| {name} | {r['count']} | {em} | {recall} |")
  errors = [(name, r["errors"]) for name, r in results.items() if r.get("errors")]
  if errors:
    pc = lambda v: "-" if v is None else f"{v:.1f}%"
    lines += ["", "| system | answer in the blocks read | readable there (not past the cut) | "
              "reader right when readable |", "|---|---|---|---|"]
    for name, e in errors:
      lines.append(f"| {name} | {e['answer_in_read']} ({pc(e['in_read_percent'])}) | "
                   f"{e['answer_readable']} ({pc(e['readable_percent'])}) | "
                   f"{e['right_when_readable']} ({pc(e['right_when_readable_percent'])}) |")
  paired = [(name, key.removeprefix("vs_"), r[key]) for name, r in results.items()
            for key in r if key.startswith("vs_")]
  if paired:
    ci = lambda d: "-" if d is None else f"{d[0]:+.1f} [{d[1]:+.1f}, {d[2]:+.1f}]"
    lines += ["", "| system | minus | EM | " + " | ".join(f"R@{k}" for k in ks) + " |",
              "|" + "---|" * (3 + len(ks))]
    for name, base, d in paired:
      recall = " | ".join(ci(d["recall"][k]) for k in ks)
      lines.append(f"| {name} | {base} | {ci(d['em'])} | {recall} |")
  return "\n".join(lines)
