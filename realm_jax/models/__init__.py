"""Flax linen models of REALM: BERT, the retriever towers, the knowledge-augmented encoder, the reader."""

from realm_jax.models.bert import BertModel, mean_pool
from realm_jax.models.config import RealmConfig, tiny_config
from realm_jax.models.encoder import KnowledgeAugEncoder, marginal_mlm_loss, token_log_probs
from realm_jax.models.reader import RealmReader, correct_spans, reader_losses, span_candidates
from realm_jax.models.retriever import RealmEmbedder, RealmRetriever, relevance_scores

__all__ = [
    "BertModel", "KnowledgeAugEncoder", "RealmConfig", "RealmEmbedder", "RealmReader",
    "RealmRetriever", "correct_spans", "marginal_mlm_loss", "mean_pool", "reader_losses",
    "relevance_scores", "span_candidates", "tiny_config", "token_log_probs",
]
