"""Cheap checks of a run's settings, made before anything expensive (weights, corpus, compiling).

Errors name the user's flag, `--config.<key>=<value>`, and what to do; the entry points turn them
into one `error:` line (realm_jax/cli.py).
"""

from __future__ import annotations

import numbers
from typing import Any, Iterable, Mapping

from realm_jax.io_utils import as_path


def _get(config, key: str) -> Any:
  value = config
  for part in key.split("."):
    value = value[part]
  return value


def at_least(config, minimums: Mapping[str, float], flag: str = "--config") -> None:
  """Refuses a setting below its minimum (or not a number), e.g. {"batch_size": 1}."""
  for key, low in minimums.items():
    value = _get(config, key)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < low:
      raise ValueError(f"{flag}.{key}={value!r}: must be a number of at least {low}.")


def whole_number(name: str, value: Any, low: int, high: int | None = None,
                 what: str = "") -> None:
  """Refuses `value` (named `name`: a flag or an argument) unless it is an int, not a bool, in
  [low, high] (no upper bound when `high` is None); `what` ends the message ("... (0: default)")."""
  if (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low
      or (high is not None and value > high)):
    span = f"from {low} to {high}" if high is not None else f">= {low}"
    raise ValueError(f"{name}={value!r}: give a whole number {span}{what}.")


def one_of(config, choices: Mapping[str, Iterable[Any]], flag: str = "--config") -> None:
  """Refuses a setting outside its choices, e.g. {"index.refresh": ("sync", "async", "none")}."""
  for key, allowed in choices.items():
    allowed = tuple(allowed)
    value = _get(config, key)
    if value not in allowed:
      raise ValueError(f"{flag}.{key}={value!r}: use one of {allowed}.")


def below(config, key: str, other: str, flag: str = "--config") -> None:
  """Refuses config[key] > config[other] (e.g. the read blocks of a beam: at most the beam)."""
  if _get(config, key) > _get(config, other):
    raise ValueError(f"{flag}.{key}={_get(config, key)!r} is larger than {flag}.{other}="
                     f"{_get(config, other)!r}: lower the first or raise the second.")


def workdir(path: str) -> None:
  """Refuses a --workdir that exists and is not a directory (it is created when missing)."""
  if not path:
    raise ValueError("--workdir is empty: give the run's work directory.")
  p = as_path(path)
  if p.exists() and not p.is_dir():
    raise ValueError(f"--workdir={path} is a file: give a directory (it is created if missing).")


# Keys only one trainer's configs have (realm_jax/configs/<kind>.py), checked in this order.
_KIND_KEYS = (("finetune", ("retrieval", "reader_weights", "reader_blocks", "beam")),
              ("ict", ("query_length", "doc_length", "remove_prob")),
              ("dpr", ("question_length", "passage_length", "bm25_depth")),
              ("retro", ("db", "model")),
              ("pretrain", ("num_candidates", "slice", "corpus", "index", "model")))


def config_kind(config) -> str | None:
  """The trainer a config is for: "finetune", "ict", "dpr", "retro" or "pretrain"; None for any
  other (an index build's, the ablations')."""
  return next((kind for kind, keys in _KIND_KEYS if all(k in config for k in keys)), None)
