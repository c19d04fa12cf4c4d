"""Open-QA fine-tuning step (ORQA / REALM), batched: B questions per step instead of 1.

The document index and the document tower are frozen (REFERENCE section 3), so the step never runs
the document tower: the embeddings of each question's retrieved beam come precomputed in the batch.
Only the question tower and the reader (BERT + span scorer) are parameters of the step; the
document tower is kept out of `state.params` altogether, so nothing (gradient, AdamW's weight
decay) can move it, and no optimiser moments are kept for it. `qa_params` builds the trainable
parameters from a retriever checkpoint; it and the forward functions (beam logits, whole-word
spans), which prediction shares, are in realm_jax/models/open_qa.py.

Per question, with fresh question embedding q and beam embeddings z_1..z_Z (frozen):
  retriever logits  s_j = score_scale * <q, z_j>                      (masked beam slots: -1e9)
  retriever loss    -log sum_{j: has answer} softmax(s)_j             (0 if no beam block has one)
  reader loss       marginal NLL of the gold spans over the spans of the first R beam blocks,
                    each span's logit including its block's s_j       (0 if no read span is gold)
The reader's blocks are beam positions 0..R-1 (the data pipeline puts them first), and their s_j
come from the same fresh q, so the reader loss also trains the question tower.

A batch (numpy on the host, sharded along B on device):
  question          {input_ids, attention_mask, token_type_ids}  [B, Lq]  [CLS] q [SEP]
  beam_embeddings   [B, Z, D] float32   frozen document embeddings of the retrieved beam
  beam_mask         [B, Z]   1 = a real beam block (0 pads a short beam)
  beam_has_answer   [B, Z]   1 = the block contains an answer string
  reader            {input_ids, attention_mask, token_type_ids}  [B, R, L]
                    [CLS] q [SEP] block [SEP] for beam blocks 0..R-1 (R <= Z)
  block_mask        [B, R, L] 1 on the block's tokens (spans must lie inside)
  word_start, word_end  (optional) [B, R, L] 1 where a span may start / end: whole words only
  gold_starts, gold_ends  [B, R, A] int32 token positions of the answer spans, -1 = none
A batch without `reader` (and the keys after it) is retriever-only: the loss is the retriever's
alone, and only the question tower gets a gradient (a cheap warm-up of the question tower: its
questions are ~16 word pieces, where the reader reads R x ~200).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from realm_jax.models.open_qa import QaModels, bert_inputs, qa_beam_logits, whole_word_spans
from realm_jax.models.reader import correct_spans, marginal_nll, reader_losses
from realm_jax.train.realm_step import TrainState, loss_step

Array = jax.Array


def frozen_span_offset(reader_params: dict) -> dict:
  """The reader's parameters with the span scorer's output bias cut from the gradient.

  That bias adds one constant to every span logit, and every loss here is a softmax over spans
  (plus terms without span logits), so its true gradient is exactly 0. Computed, it is rounding
  noise of either sign, which Adam's normalisation (g / (|g| + eps)) turns into steps of up to the
  learning rate: whether it moved depended on the CPU. It stays a parameter (HF's layout and
  checkpoints keep it, and prediction uses it), with a gradient that is exactly 0 everywhere.
  """
  head = reader_params["qa_outputs"]
  out = dict(head["dense_output"], bias=jax.lax.stop_gradient(head["dense_output"]["bias"]))
  return {**reader_params, "qa_outputs": {**head, "dense_output": out}}


def qa_loss(params, batch, models: QaModels, dropout_rng: Array | None = None):
  """Sum over the batch of each question's retriever + reader loss; dropout iff `dropout_rng`.

  A question without an answer in its beam adds 0 retriever loss (ORQA), and one without a gold
  span in its read blocks adds 0 reader loss (`reader_losses`' convention: `marginal_nll` is 0
  where nothing is correct, with a zero gradient). The loss is a sum, not a mean, so that a batch
  of B questions gives exactly the gradient of B batch-size-1 steps added together.

  Returns:
    (loss [], sums) with sums over the batch: `loss_sum`, `retriever_loss_sum`, `reader_loss_sum`,
    `questions`, `has_answer` (answer in the beam), `answer_in_read` (a gold span in the read
    blocks), `reader_correct` (the argmax span over all read blocks is gold: an EM proxy).
  """
  rngs = None if dropout_rng is None else jax.random.split(dropout_rng, 2)
  beam_logits = qa_beam_logits(params, batch, models, None if rngs is None else rngs[0])
  beam_mask = batch["beam_mask"] > 0
  has_answer = (batch["beam_has_answer"] > 0) & beam_mask                          # [B, Z]
  if "reader" not in batch:  # retriever-only batch: the question tower alone learns
    retriever_loss = marginal_nll(beam_logits, has_answer)
    loss = jnp.sum(retriever_loss)
    zero = jnp.zeros((), jnp.float32)
    return loss, {"loss_sum": loss, "retriever_loss_sum": loss, "reader_loss_sum": zero,
                  "questions": jnp.asarray(beam_logits.shape[0], jnp.float32),
                  "has_answer": jnp.sum(jnp.any(has_answer, axis=-1).astype(jnp.float32)),
                  "answer_in_read": zero, "reader_correct": zero}
  b, r = batch["reader"]["input_ids"].shape[:2]
  if r > beam_logits.shape[1]:
    raise ValueError(f"The batch has {r} read blocks per question but a beam of only "
                     f"{beam_logits.shape[1]}; the read blocks must be the beam's first R <= Z.")
  out = models.reader.apply(
      {"params": frozen_span_offset(params["reader"])}, *bert_inputs(batch["reader"]),
      batch["block_mask"], beam_logits[:, :r], rngs is None,
      rngs=None if rngs is None else {"dropout": rngs[1]})
  span_logits, span_valid = whole_word_spans(out, batch)
  span_correct = correct_spans(out["starts"], out["ends"], batch["gold_starts"],
                               batch["gold_ends"])                                  # [B, R, N]
  span_correct &= span_valid & beam_mask[:, :r, None]
  losses = reader_losses(beam_logits, has_answer, span_logits, span_correct)
  loss = jnp.sum(losses["retriever_loss"] + losses["reader_loss"])
  flat_correct = span_correct.reshape(b, -1)
  best = jnp.argmax(span_logits.reshape(b, -1), axis=-1)                           # [B]
  hit = jnp.take_along_axis(flat_correct, best[:, None], axis=-1)[:, 0]
  f32 = lambda x: jnp.sum(x.astype(jnp.float32))
  return loss, {
      "loss_sum": loss,
      "retriever_loss_sum": jnp.sum(losses["retriever_loss"]),
      "reader_loss_sum": jnp.sum(losses["reader_loss"]),
      "questions": jnp.asarray(b, jnp.float32),
      "has_answer": f32(jnp.any(has_answer, axis=-1)),
      "answer_in_read": f32(jnp.any(flat_correct, axis=-1)),
      "reader_correct": f32(hit),
  }


def summarize_qa(sums: dict) -> dict[str, float]:
  """Per-question averages from summed statistics (one step's, or several added together)."""
  n = max(float(sums["questions"]), 1.0)
  out = {
      "loss": float(sums["loss_sum"]) / n,
      "retriever_loss": float(sums["retriever_loss_sum"]) / n,
      "reader_loss": float(sums["reader_loss_sum"]) / n,
      "answer_in_beam": float(sums["has_answer"]) / n,
      "answer_in_read": float(sums["answer_in_read"]) / n,
      "reader_em_proxy": float(sums["reader_correct"]) / n,
  }
  for k in ("grad_norm", "skipped"):
    if k in sums:
      out[k] = float(sums[k])
  return out


def qa_train_step(state: TrainState, batch: dict, rng: Array, *,
                  models: QaModels, dropout: bool = True) -> tuple[TrainState, dict]:
  """One AdamW update of the question tower and the reader; pure, so it jits with the state
  donated. `state.params` = `qa_params(...)`. A non-finite step changes nothing and reports
  `skipped` = 1 (`guarded_update`)."""
  return loss_step(state, lambda p, r: qa_loss(p, batch, models, r), rng, dropout)


def qa_eval_step(params, batch: dict, *, models: QaModels) -> dict:
  """Summed statistics without dropout or update (dev evaluation)."""
  return qa_loss(params, batch, models)[1]
