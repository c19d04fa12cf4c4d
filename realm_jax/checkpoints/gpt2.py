"""Hugging Face GPT-2 checkpoints -> the decoder of `realm_jax.models.retro.RetroModel`.

    settings = decoder_settings(directory)          # RetroConfig fields, from config.json only
    model = RetroModel(RetroConfig(**settings, cca_layers=(6, 9, 12)))
    params = decoder.retrofit(model.init(rng, tokens, neighbours)["params"],
                              load_decoder(directory))     # realm_jax/checkpoints/decoder.py

A checkpoint is a local or gs:// directory with config.json and model.safetensors (e.g.
`GPT2LMHeadModel.from_pretrained("gpt2").save_pretrained(dir, safe_serialization=True)`), read
with safetensors only. The decoder's names are GPT-2's: HF key `transformer.h.3.attn.c_attn.weight`
is Flax path `h_3/attn/c_attn/kernel`, the same array (HF's Conv1D stores [in, out], as a Flax
Dense kernel); LayerNorm and embedding `weight`s are `scale` and `embedding`. The LM head is tied
to `wte`; the attention mask buffers (`attn.bias`, `attn.masked_bias`) are not parameters.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from realm_jax.checkpoints.hf import CheckpointError, read_config_json, read_state_dict
from realm_jax.io_utils import as_path
from realm_jax.models.retro import RetroConfig, RetroModel

WHAT = ("a Hugging Face GPT-2 checkpoint directory (config.json + model.safetensors, e.g. "
        "`GPT2LMHeadModel.from_pretrained('gpt2').save_pretrained(dir, safe_serialization=True)`)")
# What HF's GPT2Config takes for a key that config.json leaves out.
_HF_DEFAULTS = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                    n_inner=None, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                    scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                    reorder_and_upcast_attn=False, tie_word_embeddings=True)
# Options that change what the weights compute; RetroModel computes GPT-2's defaults only.
_REQUIRED = dict(activation_function="gelu_new", scale_attn_weights=True,
                 scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                 tie_word_embeddings=True)


def _hf_config(directory: str, flag: str) -> dict:
  """config.json of the checkpoint in `directory`, with HF's defaults filled in, after checking
  that the directory holds a GPT-2 whose weights RetroModel computes exactly."""
  config = read_config_json(directory, flag, WHAT)
  model_type = config.get("model_type")
  if model_type != "gpt2":
    raise CheckpointError(f"{flag}={directory} holds a {model_type!r} model (config.json's "
                          f"model_type), not a GPT-2: pass {WHAT}.")
  config = {**_HF_DEFAULTS, **config}
  for key, want in _REQUIRED.items():
    if config[key] != want:
      raise CheckpointError(
          f"{flag}={directory}: config.json has {key}={config[key]!r}, but the RETRO decoder "
          f"computes GPT-2 with {key}={want!r} only: pass a checkpoint that has it (gpt2, "
          "gpt2-medium, gpt2-large, gpt2-xl and distilgpt2 do).")
  return config


def decoder_settings(directory: str, flag: str = "--config.init") -> dict:
  """The RetroConfig fields that the GPT-2 in `directory` fixes, read from its config.json alone:
  vocab_size, num_layers, hidden_size, num_heads, mlp_size, max_length, layer_norm_eps.

  Raises (naming `flag` and `directory`, and saying what to pass):
    FileNotFoundError: no such directory, or no config.json or model.safetensors in it.
    CheckpointError (a ValueError): not a GPT-2 (model_type), or options that RetroModel does
      not compute (an activation other than gelu_new, scale_attn_by_inverse_layer_idx,
      reorder_and_upcast_attn, an untied LM head, unscaled attention).
  """
  c = _hf_config(directory, flag)
  return dict(vocab_size=c["vocab_size"], num_layers=c["n_layer"], hidden_size=c["n_embd"],
              num_heads=c["n_head"], mlp_size=c["n_inner"] or 4 * c["n_embd"],
              max_length=c["n_positions"], layer_norm_eps=c["layer_norm_epsilon"])


def _hf_key(path: tuple[str, ...], prefix: str) -> str:
  """Flax decoder path -> HF GPT-2 key: ("h_3", "attn", "c_attn", "kernel") ->
  prefix + "h.3.attn.c_attn.weight"."""
  parts = []
  for p in path[:-1]:
    m = re.fullmatch(r"h_(\d+)", p)
    parts += ["h", m.group(1)] if m else [p]
  leaf = "weight" if path[-1] in ("kernel", "scale", "embedding") else path[-1]
  return prefix + ".".join(parts + [leaf])


def _decoder_shapes(settings: dict) -> dict[tuple[str, ...], tuple[int, ...]]:
  """{Flax path: shape} of the decoder's parameters: those of the baseline RetroModel."""
  model = RetroModel(RetroConfig(**settings))
  tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
  return {k: v.shape for k, v in traverse_util.flatten_dict(shapes).items()}


def load_decoder(directory: str, flag: str = "--config.init") -> dict:
  """The GPT-2 in `directory` as RetroModel decoder parameters: a nested dict of numpy float32
  arrays, `wte/embedding` [V, H], `wpe/embedding` [P, H], `h_{i}/attn/c_attn/kernel` [H, 3H],
  `h_{i}/mlp/c_fc/kernel` [H, F], ..., `ln_f/{scale,bias}` [H] (the sizes of
  `decoder_settings(directory)`). The keys may carry the `transformer.` prefix
  (GPT2LMHeadModel's) or not (GPT2Model's).

  Raises the errors of `decoder_settings`, and a CheckpointError naming `flag` and the key when
  model.safetensors lacks an array, holds one of another shape than config.json implies, or has
  an LM head that is not `wte`.
  """
  settings = decoder_settings(directory, flag)
  try:
    state = read_state_dict(directory)
  except (CheckpointError, FileNotFoundError) as e:
    raise type(e)(f"{flag}={directory}: {e}") from None
  wte = [k for k in state if k in ("wte.weight", "transformer.wte.weight")]
  if not wte:
    sample = ", ".join(sorted(state)[:4]) or "(none)"
    raise CheckpointError(f"{flag}={directory}: model.safetensors has no GPT-2 word embeddings "
                          f"'transformer.wte.weight' (its arrays: {sample}, ...): pass {WHAT}.")
  prefix = wte[0][:-len("wte.weight")]
  head = state.get("lm_head.weight")
  if head is not None and not np.array_equal(head, state[wte[0]]):
    raise CheckpointError(f"{flag}={directory}: lm_head.weight differs from {wte[0]}, but the "
                          f"RETRO decoder ties its output embedding to the input one: pass {WHAT} "
                          "with tied embeddings.")
  flat = {}
  for path, shape in _decoder_shapes(settings).items():
    key = _hf_key(path, prefix)
    if key not in state:
      raise CheckpointError(f"{flag}={directory}: model.safetensors has no {key!r}, which a GPT-2 "
                            f"of {settings['num_layers']} layers (config.json's n_layer) needs: "
                            "keep the config.json saved with the weights.")
    if state[key].shape != shape:
      raise CheckpointError(f"{flag}={directory}: {key!r} has shape {tuple(state[key].shape)} in "
                            f"model.safetensors but config.json implies {shape}: the config.json "
                            "and the weights do not belong together; keep the config.json saved "
                            "with them.")
    flat[path] = np.ascontiguousarray(state[key], dtype=np.float32)
  return traverse_util.unflatten_dict(flat)


def tokenizer_file(directory: str) -> str | None:
  """The tokenizer.json saved beside the weights in `directory`, else None."""
  path = os.path.join(directory, "tokenizer.json")
  return path if as_path(path).exists() else None
