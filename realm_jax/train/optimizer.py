"""BERT's optimiser, as REALM used it: AdamW with linear warmup and linear decay, global-norm clip.

Warmup is min(10k, max(100, steps / 10)) steps unless given; weight decay 0.01 skips biases and
LayerNorm parameters (as BERT's `exclude_from_weight_decay`); eps 1e-6.
"""

from __future__ import annotations

import jax
import optax


def default_warmup_steps(total_steps: int) -> int:
  return min(10_000, max(100, total_steps // 10))


def bert_schedule(learning_rate: float, total_steps: int,
                  warmup_steps: int | None = None) -> optax.Schedule:
  """0 -> learning_rate linearly over the warmup, then linearly to 0 at `total_steps`."""
  if total_steps <= 0:
    raise ValueError(f"total_steps={total_steps} must be positive.")
  warmup = default_warmup_steps(total_steps) if warmup_steps is None else warmup_steps
  warmup = min(warmup, total_steps)
  return optax.join_schedules([
      optax.linear_schedule(0.0, learning_rate, max(warmup, 1)),
      optax.linear_schedule(learning_rate, 0.0, max(total_steps - warmup, 1))], [warmup])


def decay_mask(params) -> dict:
  """True for parameters that get weight decay: not biases, not LayerNorm scales."""
  def decays(path, _):
    names = [getattr(k, "key", str(k)) for k in path]
    return not (names[-1] == "bias" or any("LayerNorm" in n or "layer_norm" in n for n in names))
  return jax.tree_util.tree_map_with_path(decays, params)


def bert_adamw(learning_rate: float, total_steps: int, warmup_steps: int | None = None,
               weight_decay: float = 0.01, eps: float = 1e-6, b1: float = 0.9, b2: float = 0.999,
               clip_norm: float = 1.0) -> optax.GradientTransformation:
  return adamw_with(bert_schedule(learning_rate, total_steps, warmup_steps), weight_decay, eps,
                    b1, b2, clip_norm)


def adamw_with(schedule: optax.Schedule, weight_decay: float = 0.01, eps: float = 1e-6,
               b1: float = 0.9, b2: float = 0.999,
               clip_norm: float = 1.0) -> optax.GradientTransformation:
  """BERT's AdamW (decay mask, eps 1e-6, global-norm clip) with any learning-rate schedule."""
  return optax.chain(optax.clip_by_global_norm(clip_norm),
                     _adamw(schedule, weight_decay, eps, b1, b2))


def _adamw(schedule: optax.Schedule, weight_decay: float = 0.01, eps: float = 1e-6,
           b1: float = 0.9, b2: float = 0.999) -> optax.GradientTransformation:
  """BERT's AdamW update without the clip (eps 1e-6, no decay on biases and LayerNorm)."""
  return optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask)


def delayed_schedule(learning_rate: float, total_steps: int, start: int,
                     warmup_steps: int | None = None) -> optax.Schedule:
  """0 before step `start`, then `bert_schedule` over the remaining steps (a part of the model
  that joins training late gets its own warmup and decay)."""
  if start <= 0:
    return bert_schedule(learning_rate, total_steps, warmup_steps)
  if start >= total_steps:
    raise ValueError(f"start={start} must be below total_steps={total_steps}.")
  return optax.join_schedules(
      [optax.constant_schedule(0.0),
       bert_schedule(learning_rate, total_steps - start, warmup_steps)], [start])


def from_config(config) -> tuple[optax.Schedule, optax.GradientTransformation]:
  """(learning-rate schedule, BERT AdamW) of a run config with learning_rate, num_steps,
  warmup_steps (-1: the default), weight_decay and clip_norm.

  With config.retriever_learning_rate >= 0 (pre-training; -1 by default: learning_rate for
  everything) the parameters under "retriever" follow their own schedule of the same shape, and
  the others (the encoder) config.learning_rate; the gradient is still clipped as one. The
  schedule returned is config.learning_rate's. retriever_learning_rate = 0 freezes the retriever:
  no update and no optimiser state for it (the train step stops its gradient too).
  """
  warmup = None if config.warmup_steps < 0 else config.warmup_steps
  schedule = bert_schedule(config.learning_rate, config.num_steps, warmup)
  retriever_lr = config.get("retriever_learning_rate", -1.0)
  if retriever_lr < 0:
    return schedule, bert_adamw(config.learning_rate, config.num_steps, warmup,
                                config.weight_decay, clip_norm=config.clip_norm)
  parts = {"retriever": (optax.set_to_zero() if retriever_lr == 0 else
                        _adamw(bert_schedule(retriever_lr, config.num_steps, warmup),
                               config.weight_decay)),
           "rest": _adamw(schedule, config.weight_decay)}
  label = lambda params: {k: ("retriever" if k == "retriever" else "rest") for k in params}
  return schedule, optax.chain(optax.clip_by_global_norm(config.clip_norm),
                               optax.multi_transform(parts, label))
