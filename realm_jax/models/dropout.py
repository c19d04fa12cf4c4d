"""Dropout whose masks do not depend on how a batch is split into pieces.

A step that runs its batch in pieces (open-QA fine-tuning reads a few questions at a time to bound
its memory: realm_jax/train/qa_step.py) must drop the same units as the step over the whole batch,
or the pieces train another model. `Dropout` is `flax.linen.Dropout` (same key, same mask, same
scaling) and takes, in addition, `rows`: which rows of the whole batch its input holds. The mask of
those rows is computed from their positions in the whole batch, without making the whole batch's
mask.

jax draws the bits of `random.bernoulli(key, p, shape)` element by element from threefry2x32 of the
key and each element's flat index (`jax_threefry_partitionable`, the default since jax 0.5): the
bits of rows r of an [N, ...] batch are threefry of the flat indices r * prod(...) + 0, 1, ...
That is what `bernoulli_rows` computes; where jax draws otherwise (another PRNG, the flag off, more
than 2**32 elements), it draws the whole mask and takes the rows (same result, more memory).
tests/test_qa_microbatch.py checks both against `random.bernoulli` bit for bit.
"""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

Array = jax.Array


@flax.struct.dataclass
class Rows:
  """Rows `ids` ([n] int32, traced) of a batch of `total` rows (static)."""
  ids: Array
  total: int = flax.struct.field(pytree_node=False)

  def of_groups(self, per_row: int) -> "Rows":
    """The rows of the same batch flattened with `per_row` sub-rows each ([B, R, ...] read as
    [B * R, ...]): row i's sub-rows are i * per_row + 0 .. per_row - 1."""
    ids = (self.ids[:, None] * per_row + jnp.arange(per_row, dtype=self.ids.dtype)).reshape(-1)
    return Rows(ids, self.total * per_row)

  def strided(self, count: int, index: int) -> "Rows":
    """The rows of piece `index` of `count` strided pieces (rows index, index + count, ...)."""
    return Rows(self.ids.reshape(-1, count)[:, index], self.total)


def _counter_partitioned() -> bool:
  return bool(jax.config.jax_threefry_partitionable)


def bernoulli_rows(key: Array, p: float, shape: tuple[int, ...], rows: Rows) -> Array:
  """`jax.random.bernoulli(key, p, (rows.total, *shape[1:]))[rows.ids]`, shape `shape`."""
  if shape[0] != rows.ids.shape[0]:
    raise ValueError(f"Rows: {rows.ids.shape[0]} row ids for an input of {shape[0]} rows.")
  inner = int(np.prod(shape[1:], dtype=np.int64))
  typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
  threefry = str(jax.random.key_impl(key)) == "threefry2x32" if typed else key.shape == (2,)
  if not (threefry and _counter_partitioned() and rows.total * inner < 2**32):
    whole = jax.random.bernoulli(key, p, (rows.total, *shape[1:]))
    return jnp.take(whole, rows.ids, axis=0)
  data = jax.random.key_data(key) if typed else key
  k1, k2 = data[0], data[1]
  flat = (rows.ids.astype(jnp.uint32)[:, None] * np.uint32(inner)
          + jax.lax.iota(jnp.uint32, inner)[None, :]).reshape(shape)   # < 2**32: no carry
  bits1, bits2 = threefry2x32_p.bind(k1, k2, jnp.zeros_like(flat), flat)
  bits = bits1 ^ bits2
  # random.uniform's float32 from 32 bits: the 23 high bits as the mantissa of a float in [1, 2).
  one = np.array(1.0, np.float32).view(np.uint32)
  floats = jax.lax.bitcast_convert_type((bits >> np.uint32(9)) | one, jnp.float32) - 1.0
  return floats < jnp.asarray(p, jnp.float32)


class Dropout(nn.Module):
  """`flax.linen.Dropout(rate)` (the same rng stream and mask), for an input that may hold only
  some `rows` of the whole batch (then the mask those rows get in the whole batch's call)."""
  rate: float

  @nn.compact
  def __call__(self, x: Array, deterministic: bool, rows: Rows | None = None) -> Array:
    if self.rate == 0.0 or deterministic:
      return x
    if self.rate == 1.0:  # as flax: no division by a keep rate of 0
      return jnp.zeros_like(x)
    keep = 1.0 - self.rate
    key = self.make_rng("dropout")
    if rows is None:
      mask = jax.random.bernoulli(key, p=keep, shape=x.shape)
    else:
      mask = bernoulli_rows(key, keep, x.shape, rows)
    return jax.lax.select(mask, x / keep, jnp.zeros_like(x))
