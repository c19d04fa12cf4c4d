"""Error bars shared by the evaluations (REALM's ablations, open QA's systems side by side, RETRO's
and kNN-LM's bits per byte): the standard error of a ratio of sums over independent units
(sentences, questions, documents), and paired bootstrap intervals of a difference."""

from __future__ import annotations

import math

import numpy as np


def ratio_se(num, den) -> tuple[float, float]:
  """(sum(num) / sum(den), its standard error) over independent units: the delta method,
  sqrt(E / (E - 1) * sum (num_e - r den_e)^2) / sum den_e. NaN where it is undefined (no
  denominator; a standard error of fewer than 2 units)."""
  num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
  e, total = len(num), den.sum()
  if total <= 0:
    return float("nan"), float("nan")
  r = num.sum() / total
  if e < 2:
    return float(r), float("nan")
  return float(r), math.sqrt(e / (e - 1) * float(np.sum((num - r * den) ** 2))) / total


def paired_bootstrap(num_a, den_a, num_b, den_b, samples: int, seed: int = 0
                     ) -> tuple[float, float, float]:
  """(difference, 2.5th, 97.5th percentile) of sum(num_a)/sum(den_a) - sum(num_b)/sum(den_b),
  resampling the units (index i of all four arrays: the same sentence or question) together."""
  arrays = [np.asarray(x, np.float64) for x in (num_a, den_a, num_b, den_b)]
  n = len(arrays[0])
  if any(len(x) != n for x in arrays) or n == 0:
    raise ValueError("paired_bootstrap needs four arrays of the same non-zero length.")
  ratio = lambda num, den: num / np.maximum(den, 1e-12)
  diff = ratio(arrays[0].sum(), arrays[1].sum()) - ratio(arrays[2].sum(), arrays[3].sum())
  rng = np.random.default_rng(seed)
  diffs = np.empty(samples)
  for lo in range(0, samples, 1000):  # [chunk, n] index draws at a time
    idx = rng.integers(0, n, size=(min(1000, samples - lo), n))
    s = [x[idx].sum(-1) for x in arrays]
    diffs[lo:lo + len(idx)] = ratio(s[0], s[1]) - ratio(s[2], s[3])
  low, high = np.percentile(diffs, [2.5, 97.5])
  return float(diff), float(low), float(high)
