"""REALM retriever: the query and document embedders and their relevance scores.

Embedder (REALM): BERT -> pooled [CLS] (dense + tanh) -> dense H->128 -> LayerNorm; no L2 norm.
Relevance f(x, z) = <Embed_query(x), Embed_doc(z)>, p(z|x) = softmax over the candidates.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from realm_jax.models.bert import BertModel, dense, layer_norm, mean_pool
from realm_jax.models.config import RealmConfig
from realm_jax.models.dropout import Rows

Array = jax.Array

POOLINGS = ("projected_cls", "mean")
NEG_INF = -1e9  # masked-out candidates: exp(-1e9) is 0 in float32, and 0 * -1e9 stays finite


class RealmProjection(nn.Module):
  """HF `cls`: dense H -> retriever_proj_size, then LayerNorm."""
  config: RealmConfig

  @nn.compact
  def __call__(self, pooled: Array) -> Array:
    c = self.config
    x = dense(c, c.retriever_proj_size, "dense")(pooled)
    return layer_norm(c.projection_layer_norm_eps, "LayerNorm")(x)


class RealmEmbedder(nn.Module):
  """One retriever tower: token ids [..., L] -> embeddings [..., D] in float32.

  pooling="projected_cls" is REALM's embedder (D = retriever_proj_size); pooling="mean" is the
  sentence-transformers mode of models such as all-MiniLM-L6-v2 (D = hidden_size, no projection
  parameters), optionally L2-normalised.
  """
  config: RealmConfig
  pooling: str = "projected_cls"
  normalize: bool = False

  def setup(self):
    if self.pooling not in POOLINGS:
      raise ValueError(f"pooling={self.pooling!r} is not supported; use one of {POOLINGS}.")
    self.realm = BertModel(self.config, add_pooling_layer=self.pooling == "projected_cls")
    if self.pooling == "projected_cls":
      self.cls = RealmProjection(self.config)

  def __call__(self, input_ids: Array, attention_mask: Array, token_type_ids: Array,
               deterministic: bool = True, dropout_rows: Rows | None = None) -> Array:
    sequence, pooled = self.realm(input_ids, attention_mask, token_type_ids, deterministic,
                                  dropout_rows)
    if self.pooling == "projected_cls":
      emb = self.cls(pooled)
    else:
      emb = mean_pool(sequence, attention_mask)
    emb = emb.astype(jnp.float32)
    if self.normalize:
      emb = emb / jnp.maximum(jnp.linalg.norm(emb, axis=-1, keepdims=True), 1e-12)
    return emb


def relevance_scores(query_emb: Array, candidate_emb: Array) -> Array:
  """Inner products: query [B, D], candidates [B, K, D] -> logits [B, K] (float32)."""
  return jnp.einsum("bd,bkd->bk", query_emb.astype(jnp.float32), candidate_emb.astype(jnp.float32))


class RealmRetriever(nn.Module):
  """Query and document towers: shared (REALM's default, HF `RealmScorer`) or separate.

  Parameters: `embedder` (the document tower, and the query tower when shared) and, when
  `share_embedders=False`, `query_embedder`. These are the HF `RealmScorer` names.

  `query_ignore_id` >= 0 (pre-training passes [MASK]): the query tower treats that token as padding,
  so a masked span's placeholders take no part in the query's attention or pooling and the query
  is the sentence without its span (no parameters change; the encoder still sees the [MASK]s).
  """
  config: RealmConfig
  share_embedders: bool = True
  pooling: str = "projected_cls"
  normalize: bool = False
  query_ignore_id: int = -1

  def setup(self):
    self.embedder = RealmEmbedder(self.config, self.pooling, self.normalize)
    if not self.share_embedders:
      self.query_embedder = RealmEmbedder(self.config, self.pooling, self.normalize)

  def embed_queries(self, input_ids, attention_mask, token_type_ids, deterministic=True,
                    dropout_rows: Rows | None = None) -> Array:
    tower = self.embedder if self.share_embedders else self.query_embedder
    if self.query_ignore_id >= 0:
      attention_mask = attention_mask * (input_ids != self.query_ignore_id).astype(
          attention_mask.dtype)
    return tower(input_ids, attention_mask, token_type_ids, deterministic, dropout_rows)

  def embed_documents(self, input_ids, attention_mask, token_type_ids, deterministic=True,
                      dropout_rows: Rows | None = None) -> Array:
    return self.embedder(input_ids, attention_mask, token_type_ids, deterministic, dropout_rows)

  def __call__(self, query: dict[str, Array], candidates: dict[str, Array],
               deterministic: bool = True):
    """Scores K candidates per query.

    Args:
      query: `input_ids`, `attention_mask`, `token_type_ids`, each [B, Lq].
      candidates: the same keys, each [B, K, Ld].
    Returns:
      (relevance [B, K], query embeddings [B, D], candidate embeddings [B, K, D]).
    """
    q = self.embed_queries(query["input_ids"], query["attention_mask"], query["token_type_ids"],
                           deterministic)
    z = self.embed_documents(candidates["input_ids"], candidates["attention_mask"],
                             candidates["token_type_ids"], deterministic)
    return relevance_scores(q, z), q, z
