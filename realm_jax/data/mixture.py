"""Open-QA questions of one dataset or of a weighted mixture of several: their train / dev / test
parts, and the order in which training draws them.

    parts = split_questions(config.data)     # {"train", "dev", "test"}: dicts with a "dataset"
    order = MixtureOrder([q["dataset"] for q in parts["train"]], mixture_weights(config.data), 0)
    parts["train"][order[k]]                  # the question of draw k

`config.data` is one dataset, as fine-tuning always had it:
    name, splits, local_dir, data_dir, test_percent, dev_percent, seed, limit
the splits pooled, then split by a hash of the question: test first, dev out of the rest. Or it
is a mixture: `data.mixture` has one entry per dataset (named by the dataset),
    weight        its share of the training draws (the weights are normalised)
    splits        pooled and split by the hash as above (test_percent of them held out)
    test_percent  what the hash holds out of `splits` for the final report
    test_splits   splits held out whole (e.g. web_questions' official test split)
    train_splits  splits that only train: nothing of them is held out
    local_dir     the folder holding its files ("" = download with TFDS)
beside data.{data_dir, dev_percent, seed, limit}, shared (limit: the first N questions of each
dataset's `splits`), and data.drop_absent (fine-tuning drops the training questions whose answer
is nowhere in the corpus: realm_jax/data/answerable.py). The hash is split_by_hash's with the
same seed strings for every dataset, so a dataset's held-out questions are the same alone or in a
mixture. A training question that normalises like one of its dataset's dev or test questions is
dropped (logged).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import numpy as np

from realm_jax.data.qa import load_questions, split_by_hash
from realm_jax.text.answers import normalize_answer

DRAW_BLOCK = 4096  # draws made at once by one generator
_DRAWS_KEY = 2**31  # the spawn key of the draws' generators, apart from the datasets' (0, 1, ...)


def dataset_settings(data) -> dict[str, dict]:
  """{dataset: {weight, splits, test_percent, test_splits, train_splits, local_dir}} of
  config.data (one dataset: weight 1, its splits, no test or train-only splits)."""
  if "mixture" not in data:
    return {data.name: {"weight": 1.0, "splits": tuple(data.splits),
                        "test_percent": data.test_percent, "test_splits": (),
                        "train_splits": (), "local_dir": data.local_dir}}
  if not data.mixture:
    raise ValueError("--config.data.mixture names no dataset: give at least one.")
  out = {}
  for name, d in data.mixture.items():
    out[name] = {"weight": float(d.get("weight", 1.0)), "splits": tuple(d.get("splits", ())),
                 "test_percent": float(d.get("test_percent", 0.0)),
                 "test_splits": tuple(d.get("test_splits", ())),
                 "train_splits": tuple(d.get("train_splits", ())),
                 "local_dir": d.get("local_dir", "")}
    if out[name]["weight"] < 0:
      raise ValueError(f"--config.data.mixture.{name}.weight={out[name]['weight']}: a weight is a "
                       "share of the training draws, 0 or more.")
    if not out[name]["splits"] and not out[name]["train_splits"]:
      raise ValueError(f"--config.data.mixture.{name} names no splits: give splits (hash-split "
                       "into train / dev / test) or train_splits.")
  if not any(d["weight"] > 0 for d in out.values()):
    raise ValueError("--config.data.mixture: every weight is 0; give a dataset a weight > 0.")
  return out


def mixture_weights(data) -> dict[str, float]:
  """{dataset: its share of the training draws} (summing to 1)."""
  weights = {name: d["weight"] for name, d in dataset_settings(data).items()}
  total = sum(weights.values())
  return {name: w / total for name, w in weights.items()}


def split_questions(data) -> dict[str, list[dict]]:
  """{"train", "dev", "test"} questions of config.data (see the module docstring), each question
  with its "dataset"; the datasets one after another in the order given."""
  parts = {"train": [], "dev": [], "test": []}
  for name, d in dataset_settings(data).items():
    load = functools.partial(load_questions, name, local_dir=d["local_dir"] or None,
                             data_dir=data.data_dir or None)
    questions = [q for split in d["splits"] for q in load(split)]
    if data.limit:
      questions = questions[:data.limit]
    rest, test = split_by_hash(questions, d["test_percent"], f"{data.seed}/test")
    train, dev = split_by_hash(rest, data.dev_percent, f"{data.seed}/dev")
    test += [q for split in d["test_splits"] for q in load(split)]
    train += [q for split in d["train_splits"] for q in load(split)]
    held = {normalize_answer(q["question"]) for q in dev + test}
    kept = [q for q in train if normalize_answer(q["question"]) not in held]
    if len(kept) < len(train):
      logging.warning("%s: %d training questions dropped: they normalise like dev or test ones.",
                      name, len(train) - len(kept))
    if (d["weight"] > 0 and not kept) or (d["splits"] and not dev):
      raise ValueError(
          f"--config.data gives {name} {len(kept)} training and {len(dev)} dev questions: use more "
          "questions (its splits / limit) or other percentages.")
    for part, qs in (("train", kept), ("dev", dev), ("test", test)):
      parts[part] += [{**q, "dataset": name} for q in qs]
  if not parts["dev"]:
    raise ValueError("--config.data gives no dev question: give a dataset `splits` to split.")
  return parts


def by_dataset(questions: Sequence[dict]) -> dict[str, list[int]]:
  """{dataset: indices of its questions}, datasets in order of first appearance."""
  out: dict[str, list[int]] = {}
  for i, q in enumerate(questions):
    out.setdefault(q.get("dataset", ""), []).append(i)
  return out


def first_of_each(questions: Sequence[dict], limit: int) -> list[dict]:
  """The first `limit` questions of each dataset (0: all), in the given order."""
  if not limit:
    return list(questions)
  keep = sorted(i for rows in by_dataset(questions).values() for i in rows[:limit])
  return [questions[i] for i in keep]


class MixtureOrder:
  """Which training question draw k takes (`order[k]`: an index into the pooled questions).

  Each draw picks a dataset with probability its weight (generators seeded by (seed, block of
  DRAW_BLOCK draws)); each dataset walks through its questions in a new random order each of its
  epochs (dataset d's order in its epoch e from a generator seeded by (seed, e), d spawned apart).
  A pure function of the labels, weights and seed: a run resumes from its number of draws. With one
  dataset every draw is its own, and the order is the one fine-tuning always had.

  Args:
    datasets: the dataset of each pooled question.
    weights: {dataset: share} (`mixture_weights`); a dataset with questions but no weight is never
      drawn.
    seed: an int.
  """

  def __init__(self, datasets: Sequence[str], weights: dict[str, float], seed: int):
    groups = by_dataset([{"dataset": d} for d in datasets])
    missing = [name for name, w in weights.items() if w > 0 and name not in groups]
    if missing:
      raise ValueError(f"No training questions of {missing}, which have a weight: give them "
                       "questions, or weight 0.")
    self.names = list(weights)
    self.members = [np.asarray(groups.get(name, []), np.int64) for name in self.names]
    p = np.asarray([weights[name] for name in self.names], np.float64)
    self.p = p / p.sum()
    self.seed = int(seed)
    self._before = [np.zeros(len(self.names), np.int64)]  # counts of each dataset before block b
    self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    self._orders: dict[tuple[int, int], np.ndarray] = {}

  def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
    """([DRAW_BLOCK] the datasets of draws b * DRAW_BLOCK, ..., [DRAW_BLOCK, D] how many draws
    of the block before each took each dataset)."""
    if b not in self._blocks:
      if len(self._blocks) > 4:
        self._blocks.clear()
      rng = np.random.default_rng(np.random.SeedSequence([self.seed, b], spawn_key=(_DRAWS_KEY,)))
      drawn = rng.choice(len(self.names), size=DRAW_BLOCK, p=self.p)
      onehot = np.eye(len(self.names), dtype=np.int64)[drawn]
      self._blocks[b] = drawn, np.cumsum(onehot, axis=0) - onehot
    return self._blocks[b]

  def dataset(self, k: int) -> int:
    """The index (into `names`) of draw k's dataset."""
    if len(self.names) == 1:
      return 0
    return int(self._block(k // DRAW_BLOCK)[0][k % DRAW_BLOCK])

  def _drawn_before(self, k: int, d: int) -> int:
    """How many of draws 0 .. k-1 took dataset d."""
    if len(self.names) == 1:
      return k
    b = k // DRAW_BLOCK
    while len(self._before) <= b:
      n = len(self._before) - 1
      drawn, _ = self._block(n)
      self._before.append(self._before[n] + np.bincount(drawn, minlength=len(self.names)))
    return int(self._before[b][d] + self._block(b)[1][k % DRAW_BLOCK, d])

  def _epoch_order(self, d: int, epoch: int) -> np.ndarray:
    if (d, epoch) not in self._orders:
      if len(self._orders) > 2 * len(self.names):
        self._orders.clear()
      seq = np.random.SeedSequence([self.seed, epoch], spawn_key=(d,) if d else ())
      self._orders[d, epoch] = np.random.default_rng(seq).permutation(len(self.members[d]))
    return self._orders[d, epoch]

  def __getitem__(self, k: int) -> int:
    d = self.dataset(k)
    n = len(self.members[d])
    epoch, cursor = divmod(self._drawn_before(k, d), n)
    return int(self.members[d][self._epoch_order(d, epoch)[cursor]])
