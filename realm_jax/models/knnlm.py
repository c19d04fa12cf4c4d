"""kNN-LM (Khandelwal et al. 2020, "Generalization through memorization"): the next-token
distribution of the k nearest training contexts, and its interpolation with the LM's.

    p_kNN(y | x) = sum over neighbours i with value v_i = y of softmax_i(-d_i / T)
    p(y | x)     = lambda p_kNN(y | x) + (1 - lambda) p_LM(y | x)

d_i is the squared L2 distance between the query (the LM's context representation at x: the input
of the last feed-forward block after its LayerNorm) and neighbour i's key, v_i the token that
followed that training context, T a temperature (the paper: 1). Pure functions of arrays (jnp;
numpy inputs work too); the datastore and its search are realm_jax/retrieval/datastore.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def neighbour_log_weights(distances: Array, temperature: float | Array = 1.0) -> Array:
  """log softmax_i(-d_i / T) over the neighbours: distances [Q, k] -> [Q, k] float32."""
  return jax.nn.log_softmax(-jnp.asarray(distances, jnp.float32) / temperature, axis=-1)


def knn_probs(distances: Array, values: Array, vocab_size: int,
              temperature: float | Array = 1.0) -> Array:
  """p_kNN over the whole vocabulary: distances [Q, k], values [Q, k] int -> [Q, V] float32
  (each row sums to 1; a token no neighbour holds gets 0)."""
  weights = jnp.exp(neighbour_log_weights(distances, temperature))  # [Q, k]
  rows = jnp.arange(weights.shape[0])[:, None]
  return jnp.zeros((weights.shape[0], vocab_size), jnp.float32).at[rows, values].add(weights)


def knn_log_prob(distances: Array, values: Array, targets: Array,
                 temperature: float | Array = 1.0) -> Array:
  """log p_kNN(target): distances, values [Q, k], targets [Q] -> [Q] float32; -inf where no
  neighbour holds the target. Summed in log space, so a target whose neighbours all lie far
  away keeps a finite log-probability instead of underflowing to 0."""
  log_w = neighbour_log_weights(distances, temperature)
  hits = jnp.asarray(values) == jnp.asarray(targets)[:, None]
  return jax.nn.logsumexp(jnp.where(hits, log_w, -jnp.inf), axis=-1)


def interpolate(log_p_lm: Array, log_p_knn: Array, lam: float) -> Array:
  """log(lam p_kNN + (1 - lam) p_LM), elementwise, from the two log-probabilities.

  lam = 0 returns log_p_lm exactly and lam = 1 log_p_knn exactly; p_kNN = 0 (log -inf) leaves
  log(1 - lam) + log p_LM."""
  if not 0.0 <= lam <= 1.0:
    raise ValueError(f"lambda={lam!r}: the kNN weight must be between 0 and 1.")
  log_p_lm = jnp.asarray(log_p_lm, jnp.float32)
  log_p_knn = jnp.asarray(log_p_knn, jnp.float32)
  if lam == 0.0:
    return log_p_lm
  if lam == 1.0:
    return log_p_knn
  return jnp.logaddexp(jnp.log(lam) + log_p_knn, jnp.log1p(-lam) + log_p_lm)
