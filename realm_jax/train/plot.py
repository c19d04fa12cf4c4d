"""Training curves from a run's `metrics.jsonl` as a PNG (matplotlib, from the `demo` extra), for
each kind of run that writes one: REALM pre-training, fine-tuning, ICT and DPR, RETRO."""

from __future__ import annotations

import os
import re

from realm_jax.io_utils import as_path, iter_jsonl, save_figure

# Each kind of run: a metric only it logs, and its panels (metric, title) in order. The train
# split is drawn thin, the evaluation split ("heldout" or "dev") with dots.
RUNS = (
    ("pre-training", "retrieval_entropy", (
        ("loss", "marginal MLM loss"), ("accuracy", "masked-token accuracy"),
        ("retrieval_utility", "retrieval utility (nats/token)"),
        ("retrieval_entropy", "entropy of p(z|x)"),
        ("span_in_candidates", "masked span in a retrieved block"),
        ("found_accuracy", "accuracy where the span was retrieved"))),
    ("fine-tuning", "reader_loss", (
        ("loss", "retriever + reader loss"), ("answer_in_beam", "answer in the beam"),
        ("answer_in_read", "answer in the blocks read"),
        ("reader_em_proxy", "reader exact match (train)"), ("em", "exact match"))),
    ("ICT / DPR", "mean_rank", (
        ("loss", "in-batch loss"), ("accuracy", "in-batch accuracy"),
        ("mean_rank", "mean rank of the positive"), ("recall_at_5", "recall@5 in the batch"))),
    ("RETRO", "bits_per_byte", (
        ("loss", "next-token loss (nats)"), ("bits_per_byte", "bits per byte"),
        ("bits_per_byte_no_neighbours", "bits per byte, neighbours removed"))),
)
NULL_OF = {"accuracy": "null_accuracy", "found_accuracy": "found_null_accuracy"}
_RECALL = re.compile(r"recall_(\d+)")  # fine-tuning's retriever recall@k (config.ks)


def panels_of(rows: list[dict]) -> list[tuple[str, str]]:
  """The panels (metric, title) of the kind of run `rows` come from, those they have; [] for
  rows of no kind in RUNS."""
  keys = set().union(*rows)
  for _, mark, panels in RUNS:
    if mark in keys:
      recalls = sorted((int(m[1]), k) for k in keys if (m := _RECALL.fullmatch(k)))
      return ([(k, t) for k, t in panels if k in keys]
              + [(k, f"retriever recall@{n}") for n, k in recalls])
  return []


def read_metrics(path: str) -> list[dict]:
  """The rows of a metrics.jsonl (local or gs://)."""
  if not as_path(path).exists():
    raise FileNotFoundError(f"{path} does not exist: point at a run's work directory (it is "
                            "written while training).")
  rows = []
  for line, row in iter_jsonl(path, "metrics file"):
    if not (isinstance(row, dict) and "step" in row and "split" in row):
      raise ValueError(f"{path}:{line}: not a row of metrics (an object with step and split); "
                       "point at a run's metrics.jsonl.")
    rows.append(row)
  return rows


def plot_metrics(workdir: str, out_png: str | None = None) -> str:
  """Plots train (thin) and held-out or dev (dots) curves of `workdir/metrics.jsonl`, the panels
  of its kind of run (RUNS); pre-training's accuracy panels also show the null-document-only
  accuracy, its utility panel the held-out standard errors. Returns the PNG's path."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  path = os.path.join(workdir, "metrics.jsonl")
  rows = read_metrics(path)
  if not rows:
    raise ValueError(f"{path} has no metrics yet: the run writes them every config.log_every "
                     "steps; plot it after that.")
  # A resumed run appends: keep the last record of each (split, step).
  last = {(r["split"], r["step"]): r for r in rows}
  panels = panels_of(list(last.values()))  # older runs: fewer
  if not panels:
    raise ValueError(f"{path} holds none of the metrics these curves draw (of "
                     f"{', '.join(kind for kind, _, _ in RUNS)} runs): point at the work "
                     "directory of one.")
  splits = sorted({sp for sp, _ in last}, key=lambda sp: (sp != "train", sp))
  cols = min(3, len(panels))
  n_rows = -(-len(panels) // cols)
  fig, axes = plt.subplots(n_rows, cols, figsize=(4.2 * cols, 3.4 * n_rows), squeeze=False)
  for ax in axes.flat[len(panels):]:
    ax.remove()
  for ax, (key, title) in zip(axes.flat, panels):
    for split in splits:
      style = dict(lw=1, alpha=0.8) if split == "train" else dict(marker="o", lw=2)
      pts = sorted((s, r[key]) for (sp, s), r in last.items() if sp == split and key in r)
      se = [last[split, s].get(f"{key}_se") for s, _ in pts]
      if pts and split != "train" and all(e is not None for e in se):
        ax.errorbar(*zip(*pts), yerr=se, capsize=3, label=f"{split} (+- standard error)", **style)
      elif pts:
        ax.plot(*zip(*pts), label=split, **style)
      if key in NULL_OF:
        null = sorted((s, r[NULL_OF[key]]) for (sp, s), r in last.items()
                      if sp == split and NULL_OF[key] in r)
        if null:
          ax.plot(*zip(*null), ls="--", label=f"{split}, null document only", **style)
    if key == "retrieval_utility":
      ax.axhline(0, color="grey", lw=0.5)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
  out_png = out_png or os.path.join(workdir, "curves.png")
  save_figure(fig, out_png, dpi=110)
  return out_png
