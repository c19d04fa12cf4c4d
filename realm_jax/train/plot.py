"""Training curves from a run's `metrics.jsonl` as a PNG (matplotlib, from the `demo` extra)."""

from __future__ import annotations

import os

from realm_jax.io_utils import as_path, atomic_write, iter_jsonl

PANELS = (("loss", "marginal MLM loss"), ("accuracy", "masked-token accuracy"),
          ("retrieval_utility", "retrieval utility (nats/token)"),
          ("retrieval_entropy", "entropy of p(z|x)"),
          ("span_in_candidates", "masked span in a retrieved block"),
          ("found_accuracy", "accuracy where the span was retrieved"))
NULL_OF = {"accuracy": "null_accuracy", "found_accuracy": "found_null_accuracy"}


def read_metrics(path: str) -> list[dict]:
  """The rows of a metrics.jsonl (local or gs://)."""
  if not as_path(path).exists():
    raise FileNotFoundError(f"{path} does not exist: point at a run's work directory (it is "
                            "written while training).")
  return [row for _, row in iter_jsonl(path, "metrics file")]


def plot_metrics(workdir: str, out_png: str | None = None) -> str:
  """Plots train (thin) and held-out (dots) curves of `workdir/metrics.jsonl`; the accuracy panels
  also show the null-document-only accuracy, the utility panel the held-out standard errors.
  Returns the PNG's path."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = read_metrics(os.path.join(workdir, "metrics.jsonl"))
  # A resumed run appends: keep the last record of each (split, step).
  last = {(r["split"], r["step"]): r for r in rows}
  panels = [(k, t) for k, t in PANELS if any(k in r for r in last.values())]  # older runs: fewer
  cols = min(3, len(panels))
  n_rows = -(-len(panels) // cols)
  fig, axes = plt.subplots(n_rows, cols, figsize=(4.2 * cols, 3.4 * n_rows), squeeze=False)
  for ax in axes.flat[len(panels):]:
    ax.remove()
  for ax, (key, title) in zip(axes.flat, panels):
    for split, style in (("train", dict(lw=1, alpha=0.8)), ("heldout", dict(marker="o", lw=2))):
      pts = sorted((s, r[key]) for (sp, s), r in last.items() if sp == split and key in r)
      se = [last[split, s].get(f"{key}_se") for s, _ in pts]
      if pts and split == "heldout" and all(e is not None for e in se):
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
  fig.tight_layout()
  out_png = out_png or os.path.join(workdir, "curves.png")
  atomic_write(out_png, lambda p: fig.savefig(p, dpi=110, format="png"))
  plt.close(fig)
  return out_png
