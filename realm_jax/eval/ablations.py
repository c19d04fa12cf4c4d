"""REALM's ablations at small scale: pre-training variants as config overrides, open-QA fine-tuning
from the chosen ones and from MiniLM, and one table with paired bootstrap intervals.

    run(config, workdir, pretrain=..., finetune=...)   # configs/ablations.py; the trainers are
                                                       # passed in by experiments/ablations.py

`workdir/`:
  pretrain-data/         the corpus and salient-span examples every variant reads
  pretrain-<variant>/    one pre-training work directory per variant (its held-out figures per
                         sentence in eval/heldout-SSSSSSSS.json, its export in export/)
  finetune-<variant>/    fine-tuning from that export (finetune-minilm: from MiniLM), and its
                         held-out test predictions in eval/test/
  runs.json              the wall time of every stage that ran
  ablations.json, ablations.md   the table
Every stage resumes or is skipped when done, so the runner can be stopped and started again.

Pre-training figures are the last held-out evaluation's (the same sentences and masked salient
spans for every variant: the masking variants change training only). Differences from "default"
are paired: the same sentences (or questions) resampled together (`paired_bootstrap`).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from collections.abc import Callable

import ml_collections
import numpy as np

from realm_jax import io_utils
from realm_jax.checkpoints.export import pretraining_exports
from realm_jax.configs.ablations import ABLATIONS, MINILM
from realm_jax.eval import report
from realm_jax.eval.stats import paired_bootstrap, ratio_se
from realm_jax.systems import open_qa

SYSTEM = "finetuned"   # the fine-tuned retriever and reader (eval/report.py)


def check_config(config) -> None:
  """Refuses unknown variants and a table without its "default" row, before any work."""
  unknown = [v for v in config.variants if v not in ABLATIONS]
  if unknown:
    raise ValueError(f"--config.variants: unknown {unknown}; use some of {tuple(ABLATIONS)}.")
  if "default" not in config.variants:
    raise ValueError("--config.variants must include 'default': every difference is taken from it.")
  bad = [v for v in config.finetune_variants if v != MINILM and v not in config.variants]
  if bad:
    raise ValueError(f"--config.finetune_variants: {bad} are not pre-trained here; use "
                     f"{MINILM!r} or some of --config.variants={tuple(config.variants)}.")
  if config.bootstrap_samples < 1:
    raise ValueError(f"--config.bootstrap_samples={config.bootstrap_samples}: must be >= 1.")


def pretrain_config(config, variant: str, workdir: str) -> ml_collections.ConfigDict:
  """The pre-training config of `variant`: config.pretrain with the variant's overrides, reading
  the corpus and examples that all variants share."""
  c = copy.deepcopy(config.pretrain)
  c.data_dir = c.data_dir or os.path.join(workdir, "pretrain-data")
  c.update_from_flattened_dict(ABLATIONS[variant])
  return c


def finetune_config(config, variant: str, workdir: str) -> ml_collections.ConfigDict:
  """config.finetune, starting from the pre-training work directory of `variant` (MiniLM: as
  the config says)."""
  c = copy.deepcopy(config.finetune)
  if variant != MINILM:
    c.init = os.path.join(workdir, f"pretrain-{variant}")
  return c


# ---------------------------------------------------------------------------------- the runs
def last_heldout(pretrain_dir: str) -> dict:
  """The per-sentence figures of a pre-training run's last held-out evaluation."""
  directory = io_utils.as_path(os.path.join(pretrain_dir, "eval"))
  files = sorted(directory.glob("heldout-*.json")) if directory.is_dir() else []
  if not files:
    raise FileNotFoundError(f"{pretrain_dir}/eval has no heldout-*.json: the run has not been "
                            "evaluated (config.eval_every = 0?).")
  return io_utils.read_json(str(files[-1]))


def _finished(pretrain_dir: str) -> bool:
  """Whether a pre-training run has ended (it exports when it does)."""
  return all(io_utils.as_path(os.path.join(d, "config.json")).exists()
             for d in pretraining_exports(pretrain_dir).values())


def read_predictions(finetune_dir: str) -> list[dict]:
  path = os.path.join(finetune_dir, "eval", "test", f"predictions-{SYSTEM}.jsonl")
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def _timed(times: dict, stage: str, times_path: str, fn: Callable[[], object]) -> None:
  """Runs a stage (it resumes, or returns at once when done); the first run that finishes it
  records its wall time (a stage stopped and resumed records the last part only)."""
  start = time.perf_counter()
  fn()
  if stage not in times:
    times[stage] = round(time.perf_counter() - start, 1)
    io_utils.write_json(times_path, times)


def evaluate_test(config, finetune_dir: str) -> None:
  """EM and recall@k of the fine-tuned system on the held-out test questions (once)."""
  out_dir = os.path.join(finetune_dir, "eval", "test")
  if io_utils.as_path(os.path.join(out_dir, "results.json")).exists():
    return
  questions = open_qa.split_questions(config)["test"]
  setup = open_qa.QaSetup(config, finetune_dir, build_missing=False)
  report.evaluate_systems(setup, questions, (SYSTEM,), tuple(config.ks), out_dir)


def _read_times(workdir: str) -> dict:
  path = os.path.join(workdir, "runs.json")
  return io_utils.read_json(path) if io_utils.as_path(path).exists() else {}


def write_table(config, workdir: str) -> dict:
  """ablations.json and ablations.md from the stages that have finished (the others are left
  out), so that a table is there while the runner goes on, or after it was stopped."""
  table = make_table(config, workdir, _read_times(workdir))
  io_utils.write_json(os.path.join(workdir, "ablations.json"), table)
  io_utils.write_text(os.path.join(workdir, "ablations.md"), format_markdown(table))
  return table


def run(config, workdir: str, *, pretrain: Callable, finetune: Callable) -> dict:
  """Pre-trains every variant, fine-tunes and evaluates the chosen ones, and writes the table
  after each stage (`write_table`).

  `pretrain(config, workdir)` and `finetune(config, workdir)`: the trainers' entry functions
  (realm_jax/train/pretrain.py: train_and_evaluate, realm_jax/train/finetune.py: finetune).
  """
  check_config(config)
  io_utils.as_path(workdir).mkdir(parents=True, exist_ok=True)
  times_path = os.path.join(workdir, "runs.json")
  times = _read_times(workdir)

  def pretrain_variant(v):
    logging.info("Pre-training variant %s", v)
    _timed(times, f"pretrain-{v}", times_path,
           lambda: pretrain(pretrain_config(config, v, workdir),
                            os.path.join(workdir, f"pretrain-{v}")))
    write_table(config, workdir)

  # The variants that are fine-tuned go first, then their fine-tuning: the open-QA comparison is
  # there before the other variants' runs.
  fine_tuned = [v for v in config.variants if v in config.finetune_variants]
  for v in fine_tuned:
    pretrain_variant(v)
  for v in config.finetune_variants:
    logging.info("Fine-tuning from %s", v)
    ft, ft_dir = finetune_config(config, v, workdir), os.path.join(workdir, f"finetune-{v}")
    _timed(times, f"finetune-{v}", times_path, lambda: finetune(ft, ft_dir))
    _timed(times, f"evaluate-{v}", times_path, lambda: evaluate_test(open_qa.apply_init(ft), ft_dir))
    write_table(config, workdir)
  for v in config.variants:
    if v not in fine_tuned:
      pretrain_variant(v)
  return write_table(config, workdir)


# --------------------------------------------------------------------------------- the table
def _pretrain_rows(config, workdir: str) -> dict:
  rows, base = {}, None
  for v in config.variants:
    if not _finished(os.path.join(workdir, f"pretrain-{v}")):
      continue
    h = last_heldout(os.path.join(workdir, f"pretrain-{v}"))
    tokens = np.asarray(h["tokens"])
    row = {"step": h["step"], "sentences": len(tokens),
           "accuracy": float(np.sum(h["correct"]) / tokens.sum()),
           "accuracy_se": ratio_se(h["correct"], tokens)[1],
           "null_accuracy": float(np.sum(h["null_correct"]) / tokens.sum()),
           "utility": float(np.sum(h["utility"]) / tokens.sum()),
           "utility_se": ratio_se(h["utility"], tokens)[1],
           "span_in_candidates": float(np.mean(h["span_found"]))}
    if v == "default":
      base = h
    rows[v] = (row, h)
  for v, (row, h) in rows.items():
    if v == "default" or base is None:
      continue
    if h["block_id"] != base["block_id"]:
      row["paired"] = False  # other sentences (another corpus or eval setting): not paired
      continue
    for name in ("correct", "utility"):
      d = paired_bootstrap(h[name], h["tokens"], base[name], base["tokens"],
                           config.bootstrap_samples, config.seed)
      row[f"{'accuracy' if name == 'correct' else 'utility'}_vs_default"] = d
  return {v: row for v, (row, _) in rows.items()}


def _finetune_rows(config, workdir: str) -> dict:
  rows, preds = {}, {}
  for v in config.finetune_variants:
    if not io_utils.as_path(os.path.join(workdir, f"finetune-{v}", "eval", "test",
                                         "results.json")).exists():
      continue
    p = read_predictions(os.path.join(workdir, f"finetune-{v}"))
    ones = np.ones(len(p))
    correct = np.array([q["correct"] for q in p], np.float64)
    at5 = np.array([0 < q.get("first_hit", 0) <= 5 for q in p], np.float64)
    in_read = np.array([q["answer_in_read"] for q in p], np.float64)
    rows[v] = {"questions": len(p), "em": 100 * correct.mean(),
               "em_se": 100 * ratio_se(correct, ones)[1],
               "recall_5": 100 * at5.mean(), "recall_5_se": 100 * ratio_se(at5, ones)[1],
               "answer_in_read": 100 * in_read.mean(),
               # the reader alone: EM over the questions whose answer it was given
               "em_when_in_read": 100 * float(correct[in_read > 0].mean()) if in_read.any()
                                  else float("nan")}
    preds[v] = (p, correct, at5)
  base = MINILM if MINILM in preds else None
  for v, (p, correct, at5) in preds.items():
    if base is None or v == base:
      continue
    if [q["question"] for q in p] != [q["question"] for q in preds[base][0]]:
      rows[v]["paired"] = False
      continue
    ones = np.ones(len(p))
    for name, mine, theirs in (("em", correct, preds[base][1]), ("recall_5", at5, preds[base][2])):
      d = paired_bootstrap(mine, ones, theirs, ones, config.bootstrap_samples, config.seed)
      rows[v][f"{name}_vs_{base}"] = tuple(100 * x for x in d)
  return rows


def make_table(config, workdir: str, times: dict | None = None) -> dict:
  return {"pretrain": _pretrain_rows(config, workdir),
          "finetune": _finetune_rows(config, workdir) if config.finetune_variants else {},
          "seconds": dict(times or {}), "bootstrap_samples": config.bootstrap_samples}


def _ci(d) -> str:
  return "-" if d is None else f"{d[0]:+.2f} [{d[1]:+.2f}, {d[2]:+.2f}]"


def format_markdown(table: dict) -> str:
  """The table as markdown: pre-training (held-out sentences, %) and open QA (held-out test, %),
  each difference with its 95% paired bootstrap interval."""
  pct = lambda x: 100 * x
  lines = ["| pre-training variant | step | held-out accuracy | vs default | null-doc accuracy | "
           "utility | vs default | span in candidates | minutes |",
           "|---|---|---|---|---|---|---|---|---|"]
  for v, r in table["pretrain"].items():
    acc_d = r.get("accuracy_vs_default")
    util_d = r.get("utility_vs_default")
    minutes = table["seconds"].get(f"pretrain-{v}")
    lines.append(
        f"| {v} | {r['step']} | {pct(r['accuracy']):.2f} ± {pct(r['accuracy_se']):.2f} | "
        f"{_ci(acc_d and [pct(x) for x in acc_d])} | {pct(r['null_accuracy']):.2f} | "
        f"{r['utility']:.3f} ± {r['utility_se']:.3f} | {_ci(util_d)} | "
        f"{pct(r['span_in_candidates']):.1f} | "
        f"{'-' if minutes is None else f'{minutes / 60:.1f}'} |")
  if table["finetune"]:
    lines += ["", "| fine-tuned from | test questions | EM | vs minilm | R@5 | vs minilm | "
              "answer in read | EM when in read | minutes |", "|---|---|---|---|---|---|---|---|---|"]
    for v, r in table["finetune"].items():
      minutes = table["seconds"].get(f"finetune-{v}")
      lines.append(
          f"| {v} | {r['questions']} | {r['em']:.1f} ± {r['em_se']:.1f} | "
          f"{_ci(r.get(f'em_vs_{MINILM}'))} | {r['recall_5']:.1f} ± {r['recall_5_se']:.1f} | "
          f"{_ci(r.get(f'recall_5_vs_{MINILM}'))} | {r['answer_in_read']:.1f} | "
          f"{r['em_when_in_read']:.1f} | {'-' if minutes is None else f'{minutes / 60:.1f}'} |")
  return "\n".join(lines) + "\n"
