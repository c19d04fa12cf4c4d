"""The retriever trainers' steps: the in-batch softmax losses of ICT (realm_jax/train/ict.py) and
DPR (realm_jax/train/dpr.py) over the two towers of realm_jax/train/two_towers.py, and their pure
AdamW steps, which the trainers jit with the state donated and experiments/compile_for.py compiles
for a TPU slice."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from realm_jax.models.retriever import RealmRetriever
from realm_jax.train.realm_step import TrainState, loss_step
from realm_jax.train.two_towers import embed, in_batch_metrics

Array = jax.Array


# ------------------------------------------------------------------------------------------- ICT
def ict_loss(params, batch: dict, model: RealmRetriever, dropout_rng: Array | None = None,
             score_scale: float = 1.0):
  """In-batch softmax loss of a batch {"query" [B, Lq], "document" [B, Ld]}: (loss, metrics), the
  logits being score_scale x the inner products (1 for REALM's projected [CLS]; cosines of
  normalised mean pooling need a larger one).

  Under jit with the batch sharded over devices, B is the global batch: the [B, B] logits pair
  every query with the documents of every device (XLA gathers the [B, D] embeddings), which is
  ORQA's "negatives gathered across cores".
  """
  rq, rd = (None, None) if dropout_rng is None else jax.random.split(dropout_rng)
  q = embed(params, model, batch["query"], "embed_queries", rq)           # [B, D]
  d = embed(params, model, batch["document"], "embed_documents", rd)      # [B, D]
  return in_batch_metrics(score_scale * jnp.einsum("qd,kd->qk", q, d))     # [B, B]


def ict_step(state: TrainState, batch: dict, rng: Array, *, model: RealmRetriever,
             dropout: bool = True, score_scale: float = 1.0) -> tuple[TrainState, dict]:
  """One AdamW update on the ICT loss; pure, so it jits with the state donated.

  A step whose loss or gradient is not finite changes no parameter or optimiser moment (the step
  counter still advances) and reports `skipped` = 1.
  """
  return loss_step(state, lambda p, r: ict_loss(p, batch, model, r, score_scale), rng, dropout)


def ict_eval_step(params, batch: dict, *, model: RealmRetriever, score_scale: float = 1.0
                  ) -> dict:
  """In-batch metrics without dropout or update."""
  return ict_loss(params, batch, model, score_scale=score_scale)[1]


# ------------------------------------------------------------------------------------------- DPR
def passage_length(config) -> int:
  """Word pieces of a DPR passage input: config.passage_length, or (0) the index's max_length."""
  return config.passage_length or config.retrieval.max_length


def dpr_loss(params, batch: dict, model: RealmRetriever, score_scale: float,
             dropout_rng: Array | None = None):
  """In-batch softmax loss of {"question" [B, Lq], "positive" [B, Lp], "hard_negative" [B, Lp]}:
  (loss, metrics). Question i's label is passage i of the 2B passages [positives; hard
  negatives]. Under jit with the batch sharded over devices, B is the global batch: XLA gathers
  the [2B, D] passage embeddings of every device (DPR's cross-device in-batch negatives)."""
  rq, rp = (None, None) if dropout_rng is None else jax.random.split(dropout_rng)
  q = embed(params, model, batch["question"], "embed_queries", rq)                # [B, D]
  passages = {k: jnp.concatenate([batch["positive"][k], batch["hard_negative"][k]])
              for k in batch["positive"]}                                        # [2B, Lp]
  p = embed(params, model, passages, "embed_documents", rp)                      # [2B, D]
  return in_batch_metrics(score_scale * jnp.einsum("qd,pd->qp", q, p))            # [B, 2B]


def dpr_step(state: TrainState, batch: dict, rng: Array, *, model: RealmRetriever,
             score_scale: float, dropout: bool = True) -> tuple[TrainState, dict]:
  """One AdamW update on the DPR loss; pure, so it jits with the state donated. A step whose loss
  or gradient is not finite changes nothing and reports `skipped` = 1."""
  return loss_step(state, lambda p, r: dpr_loss(p, batch, model, score_scale, r), rng, dropout)


def dpr_eval_step(params, batch: dict, *, model: RealmRetriever, score_scale: float) -> dict:
  """In-batch metrics without dropout or update."""
  return dpr_loss(params, batch, model, score_scale)[1]
