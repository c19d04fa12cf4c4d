"""Training curves (realm_jax/train/plot.py) of each kind of run: the panels of its own metrics,
the evaluation split whatever its name, and an error for a metrics file with nothing to draw."""

import json
import re

import pytest

from realm_jax.train import plot

pytest.importorskip("matplotlib")


def _run(tmp_path, rows):
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(tmp_path)


def _figure(workdir, monkeypatch):
  """The figure plot_metrics draws: {panel title: {legend label: (steps, values)}}."""
  import matplotlib.pyplot as plt
  close, drawn = plt.close, []
  monkeypatch.setattr(plt, "close", drawn.append)
  plot.plot_metrics(workdir)
  got = {ax.get_title(): {line.get_label(): tuple(map(tuple, line.get_data()))
                          for line in ax.get_lines()} for ax in drawn[0].axes}
  close(drawn[0])
  return got


def test_a_dpr_run_gets_its_own_panels_and_its_dev_points(tmp_path, monkeypatch):
  """A DPR run's panel was titled "marginal MLM loss", and its dev metrics were not drawn."""
  metrics = {"loss": 1.0, "accuracy": 0.5, "mean_rank": 2.0, "recall_at_5": 0.9}
  workdir = _run(tmp_path, [{"step": 10, "split": "train", **metrics, "learning_rate": 1e-5},
                            {"step": 20, "split": "train", **metrics},
                            {"step": 20, "split": "dev", **metrics}])
  got = _figure(workdir, monkeypatch)
  assert list(got) == ["in-batch loss", "in-batch accuracy", "mean rank of the positive",
                       "recall@5 in the batch"]
  assert got["in-batch loss"] == {"train": ((10, 20), (1.0, 1.0)), "dev": ((20,), (1.0,))}


def test_a_fine_tuning_run_draws_its_dev_exact_match_and_recalls(tmp_path, monkeypatch):
  train = {"loss": 3.0, "retriever_loss": 1.0, "reader_loss": 2.0, "answer_in_beam": 0.5,
           "answer_in_read": 0.4, "reader_em_proxy": 0.1}
  dev = {"em": 12.5, "recall_1": 20.0, "recall_20": 60.0, "recall_5": 40.0, "seconds": 3.0}
  workdir = _run(tmp_path, [{"step": 5, "split": "train", **train},
                            {"step": 5, "split": "dev", **dev}])
  got = _figure(workdir, monkeypatch)
  assert list(got) == ["retriever + reader loss", "answer in the beam",
                       "answer in the blocks read", "reader exact match (train)", "exact match",
                       "retriever recall@1", "retriever recall@5", "retriever recall@20"]
  assert got["exact match"] == {"dev": ((5,), (12.5,))}


def test_pretraining_and_retro_keep_their_panels():
  pre = [{"step": 1, "split": "heldout", "loss": 1, "accuracy": 0, "retrieval_entropy": 1}]
  assert [t for _, t in plot.panels_of(pre)] == ["marginal MLM loss", "masked-token accuracy",
                                                 "entropy of p(z|x)"]
  retro = [{"step": 1, "split": "heldout", "loss": 1, "bits_per_byte": 1,
            "bits_per_byte_no_neighbours": 1.1}]
  assert [t for _, t in plot.panels_of(retro)] == [
      "next-token loss (nats)", "bits per byte", "bits per byte, neighbours removed"]


@pytest.mark.parametrize("text, says", [
    ("", " has no metrics yet"),
    ('{"step": 1, "split": "train", "examples_per_s": 3.0}\n', " holds none of the metrics"),
    ('{"step": 1, "split": "train"}\n[1, 2]\n', ":2: not a row of metrics"),
])
def test_a_metrics_file_with_nothing_to_draw_is_an_error_naming_it(tmp_path, text, says):
  """An empty metrics.jsonl, or one without known metrics, ended in a ZeroDivisionError."""
  (tmp_path / "metrics.jsonl").write_text(text)
  with pytest.raises(ValueError, match="^" + re.escape(f"{tmp_path}/metrics.jsonl{says}")):
    plot.plot_metrics(str(tmp_path))


def test_a_figure_is_drawn_once_and_saved_as_the_two_pass_layout_would(tmp_path, monkeypatch):
  """io_utils.save_figure lays the figure out tightly and writes the same PNG as `tight_layout()`
  then `savefig`, which draws the whole figure twice (the placeholder layout engine that
  tight_layout leaves makes savefig draw once more before the draw it writes): it draws once."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.figure import Figure
  from realm_jax.io_utils import save_figure
  draws, draw = [], Figure.draw
  monkeypatch.setattr(Figure, "draw", lambda self, r: (draws.append(1), draw(self, r))[1])

  def figure():
    fig, axes = plt.subplots(1, 2, figsize=(6, 3))
    for i, ax in enumerate(axes):
      ax.plot([0, 1, 2], [i, 3, 1], label=f"curve {i}")
      ax.set_title(f"panel {i}")
      ax.legend()
    return fig

  old = figure()
  old.tight_layout()
  old.savefig(tmp_path / "old.png", dpi=50, format="png")
  plt.close(old)
  assert len(draws) == 2
  save_figure(figure(), tmp_path / "new.png", dpi=50)
  assert len(draws) == 3
  assert (tmp_path / "new.png").read_bytes() == (tmp_path / "old.png").read_bytes()
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
