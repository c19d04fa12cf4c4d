"""The open-QA model (ORQA / REALM fine-tuning): a question tower scores a beam of frozen document
embeddings, and the reader scores answer spans in the first R beam blocks. Pure forward functions,
shared by the fine-tuning step (realm_jax/train/qa_step.py: losses, updates) and by prediction
(realm_jax/systems/open_qa.py: answers with evidence).

Per question, with question embedding q and frozen beam embeddings z_1..z_Z:
  retriever logits  s_j = score_scale * <q, z_j>                      (masked beam slots: -1e9)
  span logits       the reader's span score + its block's s_j, over whole-word spans when the batch
                    says where words start and end

Batch keys read here (numpy on the host, or device arrays):
  question          {input_ids, attention_mask, token_type_ids}  [B, Lq]  [CLS] q [SEP]
  beam_embeddings   [B, Z, D] float32   frozen document embeddings of the retrieved beam
  beam_mask         [B, Z]   1 = a real beam block (0 pads a short beam)
  reader            {input_ids, attention_mask, token_type_ids}  [B, R, L]
                    [CLS] q [SEP] block [SEP] for beam blocks 0..R-1 (R <= Z)
  block_mask        [B, R, L] 1 on the block's tokens (spans must lie inside)
  word_start, word_end  (optional) [B, R, L] 1 where a span may start / end: whole words only
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from realm_jax.models.reader import RealmReader
from realm_jax.models.retriever import NEG_INF, RealmEmbedder, relevance_scores

Array = jax.Array
_SPAN_NEG = float(np.finfo(np.float32).min)  # as the reader: the logit of an impossible span


@dataclasses.dataclass(frozen=True)
class QaModels:
  """The trained modules of open-QA fine-tuning; params {"query_tower", "reader"}.

  score_scale multiplies the retriever scores, as in `RealmModels` (1 for REALM's projected [CLS]).
  """
  query_tower: RealmEmbedder
  reader: RealmReader
  score_scale: float = 1.0


def qa_params(retriever_params: dict, reader_params: dict) -> dict:
  """Trainable parameters from a `RealmRetriever`'s and a `RealmReader`'s.

  The question tower starts from `query_embedder` when the retriever has separate towers, else
  from the shared `embedder`. Its arrays are copied: the step donates its state, and the document
  tower that built the index must survive (and stay unchanged) even when the towers were shared.
  """
  tower = retriever_params.get("query_embedder", retriever_params["embedder"])
  return {"query_tower": jax.tree.map(jnp.array, tower), "reader": reader_params}


def bert_inputs(d: dict) -> tuple:
  """(input_ids, attention_mask, token_type_ids) of an input dict, in the modules' order."""
  return d["input_ids"], d["attention_mask"], d["token_type_ids"]


def qa_beam_logits(params, batch, models: QaModels, dropout_rng: Array | None = None) -> Array:
  """Fresh retriever logits [B, Z] of the whole beam; masked beam slots get -1e9."""
  q = models.query_tower.apply(
      {"params": params["query_tower"]}, *bert_inputs(batch["question"]), dropout_rng is None,
      rngs=None if dropout_rng is None else {"dropout": dropout_rng})                # [B, D]
  logits = models.score_scale * relevance_scores(q, batch["beam_embeddings"])       # [B, Z]
  return jnp.where(batch["beam_mask"] > 0, logits, NEG_INF)


def whole_word_spans(out: dict, batch: dict) -> tuple[Array, Array]:
  """(span logits, span valid) [B, R, N] of the reader's output, restricted to spans that start
  and end on whole words when the batch has `word_start` / `word_end` [B, R, L] (the data
  pipeline's; without them, every span inside the block counts)."""
  logits, valid = out["span_logits"], out["span_valid"]
  if "word_start" not in batch:
    return logits, valid
  ok = (jnp.take(batch["word_start"] > 0, out["starts"], axis=-1)
        & jnp.take(batch["word_end"] > 0, out["ends"], axis=-1))
  return jnp.where(ok, logits, _SPAN_NEG), valid & ok


def qa_predict_step(params, batch: dict, *, models: QaModels) -> dict:
  """The reader's best span per question and per read block (no dropout).

  `batch` holds `question`, `reader`, `block_mask` as in training, and `beam_embeddings` /
  `beam_mask` of just the R read blocks ([B, R, D], [B, R]).

  Returns:
    `best` [B] index of the best span over all R x N (block = best // N, span = best % N),
    `best_score` [B] its logit (span score + its block's retriever logit), `block_best` [B, R]
    and `block_score` [B, R] the best span of each block, `retriever_logits` [B, R].
  """
  logits = qa_beam_logits(params, batch, models)                                    # [B, R]
  out = models.reader.apply({"params": params["reader"]}, *bert_inputs(batch["reader"]),
                            batch["block_mask"], logits, True)
  span_logits = jnp.where(batch["beam_mask"][..., None] > 0, whole_word_spans(out, batch)[0],
                          NEG_INF)
  b = span_logits.shape[0]
  flat = span_logits.reshape(b, -1)
  best = jnp.argmax(flat, axis=-1)
  return {"best": best, "best_score": jnp.take_along_axis(flat, best[:, None], -1)[:, 0],
          "block_best": jnp.argmax(span_logits, axis=-1),
          "block_score": jnp.max(span_logits, axis=-1), "retriever_logits": logits}
