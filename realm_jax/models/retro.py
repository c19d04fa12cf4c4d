"""RETRO (Borgeaud et al. 2021) in Flax linen: a decoder whose chosen layers read retrieved
neighbours through chunked cross-attention (CCA), and the neighbour encoder. The decoder is of one
of two families (`RetroConfig.family`): GPT-2 (below) or Llama (realm_jax/models/llama.py:
rotary positions, RMSNorm, SwiGLU, grouped-query attention); CCA and the encoder attach to either.

    tokens [B, L] --wte+wpe--> h_0 ... h_{n-1} --ln_f--> logits [B, L, V] (tied to wte)
    a CCA layer:  x += attn(ln_1 x);  x += cca(ln_cca x, E);  x += mlp(ln_2 x)
    E = encoder(neighbours [B, C, K, R], x of the first CCA layer): computed once, reused

The sequence is C chunks of m tokens (L = C * m); chunk u retrieved K neighbours, each R = 2m
tokens (the neighbour chunk and its continuation). Causality: the attending chunk u is the
tokens u*m + m - 1 ... (u+1)*m + m - 2, so a token reads only the neighbours of chunks that are
complete at its position, and the first m - 1 tokens read none. Positions inside CCA and the
encoder are relative (a learned bias per head and distance), as the paper.

Without CCA layers (or called with `neighbours=None`) the model is a plain decoder, whose
parameter names are GPT-2's (`wte`, `wpe`, `h_3/attn/c_attn`, `ln_f`, ...) or, for Llama, HF's
projection names under the same layers (`h_3/attn/q_proj`, `h_3/mlp/gate_proj`): a Hugging Face
checkpoint loads by renaming (realm_jax/checkpoints/gpt2.py, llama.py). Parameters are float32; `dtype`
sets the compute dtype (LayerNorm statistics, softmaxes and the logits stay float32).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from realm_jax.models import flash, matmul
from realm_jax.models.llama import GroupedQueryAttention, RMSNorm, SwiGLU
from realm_jax.models.partitioning import batch_split

Array = jax.Array
_NEG = -1e9  # masked attention scores: far below any real one, finite in bfloat16 too


@dataclasses.dataclass(frozen=True)
class RetroConfig:
  """Shapes of a RETRO decoder. `cca_layers` are 1-based decoder layers (the paper: 6, 9, 12,
  ...); empty = the baseline decoder, without CCA or encoder."""
  vocab_size: int
  num_layers: int = 12
  hidden_size: int = 768
  num_heads: int = 12
  mlp_size: int = 3072
  max_length: int = 1024
  chunk_length: int = 64
  cca_layers: tuple[int, ...] = ()
  encoder_layers: int = 2
  encoder_size: int = 0          # the neighbour encoder's width (0: hidden_size); paper: 896
  num_neighbours: int = 2
  pad_id: int = 0
  layer_norm_eps: float = 1e-5
  dropout: float = 0.0
  dtype: str = "float32"
  remat: bool = False
  initializer_range: float = 0.02
  # The decoder family: "gpt2" (learned positions, LayerNorm, GELU, fused attention) or "llama"
  # (rotary positions, RMSNorm, SwiGLU, grouped-query attention: realm_jax/models/llama.py).
  family: str = "gpt2"
  num_kv_heads: int = 0          # llama: key/value heads (0: num_heads)
  head_dim: int = 0              # llama: width of a head (0: hidden_size / num_heads)
  rope_theta: float = 10_000.0
  rope_scaling: tuple = ()       # HF's rope_scaling as sorted (key, value) pairs; () none
  tie_embeddings: bool = True    # llama: the output embedding is wte (else `lm_head`)
  attention_bias: bool = False   # llama: q/k/v projections with biases (Qwen2; Llama's option)
  attention_out_bias: bool = False  # llama: o_proj with a bias too (Llama's attention_bias)
  sliding_window: int = 0        # llama: a token reads at most this many (0: all; Mistral)
  zero_init_cca: bool = False    # CCA's output projection starts at 0: a RETROfit starts as
                                 # exactly the pre-trained decoder
  encoder_input_norm: bool = False  # LayerNorm the neighbour encoder's input (the word
                                 # embeddings, projected): a pre-trained decoder's embeddings are
                                 # small beside what the encoder's layers add (docs/retro.md)
  attention: str = "dense"       # the decoder's self-attention: "dense" (softmax over [L, L]
                                 # scores) | "flash" (one fused TPU kernel: models/flash.py)
  cca_memory: str = "encoder"    # what CCA reads: "encoder" (the paper's neighbour encoder) |
                                 # "decoder" (llama: the decoder's own states of the neighbour
                                 # text at the CCA's layer, read by an attention shaped like the
                                 # layer's own, which a RETROfit starts as a copy of: no encoder)

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"Unknown decoder family {self.family!r}: use one of {FAMILIES}.")
    if self.attention not in flash.ATTENTION:
      raise ValueError(f"Unknown attention {self.attention!r}: use one of {flash.ATTENTION}.")
    if self.cca_memory not in CCA_MEMORY:
      raise ValueError(f"Unknown cca_memory {self.cca_memory!r}: use one of {CCA_MEMORY}.")
    if self.cca_memory == "decoder" and self.family != "llama":
      raise ValueError("cca_memory='decoder' needs the llama family (its CCA is shaped like the "
                       f"layer's grouped-query attention); family is {self.family!r}.")
    if self.attention == "flash" and self.sliding_window:
      raise ValueError(f"attention='flash' has no sliding window (sliding_window="
                       f"{self.sliding_window}): use attention='dense'.")
    if self.num_heads % self.kv_heads:
      raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                       f"{self.kv_heads}.")
    bad = [l for l in self.cca_layers if not 1 <= l <= self.num_layers]
    if bad:
      raise ValueError(f"CCA layers {bad} are outside the decoder's layers 1..{self.num_layers}.")
    for name in ("hidden_size", "encoder_width")[self.family == "llama":]:
      if getattr(self, name) % self.num_heads:
        raise ValueError(f"{name} {getattr(self, name)} is not divisible by num_heads "
                         f"{self.num_heads}.")

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def encoder_width(self) -> int:
    return self.encoder_size or self.hidden_size

  @property
  def retrieval(self) -> bool:
    return bool(self.cca_layers)

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def attention_head_dim(self) -> int:
    return self.head_dim or self.hidden_size // self.num_heads


FAMILIES = ("gpt2", "llama")
CCA_MEMORY = ("encoder", "decoder")


def cca_layers(num_layers: int, start: int = 6, every: int = 3) -> tuple[int, ...]:
  """The paper's CCA layers: every `every`-th layer from layer `start` (1-based), e.g. 12 layers
  -> (6, 9, 12); a decoder shallower than `start` gets CCA in its last layer."""
  layers = tuple(range(start, num_layers + 1, every))
  return layers or (num_layers,)


def _dense(c: RetroConfig, features: int, name: str) -> nn.Dense:
  return matmul.Dense(features, dtype=c.compute_dtype, param_dtype=jnp.float32,
                      kernel_init=nn.initializers.normal(c.initializer_range), name=name)


def _layer_norm(c: RetroConfig, name: str) -> nn.LayerNorm:
  return nn.LayerNorm(epsilon=c.layer_norm_eps, dtype=jnp.float32, param_dtype=jnp.float32,
                      name=name)


def _decoder_norm(c: RetroConfig, name: str) -> nn.Module:
  """The decoder's own normalisation (ln_1, ln_2, ln_cca, ln_f): GPT-2's LayerNorm or Llama's
  RMSNorm; the neighbour encoder keeps LayerNorm in both families."""
  return RMSNorm(c.layer_norm_eps, name=name) if c.family == "llama" else _layer_norm(c, name)


def token_positions(length: int, segments: Array | None) -> Array:
  """Each token's position within its document: [B, L] (0 at each change of `segments`), or
  [1, L] = 0 .. L - 1 without segments."""
  places = jnp.arange(length)
  if segments is None:
    return places[None]
  starts = jnp.concatenate([jnp.ones_like(segments[:, :1], bool),
                            segments[:, 1:] != segments[:, :-1]], axis=1)
  return places - jax.lax.cummax(jnp.where(starts, places, 0), axis=1)


def attention_mask(length: int, segments: Array | None, sliding_window: int = 0) -> Array:
  """Which keys each query reads: [B or 1, L, L] bool. Causal; with `segments` [B, L] (each
  token's document, -1 padding) only keys of the query's own document; with `sliding_window`
  only the last that many."""
  q, k = jnp.arange(length)[:, None], jnp.arange(length)[None, :]
  allowed = k <= q
  if sliding_window:
    allowed &= q - k < sliding_window
  allowed = allowed[None]
  if segments is not None:
    allowed = allowed & (segments[:, :, None] == segments[:, None, :])
  return allowed


def _gelu(x: Array) -> Array:
  return jax.nn.gelu(x, approximate=True)  # GPT-2's gelu_new


def _attend(q: Array, k: Array, v: Array, bias: Array) -> Array:
  """q [..., N, Q, Dh], k/v [..., N, K, Dh], bias broadcastable to [..., N, Q, K]
  -> [..., N, Q, Dh].
  Scores and softmax in float32."""
  q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  scores = jnp.einsum("...nqd,...nkd->...nqk", q, k).astype(jnp.float32) + bias
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("...nqk,...nkd->...nqd", probs, v)


def _heads(x: Array, n: int) -> Array:
  """[..., T, H] -> [..., N, T, H / N]."""
  x = x.reshape(*x.shape[:-1], n, x.shape[-1] // n)
  return jnp.moveaxis(x, -2, -3)


def _merge(x: Array) -> Array:
  """[..., N, T, Dh] -> [..., T, N * Dh]."""
  x = jnp.moveaxis(x, -3, -2)
  return x.reshape(*x.shape[:-2], -1)


class RelativeBias(nn.Module):
  """A learned bias per head for each key - query offset in [-max_back, max_ahead] (clipped):
  [Q] query and [K] key positions -> [N, Q, K] float32."""
  num_heads: int
  max_back: int
  max_ahead: int

  @nn.compact
  def __call__(self, q_pos: Array, k_pos: Array) -> Array:
    table = self.param("table", nn.initializers.zeros,
                       (self.max_back + self.max_ahead + 1, self.num_heads), jnp.float32)
    offset = jnp.clip(k_pos[None, :] - q_pos[:, None], -self.max_back, self.max_ahead)
    return jnp.moveaxis(table[offset + self.max_back], -1, 0)


class CausalSelfAttention(nn.Module):
  """GPT-2's attention: fused `c_attn` [H, 3H], `c_proj`."""
  config: RetroConfig

  @nn.compact
  def __call__(self, x: Array, allowed: Array | None, segments: Array | None,
               deterministic: bool) -> Array:
    """x [B, L, H], allowed [B or 1, L, L] (`attention_mask`; None with flash attention, which
    reads `segments` [B, L] or None) -> [B, L, H]."""
    c = self.config
    q, k, v = jnp.split(_dense(c, 3 * c.hidden_size, "c_attn")(x), 3, axis=-1)
    q, k, v = (_heads(t, c.num_heads) for t in (q, k, v))            # [B, N, L, Dh]
    if c.attention == "flash" and allowed is None:  # as the Llama attention decides
      ctx = _merge(flash.attend(q, k, v, segments))
    else:
      ctx = _merge(_attend(q, k, v, jnp.where(allowed[:, None], 0.0, _NEG)))   # [B, L, H]
    out = _dense(c, c.hidden_size, "c_proj")(ctx)
    return nn.Dropout(c.dropout)(out, deterministic=deterministic)


class Mlp(nn.Module):
  """GPT-2's feed-forward block (`width` 0: the decoder's, mlp_size wide; else width -> 4 width)."""
  config: RetroConfig
  width: int = 0

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    c = self.config
    width, inner = (self.width, 4 * self.width) if self.width else (c.hidden_size, c.mlp_size)
    out = _dense(c, width, "c_proj")(_gelu(_dense(c, inner, "c_fc")(x)))
    return nn.Dropout(c.dropout)(out, deterministic=deterministic)


class CrossAttention(nn.Module):
  """Queries from x [..., Q, H], keys and values from `memory` [..., K, H], a key mask [..., K]
  and a relative bias [N, Q, K], projected to `width`; the output has x's width. A query whose
  keys are all masked gets 0."""
  config: RetroConfig
  width: int
  zero_out: bool = False  # the output projection starts at 0

  @nn.compact
  def __call__(self, x: Array, memory: Array, key_mask: Array, bias: Array) -> Array:
    c = self.config
    q = _heads(_dense(c, self.width, "query")(x), c.num_heads)
    k, v = jnp.split(_dense(c, 2 * self.width, "key_value")(memory), 2, axis=-1)
    k, v = _heads(k, c.num_heads), _heads(v, c.num_heads)
    mask = key_mask[..., None, None, :]                               # [..., 1, 1, K]
    ctx = _merge(_attend(q, k, v, bias + jnp.where(mask, 0.0, _NEG)))    # [..., Q, H]
    init = nn.initializers.zeros if self.zero_out else nn.initializers.normal(c.initializer_range)
    out = matmul.Dense(x.shape[-1], dtype=c.compute_dtype, param_dtype=jnp.float32,
                       kernel_init=init, name="out")(ctx)
    return jnp.where(key_mask.any(-1)[..., None, None], out, 0)


class EncoderLayer(nn.Module):
  """A neighbour's tokens attend to each other (bidirectional), then to the activations of the
  chunk that retrieved them, then a feed-forward block; pre-LayerNorm residuals."""
  config: RetroConfig

  @nn.compact
  def __call__(self, x: Array, mask: Array, chunk: Array, deterministic: bool) -> Array:
    """x [B, C, K, R, H], mask [B, C, K, R], chunk [B, C, m, H] -> [B, C, K, R, H]."""
    c = self.config
    r, m = x.shape[-2], chunk.shape[-2]
    pos_r, pos_m = jnp.arange(r), jnp.arange(m)
    self_bias = RelativeBias(c.num_heads, r - 1, r - 1, name="self_bias")(pos_r, pos_r)
    h = _layer_norm(c, "ln_1")(x).astype(x.dtype)
    w = c.encoder_width
    x = x + CrossAttention(c, w, name="self_attn")(h, h, mask, self_bias)
    # The chunk's keys and values are computed once and shared by its K neighbours.
    cross_bias = RelativeBias(c.num_heads, r - 1, m - 1, name="cross_bias")(pos_r, pos_m)
    chunk = _layer_norm(c, "ln_chunk")(chunk).astype(x.dtype)[:, :, None]   # [B, C, 1, m, H]
    h = _layer_norm(c, "ln_2")(x).astype(x.dtype)
    x = x + CrossAttention(c, w, name="cross_attn")(h, chunk, jnp.ones(chunk.shape[:-1], bool),
                                                 cross_bias)
    return x + Mlp(c, w, name="mlp")(_layer_norm(c, "ln_3")(x).astype(x.dtype), deterministic)


class NeighbourEncoder(nn.Module):
  """Embeds the retrieved neighbours (the decoder's word embeddings, no absolute positions),
  conditioned on the chunk that retrieved each: [B, C, K, R] tokens -> [B, C, K, R, H]."""
  config: RetroConfig

  @nn.compact
  def __call__(self, embedded: Array, mask: Array, chunks: Array, deterministic: bool) -> Array:
    """embedded [B, C, K, R, H] (word embeddings of the neighbours), mask [B, C, K, R],
    chunks [B, C, m, H] (decoder activations of each retrieving chunk)."""
    c = self.config
    x = embedded
    if c.encoder_width != c.hidden_size:
      x = _dense(c, c.encoder_width, "project")(x)
    if c.encoder_input_norm:
      x = _layer_norm(c, "ln_in")(x).astype(c.compute_dtype)
    layer = nn.remat(EncoderLayer, static_argnums=(4,)) if c.remat else EncoderLayer
    for i in range(c.encoder_layers):
      x = layer(c, name=f"layer_{i}")(x, mask, chunks, deterministic)
    return _layer_norm(c, "ln_f")(x).astype(c.compute_dtype)


class ChunkedCrossAttention(nn.Module):
  """x [B, L, H] attends the encoded neighbours E [B, C, K, R, H] (mask [B, C, K, R]) chunk by
  chunk, shifted by m - 1: token t (t >= m - 1) reads the neighbours of chunk (t - m + 1) // m,
  the last chunk complete at t; tokens 0 .. m - 2 get 0. With `segments` [B, L] (each token's
  document), a token reads only the neighbours of a chunk of its own document. Returns [B, L, H]."""
  config: RetroConfig

  @nn.compact
  def __call__(self, x: Array, encoded: Array, mask: Array, segments: Array | None = None,
               deterministic: bool = True) -> Array:
    c = self.config
    b, length, h = x.shape
    m, (num_chunks, k, r) = c.chunk_length, encoded.shape[1:4]
    # Attending chunks: drop the first m - 1 tokens, pad the end back to C whole chunks.
    shifted = jnp.pad(x[:, m - 1:], ((0, 0), (0, m - 1), (0, 0)))
    queries = shifted.reshape(b, num_chunks, m, h)                     # [B, C, m, H]
    memory = encoded.reshape(b, num_chunks, k * r, -1)                 # [B, C, K*R, He]
    key_mask = mask.reshape(b, num_chunks, k * r)
    if c.cca_memory == "decoder":
      # The layer's own kind of attention over the decoder's states of the neighbours, each
      # neighbour placed just before the attending chunk (rotary positions 0..R-1, the queries
      # R..R+m-1), as if it were earlier text of the same sequence.
      attend = GroupedQueryAttention(c, zero_out=c.zero_init_cca, name="attn")
      allowed = key_mask.reshape(b * num_chunks, 1, k * r)         # the same for every query
      out = attend(queries.reshape(b * num_chunks, m, h), allowed, r + jnp.arange(m)[None],
                   None, True, memory=memory.reshape(b * num_chunks, k * r, -1),
                   memory_positions=jnp.tile(jnp.arange(r), k)[None])
      out = out.reshape(b, num_chunks, m, h)
      out = jnp.where(key_mask.any(-1)[..., None, None], out, 0)
    else:
      # Offsets within a neighbour (its token j against the query's place i in its chunk),
      # the same for each of the K neighbours laid side by side.
      bias = RelativeBias(c.num_heads, m - 1, r - 1, name="bias")(jnp.arange(m), jnp.arange(r))
      bias = jnp.tile(bias, (1, 1, k))                                 # [N, m, K*R]
      out = CrossAttention(c, c.hidden_size, zero_out=c.zero_init_cca, name="attn")(
          queries, memory, key_mask, bias)                             # [B, C, m, H]
    if segments is not None:
      query_docs = jnp.pad(segments[:, m - 1:], ((0, 0), (0, m - 1)), constant_values=-1)
      own = query_docs.reshape(b, num_chunks, m) == segments[:, ::m, None]    # [B, C, m]
      out = jnp.where(own[..., None], out, 0)
    out = out.reshape(b, num_chunks * m, h)[:, :length - (m - 1)]
    out = jnp.pad(out, ((0, 0), (m - 1, 0), (0, 0)))
    return nn.Dropout(c.dropout)(out, deterministic=deterministic)


class DecoderBlock(nn.Module):
  """The decoder family's block (GPT-2's or Llama's, pre-norm residuals), with CCA between
  attention and feed-forward when `cca`. The first CCA block (`encode`) also runs the neighbour
  encoder on its activations. Returns (x, encoded neighbours, the feed-forward block's normalised
  input)."""
  config: RetroConfig
  cca: bool = False
  encode: bool = False

  @nn.compact
  def __call__(self, x: Array, allowed: Array, positions: Array, segments: Array | None,
               neighbours: Array | None, mask: Array | None, encoded: Array | None,
               deterministic: bool):
    """x [B, L, H]; allowed [B or 1, L, L] (`attention_mask`); positions [B or 1, L] (within
    each document, `token_positions`); segments [B, L] or None; neighbours: their word
    embeddings [B, C, K, R, H] (with `cca_memory == "decoder"`: the decoder's states of them at
    this layer's input) and mask [B, C, K, R]."""
    c = self.config
    ln_1 = _decoder_norm(c, "ln_1")
    h = ln_1(x).astype(x.dtype)
    if c.family == "llama":
      x = x + GroupedQueryAttention(c, name="attn")(h, allowed, positions, segments, deterministic)
    else:
      x = x + CausalSelfAttention(c, name="attn")(h, allowed, segments, deterministic)
    if self.cca and neighbours is not None:
      b, length, h = x.shape
      if c.cca_memory == "decoder":   # `neighbours`: the decoder's states of them at this layer
        encoded = ln_1(neighbours).astype(x.dtype)
      elif self.encode:
        chunks = x.reshape(b, length // c.chunk_length, c.chunk_length, h)
        encoded = NeighbourEncoder(c, name="encoder")(neighbours, mask, chunks, deterministic)
      x = x + ChunkedCrossAttention(c, name="cca")(
          _decoder_norm(c, "ln_cca")(x).astype(x.dtype), encoded, mask, segments, deterministic)
    ffn_in = _decoder_norm(c, "ln_2")(x).astype(x.dtype)
    mlp = (SwiGLU if c.family == "llama" else Mlp)(c, name="mlp")
    return x + mlp(ffn_in, deterministic), encoded, ffn_in


class RetroModel(nn.Module):
  """The decoder: tokens [B, L] (+ neighbours [B, C, K, R], C = L / m) -> logits [B, L, V]."""
  config: RetroConfig

  @nn.compact
  def __call__(self, tokens: Array, neighbours: Array | None = None,
               deterministic: bool = True, return_hidden: bool = False,
               segments: Array | None = None):
    """Next-token logits (float32) for every position of `tokens` [B, L].

    neighbours: [B, C, K, R] token ids, C = L / m chunks, K neighbours of R tokens each; pad_id
      marks padding. None: no retrieval (the same model with its CCA layers skipped).
    return_hidden: also return the input of the last feed-forward block after its LayerNorm
      (RMSNorm for llama), [B, L, H] (kNN-LM's keys).
    segments: [B, L] int, each token's document (-1: padding), or None: one document. A token
      attends only to tokens, and reads only neighbours of chunks, of its own document.
    """
    c = self.config
    length = tokens.shape[-1]
    if length > c.max_length:
      raise ValueError(f"A sequence of {length} tokens is longer than the model's context of "
                       f"{c.max_length} (max_length).")
    if neighbours is not None and c.retrieval:
      if length % c.chunk_length:
        raise ValueError(f"With retrieval the sequence length ({length}) must be a multiple of "
                         f"the chunk length {c.chunk_length}.")
      want = (tokens.shape[0], length // c.chunk_length)
      if neighbours.ndim != 4 or neighbours.shape[:2] != want:
        raise ValueError(f"neighbours must be [B, C, K, R] with [B, C] = {list(want)}; got "
                         f"{list(neighbours.shape)}.")
    init = nn.initializers.normal(c.initializer_range)
    wte = nn.Embed(c.vocab_size, c.hidden_size, dtype=c.compute_dtype, param_dtype=jnp.float32,
                   embedding_init=init, name="wte")
    # An id past the vocabulary is padding (a tokenizer without a spare special token pads with
    # it, text/lm_tokenizer.py): masked everywhere, embedded as id 0 so that nothing is NaN.
    in_vocab = lambda ids: jnp.where(ids < c.vocab_size, ids, 0)
    x = wte(in_vocab(tokens))
    positions = token_positions(length, segments)                     # [B or 1, L]
    if c.family == "gpt2":
      x = x + nn.Embed(c.max_length, c.hidden_size, dtype=c.compute_dtype,
                       param_dtype=jnp.float32, embedding_init=init, name="wpe")(positions)
    x = nn.Dropout(c.dropout)(x, deterministic=deterministic)
    embedded = mask = None
    if neighbours is not None and c.retrieval:
      embedded, mask = wte(in_vocab(neighbours)), neighbours != c.pad_id   # [B, C, K, R, H]
      embedded = batch_split(embedded)
    allowed = (None if c.attention == "flash"
               else attention_mask(length, segments, c.sliding_window))
    block = nn.remat(DecoderBlock, static_argnums=(8,)) if c.remat else DecoderBlock
    encoded, first = None, min(c.cca_layers, default=0)
    x = batch_split(x)
    states = None
    if embedded is not None and c.cca_memory == "decoder":
      # Each neighbour (its chunk and continuation) is a sequence of its own through the
      # decoder's layers, up to the input of the last CCA layer, with the dense attention
      # (`state_allowed` given: its padding masked) under `attention="flash"` too: its 2m
      # tokens need not fill the kernel's blocks.
      b, chunks, k, r, h = embedded.shape
      states = batch_split(embedded.reshape(b * chunks * k, r, h))
      state_allowed = (jnp.tril(jnp.ones((r, r), bool))[None]
                       & mask.reshape(b * chunks * k, 1, r))
      state_positions = jnp.arange(r)[None]
    for i in range(c.num_layers):
      layer = block(c, cca=i + 1 in c.cca_layers, encode=i + 1 == first, name=f"h_{i}")
      read = embedded
      if states is not None:
        read = states.reshape(embedded.shape)
        if i + 1 < max(c.cca_layers):
          states = batch_split(layer(states, state_allowed, state_positions, None, None, None,
                                     None, deterministic)[0])
      x, encoded, hidden = layer(x, allowed, positions, segments, read, mask, encoded,
                                 deterministic)
      x = batch_split(x)  # (the layers' weights are gathered, not the batch: partitioning.py)
      encoded = None if encoded is None else batch_split(encoded)
    x = _decoder_norm(c, "ln_f")(x).astype(c.compute_dtype)
    if c.tie_embeddings:
      logits = matmul.attend(x, wte.embedding.astype(c.compute_dtype))
    else:
      logits = matmul.Dense(c.vocab_size, use_bias=False, dtype=c.compute_dtype,
                            param_dtype=jnp.float32, kernel_init=init, name="lm_head")(x)
    logits = logits.astype(jnp.float32)
    return (logits, hidden) if return_hidden else logits


def token_nll(logits: Array, targets: Array) -> Array:
  """-log p(target) per position: logits [..., V] float32, targets [...] int -> [...] float32.
  A target outside the vocabulary (the padding id of a tokenizer without a spare special token)
  gets a finite value of no meaning: the caller masks it."""
  logits = logits.astype(jnp.float32)
  targets = jnp.where(targets < logits.shape[-1], targets, 0)
  # log-sum-exp minus the target's logit, both taken from the row's maximum (exact for logits far
  # from 0), rather than log_softmax's row picked: the same value, and on XLA:CPU a [B, L, V]
  # log_softmax's gradient took 2.1 s where this takes 1.4 (SmolLM2's output layer, B 8 x 256).
  top = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return jnp.log(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1)) - (picked - top)


def neighbour_shape(config: RetroConfig, length: int) -> tuple[int, int, int]:
  """(C, K, R) of the neighbours of a sequence of `length` tokens."""
  return length // config.chunk_length, config.num_neighbours, 2 * config.chunk_length
