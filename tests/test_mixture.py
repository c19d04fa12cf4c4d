"""The mixture of QA datasets (realm_jax/data/mixture.py): each dataset's train / dev / test parts
(NQ-Open's held-out questions the same alone or mixed), the draws' shares against the weights
(within binomial standard errors), determinism by seed, each dataset's epochs, and per-dataset
metrics."""

import json
import os

import ml_collections
import numpy as np
import pytest

from realm_jax.configs.finetune import get_config
from realm_jax.data.mixture import (MixtureOrder, dataset_settings, first_of_each,
                                    mixture_weights, split_questions)
from realm_jax.eval.open_qa import per_dataset

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


def _write(folder, name, questions):
  folder.mkdir(exist_ok=True)
  (folder / name).write_text("".join(json.dumps({"question": q, "answer": [a]}) + "\n"
                                     for q, a in questions), encoding="utf-8")


def _mixture(tmp_path, **weights):
  """A mixture config over written files: web_questions (train + test), curated_trec (train +
  test), nq_open (dev hash-split, train only trains)."""
  _write(tmp_path / "wq", "train.jsonl", [(f"who is web person {i}?", f"P{i}")
                                          for i in range(300)])
  _write(tmp_path / "wq", "test.jsonl", [(f"who is web test person {i}?", "X") for i in range(40)]
         + [("who is web person 7?", "P7")])  # also a training question: dropped from train
  _write(tmp_path / "trec", "train.jsonl", [(f"when was trec event {i}?", f"{i}")
                                            for i in range(200)])
  _write(tmp_path / "trec", "test.jsonl", [(f"when was trec test {i}?", "1") for i in range(30)])
  _write(tmp_path / "nq", "NQ-open.dev.jsonl", [(f"where is nq place {i}", "p")
                                               for i in range(400)])
  _write(tmp_path / "nq", "NQ-open.train-sample.jsonl",
         [(f"what is nq thing {i}", "t") for i in range(500)])
  c = get_config("mixture")
  m = ml_collections.ConfigDict()
  for name, folder, extra in (
      ("nq_open", "nq", dict(splits=("dev",), test_percent=20.0, train_splits=("train",))),
      ("web_questions", "wq", dict(splits=("train",), test_splits=("test",))),
      ("curated_trec", "trec", dict(splits=("train",), test_splits=("test",)))):
    m[name] = ml_collections.ConfigDict({
        "weight": weights.get(name, 1.0), "splits": (), "test_percent": 0.0, "test_splits": (),
        "train_splits": (), "local_dir": str(tmp_path / folder), **extra})
  c.data.mixture = m
  return c


def test_each_dataset_is_split_and_tagged(tmp_path):
  c = _mixture(tmp_path)
  parts = split_questions(c.data)
  count = lambda part, name: sum(q["dataset"] == name for q in parts[part])
  # Held out whole: the test splits (WebQuestions' copy of a training question leaves train).
  assert count("test", "web_questions") == 41 and count("test", "curated_trec") == 30
  assert count("train", "web_questions") + count("dev", "web_questions") == 299
  assert not {q["question"] for q in parts["train"]} & {q["question"] for q in parts["test"]}
  # NQ-Open: a hash part of dev held out; train_splits only train.
  assert 40 < count("test", "nq_open") < 120
  nq_train = {q["question"] for q in parts["train"] if q["dataset"] == "nq_open"}
  assert {f"what is nq thing {i}" for i in range(500)} <= nq_train
  assert all(q["question"].startswith("where is") for q in parts["test"] + parts["dev"]
             if q["dataset"] == "nq_open")
  assert split_questions(c.data) == parts  # deterministic
  # A dataset may only train: all of its train split, none of it held out.
  c.data.mixture.curated_trec.update(splits=(), train_splits=("train",))
  only = split_questions(c.data)
  assert sum(q["dataset"] == "curated_trec" for q in only["train"]) == 200
  assert not any(q["dataset"] == "curated_trec" for q in only["dev"])
  # The first N dev questions of each dataset.
  firsts = first_of_each(parts["dev"], 5)
  assert [q["dataset"] for q in firsts] == sorted([q["dataset"] for q in firsts], key=[
      q["dataset"] for q in parts["dev"]].index) and len(firsts) == 15


def test_nq_open_held_out_part_is_the_same_alone_or_mixed():
  folder = os.path.join(SHARED, "nq_open")
  if not os.path.isdir(folder):
    pytest.skip("../shared/data/nq_open is not here")
  alone = get_config("wiki_vital")
  alone.data.local_dir = folder
  mixed = get_config("mixture")
  mixed.data.mixture = ml_collections.ConfigDict({"nq_open": mixed.data.mixture.nq_open})
  mixed.data.mixture.nq_open.local_dir = folder
  a, m = split_questions(alone.data), split_questions(mixed.data)
  assert len(a["test"]) == 1079 and m["test"] == a["test"] and m["dev"] == a["dev"]
  # The train sample trains, but for 4 questions that normalise like held-out ones.
  assert len(m["train"]) == len(a["train"]) + 8757 - 4


@pytest.mark.parametrize("weights", [{"a": 1.0, "b": 1.0, "c": 2.0},
                                     {"a": 0.7, "b": 0.25, "c": 0.05}])
def test_draws_follow_the_weights(weights):
  sizes = {"a": 50, "b": 700, "c": 3}
  # a's questions in two runs, apart.
  labels = [name for name in ("b", "a", "c", "a")
            for _ in range(sizes[name] // (2 if name == "a" else 1))]
  total = sum(weights.values())
  order = MixtureOrder(labels, {k: w / total for k, w in weights.items()}, seed=3)
  n = 30_000
  drawn = np.bincount([order.dataset(k) for k in range(n)], minlength=3)
  for d, name in enumerate(order.names):
    p = weights[name] / total
    assert abs(drawn[d] - n * p) < 4 * np.sqrt(n * p * (1 - p)), (name, drawn[d], n * p)
  # Each draw takes a question of its dataset; a dataset's questions all come once per epoch.
  picks = [order[k] for k in range(3000)]
  assert all(labels[i] == order.names[order.dataset(k)] for k, i in enumerate(picks))
  a_picks = [i for i in picks if labels[i] == "a"]
  assert sorted(a_picks[:50]) == [i for i, x in enumerate(labels) if x == "a"]
  assert a_picks[50:100] != a_picks[:50] and sorted(a_picks[50:100]) == sorted(a_picks[:50])


def test_draws_are_deterministic_by_seed_and_resume_anywhere():
  labels = ["x"] * 30 + ["y"] * 20
  w = {"x": 0.5, "y": 0.5}
  draws = lambda seed: (lambda order: [order[k] for k in range(9000)])(
      MixtureOrder(labels, w, seed))
  first = draws(0)
  assert first == draws(0) and first != draws(1)
  fresh = MixtureOrder(labels, w, 0)  # a resumed run: straight to draw k
  assert [fresh[k] for k in (8999, 4096, 17)] == [first[8999], first[4096], first[17]]
  # One dataset: the order fine-tuning always had, epoch by epoch.
  one = MixtureOrder(["x"] * 30, {"x": 1.0}, 5)
  want = np.concatenate([np.random.default_rng([5, e]).permutation(30) for e in range(3)])
  assert [one[k] for k in range(90)] == list(want)


def test_bad_mixtures_are_refused(tmp_path):
  c = _mixture(tmp_path, web_questions=-1.0)
  with pytest.raises(ValueError, match=r"mixture\.web_questions\.weight=-1\.0: a weight is a "
                                       "share"):
    dataset_settings(c.data)
  c = _mixture(tmp_path, web_questions=0.0, curated_trec=0.0, nq_open=0.0)
  with pytest.raises(ValueError, match="every weight is 0"):
    mixture_weights(c.data)
  c = _mixture(tmp_path)
  c.data.mixture.curated_trec.splits = ()
  with pytest.raises(ValueError, match=r"mixture\.curated_trec names no splits"):
    dataset_settings(c.data)
  with pytest.raises(ValueError, match=r"No training questions of \['b'\]"):
    MixtureOrder(["a"] * 3, {"a": 0.5, "b": 0.5}, 0)
  # A dataset without dev questions (dev_percent 0) is refused by name.
  c = _mixture(tmp_path)
  c.data.dev_percent = 0.0
  with pytest.raises(ValueError, match=r"gives curated_trec \d+ training and 0 dev questions"):
    split_questions(c.data)


def test_metrics_per_dataset():
  questions = [{"dataset": d} for d in ("a", "b", "a", "b", "b")]
  result = {"em": 40.0, "recall": {1: 20.0, 5: 60.0}, "first_hit": np.array([1, 0, 3, 6, 2]),
            "predictions": [{"correct": c} for c in (True, False, False, True, False)]}
  got = per_dataset(result, questions)
  assert got == {"a": {"em": 50.0, "recall": {1: 50.0, 5: 100.0}, "count": 2},
                 "b": {"em": pytest.approx(100 / 3), "recall": {1: 0.0, 5: pytest.approx(100 / 3)},
                       "count": 3}}
  assert per_dataset({**result, "em": None}, questions)["a"]["em"] is None
