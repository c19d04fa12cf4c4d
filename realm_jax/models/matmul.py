"""The models' weight products (`Dense` layers and a tied output embedding) with a backward pass
written out, so that the weight's gradient is one product contracting the inputs' leading axes.

    y = x @ w          x [..., H], w [H, F]        dx = g @ w.T,  dw = x^T g over all leading axes
    y = x @ table.T    x [..., H], table [V, H]    dx = g @ table, dtable = g^T x

The values are those of `lax.dot_general`'s own derivative (same products, same dtypes; tested
equal). What differs is the program XLA:CPU makes of it: from autodiff's transposes it laid the
weight gradient out as a product contracting axis 0 of one operand with axis 1 of the other, with
a transposed copy of the incoming gradient before it, which ran at under half its matmul speed
(2 AMD EPYC cores: 187 against 425 GFLOP/s; SmolLM2's SwiGLU block backward 154 -> 103 ms). Other
platforms get the same products.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
from jax import lax

Array = jax.Array


def _leading(x: Array) -> tuple[int, ...]:
  return tuple(range(x.ndim - 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _product(x: Array, w: Array, axis: int, precision) -> Array:
  """x [..., H] against the 2-D `w`'s axis `axis` (0: w is [H, F]; 1: w is [F, H])."""
  return lax.dot_general(x, w, (((x.ndim - 1,), (axis,)), ((), ())), precision=precision)


def _product_fwd(x, w, axis, precision):
  return _product(x, w, axis, precision), (x, w)


def _product_bwd(axis, precision, residuals, g):
  x, w = residuals
  dx = lax.dot_general(g, w, (((g.ndim - 1,), (1 - axis,)), ((), ())), precision=precision)
  # The weight's gradient: one product over every leading axis of x and g (the same axes).
  lead = _leading(x)
  dw = lax.dot_general(*((x, g) if axis == 0 else (g, x)), ((lead, lead), ((), ())),
                       precision=precision)
  return dx.astype(x.dtype), dw.astype(w.dtype)


_product.defvjp(_product_fwd, _product_bwd)


def linear(x: Array, w: Array, precision=None) -> Array:
  """x [..., H] @ w [H, F] -> [..., F]."""
  return _product(x, w, 0, precision)


def attend(x: Array, table: Array, precision=None) -> Array:
  """x [..., H] @ table [V, H].T -> [..., V]: scores against every row of an embedding table
  (a tied output layer)."""
  return _product(x, table, 1, precision)


def dense_dot_general(lhs: Array, rhs: Array, dimension_numbers, precision=None,
                      preferred_element_type=None) -> Array:
  """The product of `Dense` below: `linear` for Dense's own product (lhs's last axis
  against a 2-D kernel's first), `lax.dot_general` for anything else."""
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  if (tuple(lhs_contract) == (lhs.ndim - 1,) and tuple(rhs_contract) == (0,) and rhs.ndim == 2
      and not lhs_batch and not rhs_batch and preferred_element_type is None):
    return linear(lhs, rhs, precision)
  return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                         preferred_element_type=preferred_element_type)


# The models' Dense layer: flax's, with its product through `dense_dot_general`.
Dense = functools.partial(nn.Dense, dot_general=dense_dot_general)
