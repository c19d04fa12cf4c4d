"""Text processing: BERT WordPiece tokenisation, REALM's input layouts, answer matching."""

from realm_jax.text.tokenizer import (BertTokenizer, batch_join, checkpoint_lowercase,
                                      checkpoint_normalization, join_bert)

__all__ = ["BertTokenizer", "batch_join", "checkpoint_lowercase", "checkpoint_normalization",
           "join_bert"]
