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
import optax

from realm_jax.models.dropout import Rows
from realm_jax.models.open_qa import QaModels, bert_inputs, qa_beam_logits, whole_word_spans
from realm_jax.models.reader import correct_spans, marginal_nll
from realm_jax.train import optimizer
from realm_jax.train.realm_step import TrainState, grads_step, join_pieces, split_pieces

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


_READER_KEYS = ("reader", "block_mask", "word_start", "word_end", "gold_starts", "gold_ends")


def reader_part(reader_params, read_logits: Array, batch: dict, models: QaModels,
                dropout_rng: Array | None = None, rows: Rows | None = None):
  """The reader's share of the loss: (sum over the batch's questions of their reader loss, sums).

  `read_logits` [B, R]: the retriever logits of the read blocks (part of each span's logit);
  `batch` holds the reader keys of `qa_loss`'s batch and `read_mask` [B, R] (real beam blocks).
  `rows`: these B questions are those rows of the step's batch (their dropout masks are theirs).
  Returns sums `reader_loss_sum`, `answer_in_read`, `reader_correct`.
  """
  b, r = batch["reader"]["input_ids"].shape[:2]
  out = models.reader.apply(
      {"params": frozen_span_offset(reader_params)}, *bert_inputs(batch["reader"]),
      batch["block_mask"], read_logits, dropout_rng is None,
      rngs=None if dropout_rng is None else {"dropout": dropout_rng}, dropout_rows=rows)
  span_logits, span_valid = whole_word_spans(out, batch)
  span_correct = correct_spans(out["starts"], out["ends"], batch["gold_starts"],
                               batch["gold_ends"])                                  # [B, R, N]
  span_correct &= span_valid & (batch["read_mask"][..., None] > 0)
  flat_logits, flat_correct = span_logits.reshape(b, -1), span_correct.reshape(b, -1)
  loss = jnp.sum(marginal_nll(flat_logits, flat_correct))
  best = jnp.argmax(flat_logits, axis=-1)                                          # [B]
  hit = jnp.take_along_axis(flat_correct, best[:, None], axis=-1)[:, 0]
  f32 = lambda x: jnp.sum(x.astype(jnp.float32))
  return loss, {"reader_loss_sum": loss, "answer_in_read": f32(jnp.any(flat_correct, axis=-1)),
                "reader_correct": f32(hit)}


def _reader_batch(batch: dict) -> dict:
  """What `reader_part` reads of a step's batch."""
  r = batch["reader"]["input_ids"].shape[1]
  return {**{k: batch[k] for k in _READER_KEYS if k in batch},
          "read_mask": batch["beam_mask"][:, :r]}


def _retriever_part(beam_logits: Array, batch: dict) -> tuple[Array, dict]:
  """(sum of the retriever losses, sums) from the beam's logits [B, Z]."""
  has_answer = (batch["beam_has_answer"] > 0) & (batch["beam_mask"] > 0)            # [B, Z]
  loss = jnp.sum(marginal_nll(beam_logits, has_answer))
  return loss, {"retriever_loss_sum": loss,
                "questions": jnp.asarray(beam_logits.shape[0], jnp.float32),
                "has_answer": jnp.sum(jnp.any(has_answer, axis=-1).astype(jnp.float32))}


def _check_read(batch: dict, beam: int) -> int:
  r = batch["reader"]["input_ids"].shape[1]
  if r > beam:
    raise ValueError(f"The batch has {r} read blocks per question but a beam of only "
                     f"{beam}; the read blocks must be the beam's first R <= Z.")
  return r


def _total(retriever: tuple[Array, dict], reader: tuple[Array, dict] | None) -> tuple[Array, dict]:
  zero = jnp.zeros((), jnp.float32)
  reader_loss, reader_sums = reader if reader is not None else (
      zero, {"reader_loss_sum": zero, "answer_in_read": zero, "reader_correct": zero})
  loss = retriever[0] + reader_loss
  return loss, {"loss_sum": loss, **retriever[1], **reader_sums}


def qa_loss(params, batch, models: QaModels, dropout_rng: Array | None = None):
  """Sum over the batch of each question's retriever + reader loss; dropout iff `dropout_rng`.

  A question without an answer in its beam adds 0 retriever loss (ORQA), and one without a gold
  span in its read blocks adds 0 reader loss (`marginal_nll` is 0 where nothing is correct, with a
  zero gradient). The loss is a sum, not a mean, so that a batch of B questions gives exactly the
  gradient of B batch-size-1 steps added together.

  Returns:
    (loss [], sums) with sums over the batch: `loss_sum`, `retriever_loss_sum`, `reader_loss_sum`,
    `questions`, `has_answer` (answer in the beam), `answer_in_read` (a gold span in the read
    blocks), `reader_correct` (the argmax span over all read blocks is gold: an EM proxy).
  """
  rngs = None if dropout_rng is None else jax.random.split(dropout_rng, 2)
  beam_logits = qa_beam_logits(params, batch, models, None if rngs is None else rngs[0])
  retriever = _retriever_part(beam_logits, batch)
  if "reader" not in batch:  # retriever-only batch: the question tower alone learns
    return _total(retriever, None)
  r = _check_read(batch, beam_logits.shape[1])
  reader = reader_part(params["reader"], beam_logits[:, :r], _reader_batch(batch), models,
                       None if rngs is None else rngs[1])
  return _total(retriever, reader)


def qa_loss_and_grads(params, batch, models: QaModels, dropout_rng: Array | None = None,
                      pieces: int = 1):
  """(qa_loss(...), its gradient), with the reader run on `pieces` parts of the batch in turn.

  The reader's activations are what fine-tuning's memory is made of (B x R blocks of L word pieces
  through a BERT, kept for the backward pass): in pieces, only one piece's are alive at a time, and
  its gradient is added up over the pieces (the loss is a sum over questions). Piece p holds the
  questions p, p + pieces, p + 2 pieces, ...: each device's questions split evenly into the pieces,
  so no piece moves data between devices. Dropout drops what it drops in the whole batch's call
  (realm_jax/models/dropout.py), so pieces change the result only by the order of the sums.
  Unlike pre-training's `piecewise_grads`, the question tower runs once over the whole batch (B
  short questions: little memory); the gradient its beam logits get from the pieces' reader losses
  is added to the retriever loss's and pulled back through it once.
  """
  if pieces == 1 or "reader" not in batch:
    return jax.value_and_grad(qa_loss, has_aux=True)(params, batch, models, dropout_rng)
  rngs = None if dropout_rng is None else jax.random.split(dropout_rng, 2)
  beam_logits, beam_vjp = jax.vjp(
      lambda p: qa_beam_logits({"query_tower": p}, batch, models,
                               None if rngs is None else rngs[0]), params["query_tower"])
  retriever, d_beam = jax.value_and_grad(_retriever_part, has_aux=True)(beam_logits, batch)
  b, r = beam_logits.shape[0], _check_read(batch, beam_logits.shape[1])
  xs = split_pieces((_reader_batch(batch), beam_logits[:, :r], jnp.arange(b, dtype=jnp.int32)),
                    pieces)
  grad_fn = jax.value_and_grad(reader_part, argnums=(0, 1), has_aux=True)

  def piece(acc, x):
    part, logits, ids = x
    (_, sums), (d_reader, d_logits) = grad_fn(params["reader"], logits, part, models,
                                              None if rngs is None else rngs[1], Rows(ids, b))
    return jax.tree.map(jnp.add, acc, (sums, d_reader)), d_logits

  zero = jnp.zeros((), jnp.float32)
  zeros = ({k: zero for k in ("reader_loss_sum", "answer_in_read", "reader_correct")},
           jax.tree.map(jnp.zeros_like, params["reader"]))
  (reader_sums, d_reader), d_read = jax.lax.scan(piece, zeros, xs)
  d_beam = d_beam.at[:, :r].add(join_pieces(d_read))
  (d_query,) = beam_vjp(d_beam)
  loss_and_sums = _total(retriever, (reader_sums["reader_loss_sum"], reader_sums))
  return loss_and_sums, {"query_tower": d_query, "reader": d_reader}


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


def qa_optimizer(config) -> tuple[dict, optax.GradientTransformation]:
  """({"query_tower", "reader"} schedules, AdamW): the question tower's BERT schedule runs over
  all config.num_steps; the reader's starts after the config.retriever_steps retriever-only steps
  (its own warmup, then linear decay to the end), each part clipped on its own."""
  if not 0 <= config.retriever_steps < config.num_steps:
    raise ValueError(f"--config.retriever_steps={config.retriever_steps} must be in [0, "
                     f"--config.num_steps={config.num_steps}).")
  warmup = None if config.warmup_steps < 0 else config.warmup_steps
  schedules = {
      "query_tower": optimizer.bert_schedule(config.learning_rate, config.num_steps, warmup),
      "reader": optimizer.delayed_schedule(config.learning_rate, config.num_steps,
                                           config.retriever_steps, warmup)}
  parts = {k: optimizer.adamw_with(v, config.weight_decay, clip_norm=config.clip_norm)
           for k, v in schedules.items()}
  labels = lambda params: {k: jax.tree.map(lambda _, k=k: k, v) for k, v in params.items()}
  return schedules, optax.multi_transform(parts, labels)


def qa_train_step(state: TrainState, batch: dict, rng: Array, *,
                  models: QaModels, dropout: bool = True,
                  pieces: int = 1) -> tuple[TrainState, dict]:
  """One AdamW update of the question tower and the reader; pure, so it jits with the state
  donated. `state.params` = `qa_params(...)`. The reader reads the batch in `pieces` parts
  (`qa_loss_and_grads`). A non-finite step changes nothing and reports `skipped` = 1
  (`guarded_update`)."""
  return grads_step(state, lambda p, r: qa_loss_and_grads(p, batch, models, r, pieces), rng,
                    dropout)


def qa_eval_step(params, batch: dict, *, models: QaModels) -> dict:
  """Summed statistics without dropout or update (dev evaluation)."""
  return qa_loss(params, batch, models)[1]
