"""BERT encoder in Flax linen, laid out like the Hugging Face / original TF1 BERT.

Parameter paths mirror the HF names (`embeddings/word_embeddings`, `encoder/layer_3/attention/self/query`,
`pooler/dense`, ...), so checkpoint conversion is a renaming plus kernel transposes.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from realm_jax.models import matmul
from realm_jax.models.config import RealmConfig
from realm_jax.models.dropout import Dropout, Rows
from realm_jax.models.partitioning import batch_split

Array = jax.Array


def activation(name: str):
  """BERT activations: `gelu_new` is the tanh approximation (REALM), `gelu` the exact erf form."""
  return {
      "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
      "gelu": functools.partial(jax.nn.gelu, approximate=False),
      "relu": jax.nn.relu,
  }[name]


def _kernel_init(config: RealmConfig):
  return nn.initializers.normal(stddev=config.initializer_range)


def dense(config: RealmConfig, features: int, name: str) -> nn.Dense:
  return matmul.Dense(features, dtype=config.compute_dtype, param_dtype=jnp.float32,
                      kernel_init=_kernel_init(config), name=name)


def layer_norm(eps: float, name: str) -> nn.LayerNorm:
  # Statistics in float32 whatever the compute dtype.
  return nn.LayerNorm(epsilon=eps, dtype=jnp.float32, param_dtype=jnp.float32, name=name)


class BertEmbeddings(nn.Module):
  config: RealmConfig

  def setup(self):
    c = self.config
    embed = functools.partial(nn.Embed, features=c.hidden_size, dtype=c.compute_dtype,
                              param_dtype=jnp.float32, embedding_init=_kernel_init(c))
    self.word_embeddings = embed(c.vocab_size)
    self.position_embeddings = embed(c.max_position_embeddings)
    self.token_type_embeddings = embed(c.type_vocab_size)
    self.LayerNorm = layer_norm(c.layer_norm_eps, "LayerNorm")
    self.dropout = Dropout(c.hidden_dropout_prob)

  def __call__(self, input_ids: Array, token_type_ids: Array, deterministic: bool,
               rows: Rows | None = None) -> Array:
    seq_len = input_ids.shape[-1]
    positions = jnp.arange(seq_len)
    x = (self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
         + self.position_embeddings(positions))
    x = self.LayerNorm(x).astype(self.config.compute_dtype)
    return self.dropout(x, deterministic, rows)


@jax.custom_vjp
def softmax_bf16_backward(x: Array) -> Array:
  """jax.nn.softmax over the last axis (float32), whose backward keeps the probabilities in
  bfloat16 instead of float32: with bfloat16 compute the context matmul reads them in bfloat16
  anyway, and the backward's reads of the float32 [B, N, L, L] probabilities were a fifth of the
  TPU step's traffic (REALM's paper step on a v5e: 80.49 -> 76.95 GiB, 110 -> 101 ms, the
  compiler's estimates; docs/tpu.md). The gradient is y * (g - sum(g * y)) with y rounded to
  bfloat16 (a relative error of 2^-9 in y); the forward is unchanged."""
  return jax.nn.softmax(x, axis=-1)


def _softmax_bf16_forward(x):
  y = jax.nn.softmax(x, axis=-1)
  return y, y.astype(jnp.bfloat16)


def _softmax_bf16_gradient(kept, g):
  y = kept.astype(jnp.float32)
  return ((y * (g - jnp.sum(g * y, axis=-1, keepdims=True))).astype(g.dtype),)


softmax_bf16_backward.defvjp(_softmax_bf16_forward, _softmax_bf16_gradient)


class BertSelfAttention(nn.Module):
  config: RealmConfig

  @nn.compact
  def __call__(self, x: Array, mask_bias: Array, deterministic: bool,
               rows: Rows | None = None) -> Array:
    """x [B, L, H], mask_bias [B, 1, 1, L] -> [B, L, H]."""
    c = self.config
    heads, head_dim = c.num_attention_heads, c.hidden_size // c.num_attention_heads
    # Head-major [B, N, L, Dh] before the attention matmuls: on XLA:CPU this halves their cost
    # compared with contracting the [B, L, N, Dh] layout directly.
    split = lambda t: t.reshape(*t.shape[:-1], heads, head_dim).transpose(0, 2, 1, 3)
    q = split(dense(c, c.hidden_size, "query")(x))
    k = split(dense(c, c.hidden_size, "key")(x))
    v = split(dense(c, c.hidden_size, "value")(x))
    q = q / jnp.sqrt(head_dim).astype(q.dtype)
    scores = jnp.einsum("bnqd,bnkd->bnqk", q, k).astype(jnp.float32)  # [B, N, Lq, Lk]
    probs = (jax.nn.softmax(scores + mask_bias, axis=-1) if c.dtype == "float32"
             else softmax_bf16_backward(scores + mask_bias))
    probs = Dropout(c.attention_probs_dropout_prob)(probs, deterministic, rows)
    ctx = jnp.einsum("bnqk,bnkd->bnqd", probs.astype(v.dtype), v)   # [B, N, Lq, Dh]
    return ctx.transpose(0, 2, 1, 3).reshape(*x.shape[:-1], c.hidden_size)


class BertOutput(nn.Module):
  """dense -> dropout -> LayerNorm(. + residual): HF's `*.output` blocks."""
  config: RealmConfig
  features: int

  @nn.compact
  def __call__(self, x: Array, residual: Array, deterministic: bool,
               rows: Rows | None = None) -> Array:
    c = self.config
    x = Dropout(c.hidden_dropout_prob)(dense(c, self.features, "dense")(x), deterministic, rows)
    return layer_norm(c.layer_norm_eps, "LayerNorm")(x + residual).astype(c.compute_dtype)


class BertAttention(nn.Module):
  config: RealmConfig

  @nn.compact
  def __call__(self, x: Array, mask_bias: Array, deterministic: bool,
               rows: Rows | None = None) -> Array:
    ctx = BertSelfAttention(self.config, name="self")(x, mask_bias, deterministic, rows)
    return BertOutput(self.config, self.config.hidden_size, name="output")(ctx, x, deterministic,
                                                                          rows)


class BertIntermediate(nn.Module):
  config: RealmConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    c = self.config
    return activation(c.hidden_act)(dense(c, c.intermediate_size, "dense")(x))


class BertLayer(nn.Module):
  config: RealmConfig

  @nn.compact
  def __call__(self, x: Array, mask_bias: Array, deterministic: bool,
               rows: Rows | None = None) -> Array:
    c = self.config
    x = BertAttention(c, name="attention")(x, mask_bias, deterministic, rows)
    h = BertIntermediate(c, name="intermediate")(x)
    return BertOutput(c, c.hidden_size, name="output")(h, x, deterministic, rows)


class BertEncoder(nn.Module):
  config: RealmConfig

  @nn.compact
  def __call__(self, x: Array, mask_bias: Array, deterministic: bool,
               rows: Rows | None = None) -> Array:
    # static_argnums counts `self`: `deterministic` is argument 3 and picks the code path.
    layer = nn.remat(BertLayer, static_argnums=(3,)) if self.config.remat else BertLayer
    for i in range(self.config.num_hidden_layers):
      x = batch_split(layer(self.config, name=f"layer_{i}")(x, mask_bias, deterministic, rows))
    return x


class BertPooler(nn.Module):
  config: RealmConfig

  @nn.compact
  def __call__(self, sequence: Array) -> Array:
    return jnp.tanh(dense(self.config, self.config.hidden_size, "dense")(sequence[..., 0, :]))


def num_chunks(rows: int, seq_len: int, chunk_tokens: int) -> int:
  """How many chunks of rows a BERT call over [rows, seq_len] runs in: the fewest that divide
  `rows` and hold at most `chunk_tokens` tokens each (one row at least); 1 when chunk_tokens is 0."""
  if chunk_tokens <= 0 or rows * seq_len <= chunk_tokens:
    return 1
  n = min(rows, -(-rows * seq_len // chunk_tokens))
  while rows % n:
    n += 1
  return n


def attention_bias(attention_mask: Array) -> Array:
  """[..., L] 0/1 mask -> additive bias [..., 1, 1, L] (HF convention: (1 - m) * finfo.min)."""
  m = attention_mask.astype(jnp.float32)
  return ((1.0 - m) * jnp.finfo(jnp.float32).min)[..., None, None, :]


class BertModel(nn.Module):
  """BERT: returns (sequence_output [..., L, H], pooled_output [..., H] or None).

  Inputs may have any number of leading batch dimensions ([B, L], [B, K, L], ...).
  `attention_mask` is 1 for real tokens and 0 for padding; `token_type_ids` are segment ids.
  `dropout_rows`: the inputs are these rows of a larger batch (rows of the leading dimension, or
  of the leading dimensions flattened): dropout drops what it drops there
  (realm_jax/models/dropout.py).
  """
  config: RealmConfig
  add_pooling_layer: bool = True

  def setup(self):
    self.embeddings = BertEmbeddings(self.config)
    self.encoder = BertEncoder(self.config)
    if self.add_pooling_layer:
      self.pooler = BertPooler(self.config)

  def __call__(self, input_ids: Array, attention_mask: Array | None = None,
               token_type_ids: Array | None = None, deterministic: bool = True,
               dropout_rows: Rows | None = None):
    if input_ids.shape[-1] > self.config.max_position_embeddings:
      raise ValueError(
          f"Input length {input_ids.shape[-1]} exceeds max_position_embeddings="
          f"{self.config.max_position_embeddings}; truncate the inputs (join_bert's max_length).")
    if attention_mask is None:
      attention_mask = jnp.ones_like(input_ids)
    if token_type_ids is None:
      token_type_ids = jnp.zeros_like(input_ids)
    lead, seq_len = input_ids.shape[:-1], input_ids.shape[-1]
    ids, types, mask = (t.reshape(-1, seq_len) for t in (input_ids, token_type_ids, attention_mask))
    rows = ids.shape[0]
    n = num_chunks(rows, seq_len, self.config.chunk_tokens)
    if dropout_rows is not None and dropout_rows.ids.shape[0] != rows:
      dropout_rows = dropout_rows.of_groups(rows // dropout_rows.ids.shape[0])
    if dropout_rows is not None and n > 1 and not deterministic:
      # Each chunk draws its own dropout keys, which a part of the batch cannot reproduce.
      raise ValueError("Dropout on some rows of a batch (a step in pieces) does not combine with "
                       "chunk_tokens: set chunk_tokens=0 (the pieces keep the calls small).")
    trunk = lambda i, t, m, r: self.encoder(self.embeddings(i, t, deterministic, r),
                                            attention_bias(m), deterministic, r)
    if n == 1:
      x = trunk(ids, types, mask, dropout_rows)
    else:
      # Chunk c holds rows c, c + n, c + 2n, ...: a batch sharded along its rows keeps that
      # sharding in every chunk (when each device's rows split evenly into the n chunks), so no
      # chunk moves data between devices.
      part = lambda t, c: t.reshape(rows // n, n, seq_len)[:, c]
      part_rows = lambda c: None if dropout_rows is None else dropout_rows.strided(n, c)
      x = jnp.stack([trunk(part(ids, c), part(types, c), part(mask, c), part_rows(c))
                     for c in range(n)], axis=1)
      x = x.reshape(rows, seq_len, -1)
    pooled = self.pooler(x) if self.add_pooling_layer else None
    x = x.reshape(*lead, seq_len, -1)
    if pooled is not None:
      pooled = pooled.reshape(*lead, -1)
    return x, pooled

  def attend(self, hidden: Array) -> Array:
    """Logits over the vocabulary with the word-embedding matrix (tied MLM decoder)."""
    table = self.embeddings.word_embeddings.embedding
    dtype = self.config.compute_dtype
    return matmul.attend(hidden.astype(dtype), table.astype(dtype))


def mean_pool(sequence: Array, attention_mask: Array) -> Array:
  """Mean of the token vectors over non-padding positions (sentence-transformers pooling)."""
  m = attention_mask.astype(jnp.float32)[..., None]
  total = jnp.sum(sequence.astype(jnp.float32) * m, axis=-2)
  return total / jnp.maximum(jnp.sum(m, axis=-2), 1e-9)
