"""The fused TPU attention kernel (models/flash.py), run on the CPU by Pallas' TPU interpreter:
the same logits and gradients as the dense attention, for both decoder families, with documents
packed in a sequence and padding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jit_init
from jax.experimental.pallas import tpu as pltpu

from realm_jax.models.retro import RetroConfig, RetroModel, token_nll

L, M = 256, 32  # two of the kernel's 128-token blocks; chunks of 32


def _segments():
  """Two sequences: three documents then padding (-1); one document throughout."""
  first = np.concatenate([np.full(100, 0), np.full(90, 1), np.full(40, 2), np.full(26, -1)])
  return jnp.asarray(np.stack([first, np.zeros(L, int)]), jnp.int32)


def _dense_then_flash(config, params, tokens, neighbours, segments=None):
  """The loss, logits and gradients of `config`'s model, dense, then flash (Pallas' TPU
  interpreter), checked equal: returns the flash logits."""
  def loss(p, c):
    logits = RetroModel(c).apply({"params": p}, tokens, neighbours, segments=segments)
    return token_nll(logits, jnp.roll(tokens, -1, 1)).mean(), logits

  step = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (want_loss, want), want_grad = step(params, config)
  with pltpu.force_tpu_interpret_mode():
    (got_loss, got), got_grad = step(params, dataclasses.replace(config, attention="flash"))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_grad),
                          jax.tree_util.tree_leaves(want_grad)):
    np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-4, err_msg=jax.tree_util.keystr(path))
  return got


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_flash_attention_equals_the_dense_softmax(family):
  config = RetroConfig(vocab_size=97, num_layers=1, hidden_size=32, num_heads=4, mlp_size=64,
                       max_length=L, chunk_length=M, cca_layers=(1,), encoder_layers=1,
                       family=family, num_kv_heads=2 if family == "llama" else 0, pad_id=96)
  flash = dataclasses.replace(config, attention="flash")
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 96, (2, L)), jnp.int32)
  neighbours = jnp.asarray(rng.integers(0, 97, (2, L // M, 2, 2 * M)), jnp.int32)
  segments = _segments()
  params = jit_init(RetroModel(config), 0, tokens, neighbours, segments=segments)
  got = _dense_then_flash(config, params, tokens, neighbours, segments)
  # A token of document 1 reads nothing of document 0: changing document 0 leaves it alone.
  other = tokens.at[0, :100].set((tokens[0, :100] + 1) % 96)
  with pltpu.force_tpu_interpret_mode():
    moved = jax.jit(RetroModel(flash).apply)({"params": params}, other, neighbours,
                                             segments=segments)
  np.testing.assert_allclose(moved[0, 100:190], got[0, 100:190], atol=1e-5)
  assert np.abs(moved[0, :100] - got[0, :100]).max() > 1e-3


def test_flash_attention_with_cca_reading_the_decoders_states_of_padded_neighbours():
  """`cca_memory="decoder"`: each neighbour runs through the decoder's layers as a sequence of
  its own, with the dense attention and its padding masked (its 2 x 16 tokens fill no kernel
  block); only the decoder's sequence is flash. Neighbours padded at their end and in the middle
  (id 96): the same logits and gradients as the dense model."""
  length, m = 128, 16
  config = RetroConfig(vocab_size=97, num_layers=2, hidden_size=32, num_heads=4, mlp_size=64,
                       max_length=length, chunk_length=m, cca_layers=(2,), family="llama",
                       num_kv_heads=2, pad_id=96, cca_memory="decoder")
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, 96, (1, length)), jnp.int32)
  neighbours = rng.integers(0, 96, (1, length // m, 2, 2 * m))
  neighbours[0, 0, 0, 20:] = 96          # a chunk without continuation
  neighbours[0, 1, 1, 5:9] = 96          # padding inside
  neighbours[0, 2, 0] = 96               # no neighbour at all
  neighbours = jnp.asarray(neighbours, jnp.int32)
  _dense_then_flash(config, jit_init(RetroModel(config), 0, tokens, neighbours), tokens,
                    neighbours)


def test_flash_attention_refuses_what_it_cannot_do():
  with pytest.raises(ValueError, match="sliding window"):
    RetroConfig(vocab_size=10, family="llama", attention="flash", sliding_window=16,
                hidden_size=32, num_heads=2)
  with pytest.raises(ValueError, match="Unknown attention"):
    RetroConfig(vocab_size=10, attention="splash", hidden_size=32, num_heads=2)
  config = RetroConfig(vocab_size=10, num_layers=1, hidden_size=32, num_heads=2, mlp_size=8,
                       max_length=320, attention="flash")
  tokens = jnp.zeros((1, 192), jnp.int32)   # not a multiple of the kernel's 128-token blocks
  with pytest.raises(ValueError, match="multiple of"):
    RetroModel(config).init(jax.random.key(0), tokens)

