"""Standard errors shared by the evaluations (REALM's ablations, RETRO's and kNN-LM's bits per
byte): a ratio of sums over independent units (sentences, questions, documents)."""

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
