"""Open-QA reader: span scores over the retrieved blocks, and the retriever and reader losses.

Input per (question, block): `[CLS] q [SEP] block [SEP]`; `block_mask` marks the block's tokens.
Span (s, e) with 1 <= e - s + 1 <= max_span_width, every position s..e inside the block (the
block mask has a hole at the [SEP] between title and body: no span crosses it; HF checks only
the two ends, the same where the mask has no hole):
  score(s, e) = dense_1( LayerNorm_1e-3( relu(start[s] + end[e]) ) ) + retriever_logit(block)
where [start, end] = dense_intermediate(h) split in halves (span_hidden_size each).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from realm_jax.models.bert import BertModel, dense, layer_norm
from realm_jax.models.config import RealmConfig
from realm_jax.models.dropout import Rows

Array = jax.Array

_NEG = float(np.finfo(np.float32).min)


def span_candidates(seq_len: int, max_width: int) -> tuple[np.ndarray, np.ndarray]:
  """All spans of width 1..max_width in a sequence, ordered by width then start (HF order).

  Returns (starts [N], ends [N]) as host int32 arrays; static for a given shape.
  """
  starts, ends = [], []
  for w in range(1, min(max_width, seq_len) + 1):
    starts.append(np.arange(seq_len - w + 1))
    ends.append(np.arange(w - 1, seq_len))
  return np.concatenate(starts).astype(np.int32), np.concatenate(ends).astype(np.int32)


class SpanScorer(nn.Module):
  """HF `qa_outputs`: hidden [..., L, H], block_mask [..., L] -> span logits [..., N].

  Returns (logits, valid, starts, ends): a span is valid when block_mask is 1 on all its positions;
  invalid spans' logits are float32 min.
  """
  config: RealmConfig

  @nn.compact
  def __call__(self, hidden: Array, block_mask: Array):
    c = self.config
    starts, ends = span_candidates(hidden.shape[-2], c.max_span_width)
    proj = dense(c, 2 * c.span_hidden_size, "dense_intermediate")(hidden)
    start_proj, end_proj = jnp.split(proj, 2, axis=-1)                  # [..., L, S]
    h = jax.nn.relu(jnp.take(start_proj, starts, axis=-2) + jnp.take(end_proj, ends, axis=-2))
    h = layer_norm(c.reader_layer_norm_eps, "layer_normalization")(h)  # [..., N, S]
    logits = dense(c, 1, "dense_output")(h.astype(c.compute_dtype))[..., 0].astype(jnp.float32)
    bm = block_mask.astype(bool)
    # Positions outside the block up to each one: none in (s, e] iff the counts at s and e agree.
    outside = jnp.cumsum(~bm, axis=-1, dtype=jnp.int32)
    valid = jnp.take(bm, starts, axis=-1) & (jnp.take(outside, starts, axis=-1)
                                             == jnp.take(outside, ends, axis=-1))  # [..., N]
    return jnp.where(valid, logits, _NEG), valid, starts, ends


class RealmReader(nn.Module):
  """BERT + span scorer. Inputs [B, R, L] for B questions with R retrieved blocks each.

  Returns a dict: `span_logits` [B, R, N] (retriever logit added; invalid spans at float32 min),
  `span_valid` [B, R, N], and the host arrays `starts`, `ends` [N] of token positions.
  `dropout_rows`: the B questions are these of a larger batch (whose dropout masks they get).
  """
  config: RealmConfig

  def setup(self):
    self.realm = BertModel(self.config, add_pooling_layer=True)
    self.qa_outputs = SpanScorer(self.config)

  def __call__(self, input_ids: Array, attention_mask: Array, token_type_ids: Array,
               block_mask: Array, retriever_logits: Array, deterministic: bool = True,
               dropout_rows: Rows | None = None):
    if input_ids.shape[-1] < self.config.max_span_width:
      raise ValueError(
          f"Reader input length {input_ids.shape[-1]} is shorter than max_span_width="
          f"{self.config.max_span_width}.")
    sequence, _ = self.realm(input_ids, attention_mask, token_type_ids, deterministic,
                             dropout_rows)
    span_logits, valid, starts, ends = self.qa_outputs(sequence, block_mask)
    span_logits = jnp.where(valid, span_logits + retriever_logits[..., None].astype(jnp.float32),
                            _NEG)
    return dict(span_logits=span_logits, span_valid=valid, starts=starts, ends=ends)


def correct_spans(starts: Array, ends: Array, gold_starts: Array, gold_ends: Array) -> Array:
  """Which candidate spans are gold: starts/ends [N], gold [..., A] (-1 = none) -> [..., N]."""
  hit = (starts[None, :] == gold_starts[..., :, None]) & (ends[None, :] == gold_ends[..., :, None])
  return jnp.any(hit & (gold_starts[..., :, None] >= 0), axis=-2)


def marginal_nll(logits: Array, correct: Array) -> Array:
  """-log( sum_correct exp(l) / sum_all exp(l) ) over the last axis; 0 where nothing is correct."""
  logits = logits.astype(jnp.float32)
  any_correct = jnp.any(correct, axis=-1)
  # float32-min instead of -inf keeps the gradient finite when nothing is correct.
  log_num = jax.nn.logsumexp(jnp.where(correct, logits, _NEG), axis=-1)
  log_den = jax.nn.logsumexp(logits, axis=-1)
  return jnp.where(any_correct, log_den - log_num, 0.0)


def reader_losses(retriever_logits: Array, has_answer: Array, span_logits: Array,
                  span_correct: Array) -> dict[str, Array]:
  """ORQA/REALM fine-tuning losses, per question.

  Args:
    retriever_logits: [B, Z] scores of the whole retrieved beam.
    has_answer: [B, Z] whether each retrieved block contains an answer string.
    span_logits: [B, R, N] reader logits of the top R <= Z blocks (retriever logit added).
    span_correct: [B, R, N] whether each span is a gold answer.
  Returns:
    `retriever_loss` [B], `reader_loss` [B] (each 0 where nothing is correct), `loss` [] = mean over
    questions of their sum.
  """
  b = span_logits.shape[0]
  retriever_loss = marginal_nll(retriever_logits, has_answer)
  reader_loss = marginal_nll(span_logits.reshape(b, -1), span_correct.reshape(b, -1))
  return dict(retriever_loss=retriever_loss, reader_loss=reader_loss,
              loss=jnp.mean(retriever_loss + reader_loss))
