"""The decoders' self-attention as one fused kernel on TPU (`RetroConfig.attention = "flash"`).

The dense attention of models/retro.py and models/llama.py writes every [L, L] score and
probability of every head to memory (float32), forward, recomputed and backward; on a TPU that
traffic, not the matmuls, sets the step time of 2,048-token sequences (docs/tpu.md). The Pallas
flash-attention kernel for TPU (`jax.experimental.pallas.ops.tpu.flash_attention`) computes the
same causal, document-masked softmax block by block in the chip's vector memory and never writes
the scores out. It is TPU code: on the CPU it runs only under `pltpu.force_tpu_interpret_mode()`
(the tests), and `experiments/compile_for.py` compiles it for a TPU topology.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash
from jax.sharding import PartitionSpec as P

from realm_jax.models.partitioning import BATCH_AXES

Array = jax.Array
ATTENTION = ("dense", "flash")
BLOCK = 128  # the kernel's tile along the sequence: its default, and its least on a TPU


def check(length: int) -> None:
  """ValueError unless a sequence of `length` tokens can use the kernel."""
  if length % BLOCK:
    raise ValueError(f"attention='flash' tiles the sequence in blocks of {BLOCK} tokens (the TPU "
                     f"kernel's least): a sequence of {length} is not a multiple of that; use "
                     "attention='dense'.")


def attend(q: Array, k: Array, v: Array, segments: Array | None) -> Array:
  """Causal attention, each token reading only its own document's earlier tokens.

  Traced under a mesh (sharding.traced_on), the kernel runs on each device's part: the batch
  split over the mesh's batch axes and the heads over `tensor` where they divide (XLA cannot
  split a custom kernel by itself).

  Args:
    q: [B, N, L, Dh] queries, not scaled.
    k, v: [B, Nkv, L, Dh] keys and values; Nkv divides N (grouped-query attention: query head
      h reads key/value head h // (N / Nkv)).
    segments: [B, L] int each token's document (-1: padding, which reads padding), or None.
  Returns:
    [B, N, L, Dh] in v's dtype.
  """
  check(q.shape[-2])
  group = q.shape[1] // k.shape[1]
  if group > 1:
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
  if segments is None:
    segments = jnp.zeros((q.shape[0], q.shape[2]), jnp.int32)
  k, v, segments = k.astype(q.dtype), v.astype(q.dtype), segments.astype(jnp.int32)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return _kernel(q, k, v, segments).astype(v.dtype)
  batch = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
  batch = batch if batch and q.shape[0] % math.prod(mesh.shape[a] for a in batch) == 0 else None
  heads = ("tensor" if "tensor" in mesh.axis_names and q.shape[1] % mesh.shape["tensor"] == 0
           else None)
  spec = P(batch, heads, None, None)
  out = jax.shard_map(_kernel, mesh=mesh, in_specs=(spec, spec, spec, P(batch, None)),
                      out_specs=spec, check_vma=False)(q, k, v, segments)
  return out.astype(v.dtype)


def _kernel(q: Array, k: Array, v: Array, segments: Array) -> Array:
  """The Pallas kernel on whole arrays (one device's part)."""
  b = BLOCK
  sizes = pallas_flash.BlockSizes(
      block_q=b, block_k_major=b, block_k=b, block_b=1, block_q_major_dkv=b, block_k_major_dkv=b,
      block_k_dkv=b, block_q_dkv=b, block_k_major_dq=b, block_k_dq=b, block_q_dq=b)
  return pallas_flash.flash_attention(
      q, k, v, segment_ids=pallas_flash.SegmentIds(q=segments, kv=segments), causal=True,
      sm_scale=float(q.shape[-1]) ** -0.5, block_sizes=sizes)
