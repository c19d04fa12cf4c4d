"""Model hyperparameters shared by every REALM tower.

One frozen dataclass for BERT and the REALM heads, field-for-field compatible with the Hugging Face
`RealmConfig` / `BertConfig` JSON so that a checkpoint's own config can be read as is.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp

from realm_jax.io_utils import as_path

ACTIVATIONS = ("gelu", "gelu_new", "relu")
COMPUTE_DTYPES = ("float32", "bfloat16")
RUN_TIME_FIELDS = ("dtype", "remat", "chunk_tokens")


@dataclasses.dataclass(frozen=True)
class RealmConfig:
  """BERT encoder plus REALM head sizes.

  Parameters are always stored in float32; `dtype` is the compute dtype of matmuls
  ("float32" or "bfloat16"). Softmaxes, LayerNorm statistics and losses stay in float32.
  """

  vocab_size: int = 30522
  hidden_size: int = 768
  num_hidden_layers: int = 12
  num_attention_heads: int = 12
  intermediate_size: int = 3072
  hidden_act: str = "gelu_new"
  hidden_dropout_prob: float = 0.1
  attention_probs_dropout_prob: float = 0.1
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  layer_norm_eps: float = 1e-12
  initializer_range: float = 0.02
  pad_token_id: int = 0
  # Retriever embedder: pooled [CLS] -> dense to `retriever_proj_size` -> LayerNorm.
  retriever_proj_size: int = 128
  # HF uses `layer_norm_eps` for this LayerNorm; ORQA's ICT checkpoints used 1e-3.
  retriever_layer_norm_eps: float | None = None
  # Reader span scorer.
  span_hidden_size: int = 256
  max_span_width: int = 10
  reader_layer_norm_eps: float = 1e-3
  dtype: str = "float32"
  # Recompute each transformer layer in the backward pass instead of keeping its activations
  # (jax.checkpoint): activation memory falls from ~(34 h + 5 a L) to ~2 h bytes per token and
  # layer, for ~1/3 more compute. A run-time choice, like dtype.
  remat: bool = False
  # Run each BERT call over at most this many tokens at a time (0: all at once): the rows are
  # split into interleaved chunks that run one after the other. On CPU, chunks of ~1-2k tokens
  # keep each layer's activations in cache: a MiniLM forward + backward over 64 x 128 tokens
  # took 15% less time in 8 chunks. On accelerators leave it 0. A run-time choice, like dtype.
  chunk_tokens: int = 0

  def __post_init__(self):
    if self.hidden_act not in ACTIVATIONS:
      raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; use one of {ACTIVATIONS}.")
    if self.dtype not in COMPUTE_DTYPES:
      raise ValueError(f"dtype={self.dtype!r} is not supported; use one of {COMPUTE_DTYPES}.")
    if self.hidden_size % self.num_attention_heads:
      raise ValueError(
          f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
          f"{self.num_attention_heads}.")
    if self.chunk_tokens < 0:
      raise ValueError(f"chunk_tokens={self.chunk_tokens} must be 0 (off) or positive.")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "intermediate_size", "max_position_embeddings", "retriever_proj_size"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name}={getattr(self, name)} must be positive.")

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def projection_layer_norm_eps(self) -> float:
    if self.retriever_layer_norm_eps is None:
      return self.layer_norm_eps
    return self.retriever_layer_norm_eps

  def replace(self, **changes) -> "RealmConfig":
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "RealmConfig":
    """Reads a HF `config.json` dict (REALM or BERT); unknown keys are ignored, except a
    `position_embedding_type` other than "absolute", which is refused.

    The compute `dtype`, `remat` and `chunk_tokens` are run-time choices, not properties of a
    checkpoint, so saved entries of those names are ignored too.
    """
    position = d.get("position_embedding_type") or "absolute"
    if position != "absolute":  # HF keeps relative ones in parameters this BERT would drop
      raise ValueError(
          f"position_embedding_type={position!r} is not supported: realm_jax's BERT has absolute "
          "position embeddings only. Use a checkpoint with absolute ones (BERT, REALM, MiniLM).")
    names = {f.name for f in dataclasses.fields(cls)} - set(RUN_TIME_FIELDS)
    return cls(**{k: v for k, v in d.items() if k in names})

  @classmethod
  def from_json_file(cls, path: str | os.PathLike) -> "RealmConfig":
    try:
      d = json.loads(as_path(path).read_bytes().decode("utf-8"))  # local or gs://
    except FileNotFoundError:
      raise FileNotFoundError(
          f"Model config {path} does not exist: pass the config.json that was saved with the "
          "checkpoint.") from None
    except json.JSONDecodeError as e:
      raise ValueError(f"Model config {path} is not valid JSON ({e}).") from None
    return cls.from_dict(d)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def tiny_config(**overrides) -> RealmConfig:
  """A model small enough for unit tests on a laptop CPU."""
  base = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
              intermediate_size=37, max_position_embeddings=64, retriever_proj_size=16,
              span_hidden_size=12, max_span_width=4)
  base.update(overrides)
  return RealmConfig(**base)
