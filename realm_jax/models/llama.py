"""The Llama-family decoder block (Llama 2/3, Mistral, Qwen2, SmolLM2) for RETRO's one decoder
(realm_jax/models/retro.py, `RetroConfig.family == "llama"`).

    x += attn(ln_1 x)      grouped-query attention, rotary positions, optional q/k/v biases
    x += mlp(ln_2 x)       SwiGLU: down(silu(gate x) * up x)

with RMSNorm for ln_1 / ln_2 (and the CCA's ln_cca and the final ln_f). Parameter names are the
Hugging Face ones under RETRO's layer names: `h_3/attn/q_proj/kernel`, `h_3/mlp/gate_proj/kernel`,
`h_3/ln_1/scale` (checkpoints/llama.py maps them). Rotary positions use HF's convention (the two
halves of each head rotate together, `rotate_half`), so q/k weights are in HF's layout; llama.cpp's
interleaved layout is undone when a GGUF is read.

The modules read their sizes from a RetroConfig (`config`), which this file does not import.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from realm_jax.models import flash, matmul

Array = jax.Array


class RMSNorm(nn.Module):
  """x / rms(x) * scale, in float32 (HF's LlamaRMSNorm); returns float32."""
  eps: float = 1e-5

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
    return x * scale


def rope_frequencies(head_dim: int, theta: float, scaling: tuple = ()) -> Array:
  """The inverse frequencies [head_dim / 2] of rotary positions, with HF's `rope_scaling` (given
  as sorted (key, value) pairs): none, "linear" (positions / factor) or "llama3" (long
  wavelengths slowed by `factor`, short ones kept, a smooth ramp between)."""
  inv = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  s = dict(scaling)
  kind = s.get("rope_type", s.get("type", "default"))
  if kind == "linear":
    return inv / s["factor"]
  if kind == "llama3":
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv
    smooth = (old / wavelength - low) / (high - low)
    mid = (1 - smooth) * inv / factor + smooth * inv
    out = jnp.where(wavelength > old / low, inv / factor, inv)
    return jnp.where((wavelength <= old / low) & (wavelength >= old / high), mid, out)
  if kind != "default":
    raise ValueError(f"RoPE scaling {kind!r} is not supported (default, linear, llama3).")
  return inv


def apply_rope(x: Array, positions: Array, inv_freq: Array) -> Array:
  """x [..., T, Dh] rotated by `positions` [..., T] (broadcast against x's leading axes; HF's
  rotate_half convention), in float32, back in x's dtype."""
  angles = positions.astype(jnp.float32)[..., None] * inv_freq           # [..., T, Dh/2]
  cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)
  sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)
  xf = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], -1)
  return (xf * cos + rotated * sin).astype(x.dtype)


def _dense(c, features: int, name: str, bias: bool = False, zero: bool = False) -> nn.Dense:
  init = nn.initializers.zeros if zero else nn.initializers.normal(c.initializer_range)
  return matmul.Dense(features, use_bias=bias, dtype=c.compute_dtype, param_dtype=jnp.float32,
                      kernel_init=init, name=name)


class GroupedQueryAttention(nn.Module):
  """Causal self-attention with `num_kv_heads` key/value heads shared by groups of query heads.
  x [B, L, H], `allowed` [B or 1, L, L] bool (which keys each query may read), `positions`
  [B or 1, L] (rotary) -> [B, L, H].

  With `memory` [B, S, H] and its `memory_positions` [B or 1, S], the keys and values are the
  memory's (cross-attention; `allowed` [B or 1, L or 1, S]): RETRO's CCA reading the decoder's own
  states of the neighbours (`RetroConfig.cca_memory == "decoder"`)."""
  config: object
  zero_out: bool = False  # o_proj starts at 0

  @nn.compact
  def __call__(self, x: Array, allowed: Array | None, positions: Array, segments: Array | None,
               deterministic: bool, memory: Array | None = None,
               memory_positions: Array | None = None) -> Array:
    c = self.config
    b, length, _ = x.shape
    source, source_positions = (x, positions) if memory is None else (memory, memory_positions)
    s = source.shape[1]
    nq, nkv, dh = c.num_heads, c.kv_heads, c.attention_head_dim
    q = _dense(c, nq * dh, "q_proj", c.attention_bias)(x).reshape(b, length, nkv, nq // nkv, dh)
    k = _dense(c, nkv * dh, "k_proj", c.attention_bias)(source).reshape(b, s, nkv, dh)
    v = _dense(c, nkv * dh, "v_proj", c.attention_bias)(source).reshape(b, s, nkv, dh)
    inv_freq = rope_frequencies(dh, c.rope_theta, c.rope_scaling)
    q = apply_rope(jnp.moveaxis(q, 1, -2), positions[:, None, None], inv_freq)  # [B, Nkv, G, L, Dh]
    k = apply_rope(jnp.moveaxis(k, 1, -2), source_positions[:, None], inv_freq)  # [B, Nkv, S, Dh]
    v = jnp.moveaxis(v, 1, -2)
    # Flash where no mask is given (the decoder's sequence; query heads ordered (kv head,
    # group)); the dense softmax over `allowed` otherwise (CCA, the neighbours' states).
    if c.attention == "flash" and allowed is None:
      ctx = flash.attend(q.reshape(b, nq, length, dh), k, v, segments)     # [B, N, L, Dh]
      ctx = jnp.moveaxis(ctx, 1, 2).reshape(b, length, nq * dh)
    else:
      q = q / jnp.sqrt(dh).astype(q.dtype)
      scores = jnp.einsum("bhgqd,bhkd->bhgqk", q, k).astype(jnp.float32)
      scores = jnp.where(allowed[:, None, None], scores, -1e9)
      probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
      ctx = jnp.einsum("bhgqk,bhkd->bqhgd", probs, v).reshape(b, length, nq * dh)
    out = _dense(c, c.hidden_size, "o_proj", c.attention_out_bias, self.zero_out)(ctx)
    return nn.Dropout(c.dropout)(out, deterministic=deterministic)


class SwiGLU(nn.Module):
  """down(silu(gate x) * up x): [.., H] -> [.., H], mlp_size wide inside."""
  config: object

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    c = self.config
    h = jax.nn.silu(_dense(c, c.mlp_size, "gate_proj")(x)) * _dense(c, c.mlp_size, "up_proj")(x)
    out = _dense(c, c.hidden_size, "down_proj")(h)
    return nn.Dropout(c.dropout)(out, deterministic=deterministic)
