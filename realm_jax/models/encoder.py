"""Knowledge-augmented encoder: masked LM over `[CLS] x [SEP] z [SEP]`, marginalised over z.

For each masked token t and candidates c = 1..K with retriever logits r:
  m_t  = logsumexp_c( log_softmax(r)[c] + log p(y_t | x, z_c) )
  loss = - sum_t m_t / (number of masked tokens)
which is the loss of the released REALM code and the HF port (not the paper's per-document product).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from realm_jax.models.bert import BertModel, activation, dense, layer_norm
from realm_jax.models.config import RealmConfig
from realm_jax.models.dropout import Rows

Array = jax.Array


class MLMTransform(nn.Module):
  config: RealmConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    c = self.config
    x = activation(c.hidden_act)(dense(c, c.hidden_size, "dense")(x))
    return layer_norm(c.layer_norm_eps, "LayerNorm")(x).astype(c.compute_dtype)


class MLMPredictions(nn.Module):
  """HF `cls.predictions`: transform, then the decoder tied to the word embeddings, plus a bias."""
  config: RealmConfig

  @nn.compact
  def __call__(self, hidden: Array, bert: BertModel) -> Array:
    x = MLMTransform(self.config, name="transform")(hidden)
    bias = self.param("bias", nn.initializers.zeros, (self.config.vocab_size,), jnp.float32)
    return bert.attend(x).astype(jnp.float32) + bias


class MLMHead(nn.Module):
  config: RealmConfig

  @nn.compact
  def __call__(self, hidden: Array, bert: BertModel) -> Array:
    return MLMPredictions(self.config, name="predictions")(hidden, bert)


class KnowledgeAugEncoder(nn.Module):
  """BERT + MLM head over the joint input of a query and each of its K candidates.

  Call with inputs [B, K, L] (or any leading dims). With `mlm_positions` [B, M], only the hidden
  states at those positions go through the vocabulary projection (REALM masks at most ~10 of 384
  tokens, so this saves most of the head's FLOPs and memory); logits are then [B, K, M, V],
  otherwise [B, K, L, V].
  """
  config: RealmConfig

  def setup(self):
    self.realm = BertModel(self.config, add_pooling_layer=True)
    self.cls = MLMHead(self.config)

  def __call__(self, input_ids: Array, attention_mask: Array, token_type_ids: Array,
               mlm_positions: Array | None = None, deterministic: bool = True,
               dropout_rows: Rows | None = None) -> Array:
    sequence, _ = self.realm(input_ids, attention_mask, token_type_ids, deterministic,
                             dropout_rows)
    if mlm_positions is not None:
      # sequence [B, K, L, H], positions [B, M] -> [B, K, M, H]
      idx = mlm_positions[:, None, :, None]
      sequence = jnp.take_along_axis(sequence, idx, axis=-2)
    return self.cls(sequence, self.realm)


def token_log_probs(mlm_logits: Array, targets: Array) -> Array:
  """log p(y_t | x, z_c): logits [B, K, M, V], targets [B, M] -> [B, K, M] (float32)."""
  logp = jax.nn.log_softmax(mlm_logits.astype(jnp.float32), axis=-1)
  safe = jnp.clip(targets, 0, mlm_logits.shape[-1] - 1)
  idx = jnp.broadcast_to(safe[:, None, :, None], (*logp.shape[:-1], 1))
  return jnp.take_along_axis(logp, idx, axis=-1)[..., 0]


def marginal_mlm_loss(mlm_logits: Array, targets: Array, target_mask: Array,
                      retriever_logits: Array) -> tuple[Array, dict[str, Array]]:
  """REALM's marginal log-likelihood loss over K retrieved candidates.

  Args:
    mlm_logits: [B, K, M, V] MLM logits at the M target positions for each candidate.
    targets: [B, M] gold token ids (any value where `target_mask` is 0).
    target_mask: [B, M] 1 for masked tokens that count, 0 for padding.
    retriever_logits: [B, K] relevance scores f(x, z_c).
  Returns:
    (loss [], aux) with aux = `candidate_log_probs` [B, K, M] (log p(y_t|x,z_c)),
    `retrieval_log_probs` [B, K] (log p(z_c|x)), `marginal_log_probs` [B, M] (m_t).
  """
  mask = target_mask.astype(jnp.float32)
  cand_logp = token_log_probs(mlm_logits, targets)                      # [B, K, M]
  retr_logp = jax.nn.log_softmax(retriever_logits.astype(jnp.float32))  # [B, K]
  marginal = jax.nn.logsumexp(retr_logp[:, :, None] + cand_logp, axis=1)  # [B, M]
  loss = -jnp.sum(marginal * mask) / jnp.maximum(jnp.sum(mask), 1.0)
  aux = dict(candidate_log_probs=cand_logp, retrieval_log_probs=retr_logp,
             marginal_log_probs=marginal)
  return loss, aux
