"""Llama-family checkpoints into the RETRO decoder (realm_jax/checkpoints/llama.py): tiny random
Hugging Face Llama, Mistral and Qwen2 directories, a GGUF file written here with llama.cpp's
rotary permutation, and the packaged SmolLM2 GGUF against transformers' own GGUF loader."""

import json
import os

import numpy as np
import pytest
from conftest import gguf_parsed_once, perturbed

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from realm_jax.checkpoints import decoder as decoders, llama  # noqa: E402
from realm_jax.checkpoints.hf import CheckpointError  # noqa: E402
from realm_jax.models.retro import RetroConfig, RetroModel  # noqa: E402

FLAG = "--config.test_init"
SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-5)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
# name: (config class, model class, options beyond SIZES)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(rope_theta=500_000.0, rope_scaling=LLAMA3, tie_word_embeddings=False)),
    "llama_tied_bias": ("LlamaConfig", "LlamaForCausalLM",
                        dict(tie_word_embeddings=True, attention_bias=True,
                             rope_scaling={"type": "linear", "factor": 2.0})),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(head_dim=12, sliding_window=16, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(tie_word_embeddings=True, rope_theta=1_000_000.0)),
}
WANT = {
    "llama": dict(head_dim=8, rope_theta=500_000.0, rope_scaling=tuple(sorted(LLAMA3.items())),
                  tie_embeddings=False, attention_bias=False, attention_out_bias=False,
                  sliding_window=0),
    "llama_tied_bias": dict(head_dim=8, rope_theta=10_000.0,
                            rope_scaling=(("factor", 2.0), ("rope_type", "linear")),
                            tie_embeddings=True, attention_bias=True, attention_out_bias=True,
                            sliding_window=0),
    "mistral": dict(head_dim=12, rope_theta=10_000.0, rope_scaling=(), tie_embeddings=False,
                    attention_bias=False, attention_out_bias=False, sliding_window=16),
    "qwen2": dict(head_dim=8, rope_theta=1_000_000.0, rope_scaling=(), tie_embeddings=True,
                  attention_bias=True, attention_out_bias=False, sliding_window=0),
}


def _hf_model(name):
  config_class, model_class, options = MODELS[name]
  torch.manual_seed(0)
  config = getattr(transformers, config_class)(**SIZES, **options)
  return perturbed(getattr(transformers, model_class)(config), seed=1)  # biases away from 0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """{name: (directory of the saved tiny model, its state dict as numpy)}."""
  out = {}
  for name in MODELS:
    model = _hf_model(name)
    directory = str(tmp_path_factory.mktemp(name))
    model.save_pretrained(directory, safe_serialization=True)
    out[name] = directory, {k: v.numpy() for k, v in model.state_dict().items()}
  return out


def _flat(tree, prefix=()):
  for k, v in tree.items():
    yield from _flat(v, prefix + (k,)) if isinstance(v, dict) else [(prefix + (k,), v)]


def _hf_key(path):
  """Flax decoder path -> HF key, written out independently of the module's table."""
  if path[0] == "wte":
    return "model.embed_tokens.weight"
  if path[0] == "ln_f":
    return "model.norm.weight"
  if path[0] == "lm_head":
    return "lm_head.weight"
  i = path[0][2:]
  norm = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm"}
  if path[1] in norm:
    return f"model.layers.{i}.{norm[path[1]]}.weight"
  block = "self_attn" if path[1] == "attn" else "mlp"
  return f"model.layers.{i}.{block}.{path[2]}.{'bias' if path[3] == 'bias' else 'weight'}"


def _assert_equal(decoder, state):
  """`decoder` holds exactly the arrays of HF `state` (kernels transposed), and all of them (an
  untied lm_head too; a tied one is wte)."""
  flat = dict(_flat(decoder))
  used = set()
  for path, value in flat.items():
    key = _hf_key(path)
    want = state[key].T if path[-1] == "kernel" else state[key]
    assert value.dtype == np.float32 and value.flags.c_contiguous, path
    np.testing.assert_array_equal(value, want, err_msg=str(path))
    used.add(key)
  assert set(state) - used <= {"lm_head.weight"}
  if "lm_head.weight" not in used:
    np.testing.assert_array_equal(state["lm_head.weight"], state["model.embed_tokens.weight"])


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_directories(checkpoints, name):
  directory, state = checkpoints[name]
  settings = llama.decoder_settings(directory, FLAG)
  assert settings == dict(family="llama", vocab_size=97, num_layers=2, hidden_size=32,
                          num_heads=4, num_kv_heads=2, mlp_size=48, max_length=64,
                          layer_norm_eps=1e-5, **WANT[name])
  assert llama.is_llama_source(directory)
  decoder = llama.load_decoder(directory, FLAG)
  _assert_equal(decoder, state)
  assert ("bias" in decoder["h_1"]["attn"]["k_proj"]) == settings["attention_bias"]
  assert ("lm_head" in decoder) == (not settings["tie_embeddings"])


def test_sharded_and_bare_keys(checkpoints, tmp_path):
  """A sharded index, and a LlamaModel's keys (without `model.`), load the same arrays; a bare
  model of untied embeddings has no LM head, which is refused."""
  directory, state = checkpoints["llama"]
  model = transformers.LlamaForCausalLM.from_pretrained(directory)
  model.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="20KB")
  assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
  _assert_equal(llama.load_decoder(str(tmp_path / "sharded"), FLAG), state)
  model.model.save_pretrained(tmp_path / "untied", safe_serialization=True)
  with pytest.raises(CheckpointError, match=rf"{FLAG}=.*untied: model.safetensors has no 'lm_head"):
    llama.load_decoder(str(tmp_path / "untied"), FLAG)
  directory, state = checkpoints["llama_tied_bias"]
  model = transformers.LlamaForCausalLM.from_pretrained(directory)
  model.model.save_pretrained(tmp_path / "bare", safe_serialization=True)
  _assert_equal(llama.load_decoder(str(tmp_path / "bare"), FLAG), state)


# llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute), written out here from its
# definition so that the module's inverse is checked against an independent forward permutation.
def _llama_cpp_permute(w, heads):
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
Q = gguf.GGMLQuantizationType


def _write_gguf(path, state, arch="llama", skip=(), sizes=SIZES):
  """A GGUF of the HF `state` as llama.cpp writes one: q and k permuted, q in F32, k in F16, the
  MLP's gate in Q8_0, the rest F32. Returns {HF key: the array as stored, dequantised}."""
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(sizes["num_hidden_layers"])
  w.add_context_length(sizes["max_position_embeddings"])
  w.add_embedding_length(sizes["hidden_size"])
  w.add_feed_forward_length(sizes["intermediate_size"])
  w.add_head_count(sizes["num_attention_heads"])
  w.add_head_count_kv(sizes["num_key_value_heads"])
  w.add_layer_norm_rms_eps(sizes["rms_norm_eps"])
  w.add_rope_freq_base(10_000.0)
  w.add_vocab_size(sizes["vocab_size"])
  stored = {}
  for key, value in state.items():
    if key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
      name = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
              "lm_head.weight": "output"}[key] + ".weight"
    else:
      _, _, i, *rest = key.split(".")
      name = f"blk.{i}.{GGUF_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"
    if name in skip:
      continue
    value = value.astype(np.float32)
    if ".attn_q." in name:
      value = _llama_cpp_permute(value, sizes["num_attention_heads"])
    if ".attn_k." in name:
      value = _llama_cpp_permute(value, sizes["num_key_value_heads"])
    if ".attn_k." in name:
      value = value.astype(np.float16)
      w.add_tensor(name, value)
      stored[key] = value.astype(np.float32)
    elif ".ffn_gate." in name:
      packed = gguf.quants.quantize(value, Q.Q8_0)
      w.add_tensor(name, packed, raw_dtype=Q.Q8_0)
      stored[key] = gguf.quants.dequantize(packed, Q.Q8_0)
    else:
      w.add_tensor(name, value)
      stored[key] = value
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return stored


def test_gguf_undoes_llama_cpp_permutation(checkpoints, tmp_path):
  """A GGUF written as llama.cpp does (q and k permuted, F32/F16/Q8_0 tensors) loads as the HF
  weights: exactly for F32 tensors, q included; k and gate as stored (F16, Q8_0), un-permuted."""
  directory, state = checkpoints["llama"]
  path = str(tmp_path / "tiny.gguf")
  stored = _write_gguf(path, state)
  settings = llama.decoder_settings(path, FLAG)
  assert settings == {**llama.decoder_settings(directory, FLAG), "rope_scaling": (),
                      "rope_theta": 10_000.0}
  decoder = llama.load_decoder(path, FLAG)
  hf_order = {k: _llama_cpp_unpermuted(k, v) for k, v in stored.items()}
  _assert_equal(decoder, hf_order)
  np.testing.assert_array_equal(decoder["h_0"]["attn"]["q_proj"]["kernel"],
                                state["model.layers.0.self_attn.q_proj.weight"].T)
  np.testing.assert_allclose(decoder["h_1"]["attn"]["k_proj"]["kernel"],
                             state["model.layers.1.self_attn.k_proj.weight"].T, atol=2e-3)
  np.testing.assert_allclose(decoder["h_1"]["mlp"]["gate_proj"]["kernel"],
                             state["model.layers.1.mlp.gate_proj.weight"].T, atol=2e-2)


def _llama_cpp_unpermuted(key, value):
  """The stored array back in HF's order, by inverting the permutation on indices (not arrays)."""
  heads = {"q_proj": SIZES["num_attention_heads"], "k_proj": SIZES["num_key_value_heads"]}
  kind = key.split(".")[-2]
  if kind not in heads:
    return value
  index = _llama_cpp_permute(np.arange(value.shape[0]), heads[kind])  # stored r = HF index[r]
  out = np.empty_like(value)
  out[index] = value
  return out


def test_gguf_refusals(checkpoints, tmp_path):
  _, state = checkpoints["llama"]
  gpt2 = tmp_path / "gpt2.gguf"
  _write_gguf(gpt2, {}, arch="gpt2")
  with pytest.raises(CheckpointError, match=rf"{FLAG}=.*gpt2.gguf holds a 'gpt2' model"):
    llama.decoder_settings(str(gpt2), FLAG)
  missing = tmp_path / "missing.gguf"
  _write_gguf(missing, state, skip=("blk.1.ffn_up.weight",))
  with pytest.raises(CheckpointError,
                     match=rf"{FLAG}=.*missing.gguf: the GGUF file has no .*'blk.1.ffn_up.weight'"):
    llama.load_decoder(str(missing), FLAG)
  with pytest.raises(FileNotFoundError, match=rf"{FLAG}=/no/such.gguf: no such file"):
    llama.load_decoder("/no/such.gguf", FLAG)


def test_directory_refusals(checkpoints, tmp_path):
  directory, _ = checkpoints["qwen2"]
  no_config = tmp_path / "no_config"
  no_config.mkdir()
  (no_config / "model.safetensors").write_bytes(open(f"{directory}/model.safetensors", "rb").read())
  with pytest.raises(FileNotFoundError, match=rf"{FLAG}=.*no_config has no config.json"):
    llama.load_decoder(str(no_config), FLAG)
  no_weights = tmp_path / "no_weights"
  no_weights.mkdir()
  config = json.loads(open(f"{directory}/config.json").read())
  (no_weights / "config.json").write_text(json.dumps(config))
  with pytest.raises(FileNotFoundError, match=rf"{FLAG}=.*no_weights: No model.safetensors"):
    llama.decoder_settings(str(no_weights), FLAG)
  (no_weights / "model.safetensors").write_bytes(b"")
  for key, value, message in (
      ("model_type", "gpt2", r"holds a 'gpt2' model \(config.json's model_type\)"),
      ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, r"RoPE scaling 'yarn'"),
      ("hidden_act", "gelu", r"hidden_act='gelu'")):
    (no_weights / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(CheckpointError, match=rf"{FLAG}=.*no_weights.*{message}"):
      llama.decoder_settings(str(no_weights), FLAG)
    assert llama.is_llama_source(str(no_weights)) == (key != "model_type")
  with pytest.raises(FileNotFoundError, match=rf"{FLAG}=/no/such is not a directory"):
    llama.decoder_settings("/no/such", FLAG)
  with pytest.raises(FileNotFoundError, match=rf"{FLAG}=.*qwen2.* has no tokenizer.json"):
    llama.load_tokenizer(directory, FLAG)


def test_shape_mismatch_names_the_key(checkpoints, tmp_path):
  directory, _ = checkpoints["mistral"]
  config = json.loads(open(f"{directory}/config.json").read())
  (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
  os.symlink(f"{directory}/model.safetensors", tmp_path / "model.safetensors")
  with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.gate_proj.weight'.* has shape "
                                            r"\(48, 32\) in model.safetensors, but .* \(64, 32\)"):
    llama.load_decoder(str(tmp_path), FLAG)


@pytest.fixture(scope="module")
def smollm2_hf():
  """transformers' own reading of the packaged SmolLM2 GGUF: its state dict (~10 s, ~2 GB)."""
  path = llama.smollm2_path()
  with gguf_parsed_once(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
  return {k: v.numpy() for k, v in model.state_dict().items()}, model.config, model.eval()


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_hf):
  state, config, _ = smollm2_hf
  settings = llama.decoder_settings(llama.SMOLLM2, FLAG)
  assert settings == dict(family="llama", vocab_size=49152, num_layers=30, hidden_size=576,
                          num_heads=9, num_kv_heads=3, head_dim=64, mlp_size=1536,
                          max_length=8192, layer_norm_eps=1e-5, rope_theta=100_000.0,
                          rope_scaling=(), tie_embeddings=True, attention_bias=False,
                          attention_out_bias=False, sliding_window=0)
  assert config.num_key_value_heads == 3 and config.rope_theta == 100_000.0
  decoder = llama.load_decoder(llama.SMOLLM2, FLAG)
  flat = dict(_flat(decoder))
  assert len(flat) == 2 + 9 * 30
  for path, value in flat.items():
    key = _hf_key(path)
    want = state[key].T if path[-1] == "kernel" else state[key]
    np.testing.assert_allclose(value, want, rtol=0, atol=1e-6, err_msg=str(path))
  assert llama.is_llama_source(llama.SMOLLM2)


def _retro_logits(source, tokens, **options):
  """Logits of the RETRO decoder (no CCA) with the weights at `source`, float32."""
  model = RetroModel(RetroConfig(**decoders.decoder_settings(source, FLAG), **options))
  return np.asarray(model.apply({"params": decoders.load_decoder(source, FLAG)}, tokens))


@pytest.mark.parametrize("name", list(MODELS))
def test_tiny_decoders_compute_what_transformers_computes(checkpoints, name):
  """Logits of each family's tiny random model equal HF's (eager attention, run in float64 as the
  reference) to 1e-5 (+ 1e-5 relative): 40 tokens, past Mistral's sliding window of 16 and
  llama3's original context of 32. (HF's own float32 run is ~8e-6 from its float64 one.)"""
  directory, _ = checkpoints[name]
  hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                         attn_implementation="eager").eval()
  tokens = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (2, 40)).astype(np.int32)
  with torch.no_grad():
    want = hf.double()(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
  got = _retro_logits(directory, tokens)
  assert np.abs(want).max() > 1.0   # the perturbed weights make the logits large
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


PROMPT = ("The Nile is a major north-flowing river in northeastern Africa. It flows into the "
          "Mediterranean Sea. The Nile is the longest river in Africa and")


@pytest.mark.slow
def test_smollm2_logits_and_greedy_text_equal_transformers(smollm2_hf):
  """SmolLM2's float32 logits on real text equal transformers' (same GGUF, run in float64 as the
  reference) to 1e-4 + 1e-5 relative from the second position on, and 32 greedy tokens are the ids
  of transformers' float32 greedy generation. Measured on AMD EPYC: transformers' own float32 run
  is 4.6e-5 from its float64 one; realm_jax's is 4.8e-5 from the second position on and 1.6e-4
  at the first (the prompt's first token, which every later token attends to most), checked
  there to 5e-4."""
  *_, hf = smollm2_hf
  tok = llama.load_tokenizer(llama.SMOLLM2, FLAG)
  prompt = tok.encode_batch([PROMPT])[0]
  with torch.no_grad():
    greedy = hf.generate(torch.as_tensor([prompt]), max_new_tokens=32, do_sample=False,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    want = hf.double()(torch.as_tensor([prompt])).logits.numpy()
    hf.float()
  greedy = greedy[0].tolist()
  assert len(greedy) == len(prompt) + 32
  settings = decoders.decoder_settings(llama.SMOLLM2, FLAG)
  model = RetroModel(RetroConfig(**settings))
  params = decoders.load_decoder(llama.SMOLLM2, FLAG)
  import jax
  # The weights are an argument, not constants of the program: 135M constants would be hashed and
  # written into the tests' persistent compilation cache (minutes).
  apply = jax.jit(lambda p, t: model.apply({"params": p}, t))
  # One forward over transformers' greedy text in a 64-token buffer: the tokens after a position
  # are causally invisible to it, so position i's logits are those of greedy decoding's step with
  # the first i + 1 tokens, and the prompt's logits those of the prompt alone. Greedy decoding
  # then gives transformers' tokens exactly when each step's argmax is the next of them.
  buffer = np.zeros((1, 64), np.int32)
  buffer[0, :len(greedy)] = greedy
  logits = np.asarray(apply(params, buffer))
  got = logits[:, :len(prompt)]
  np.testing.assert_allclose(got[:, 1:], want[:, 1:], rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(got[:, :1], want[:, :1], rtol=0, atol=5e-4)
  steps = logits[0, len(prompt) - 1:len(greedy) - 1].argmax(-1)
  assert steps.tolist() == greedy[len(prompt):]
  assert len(tok.decode(greedy[len(prompt):]).split()) >= 10   # fluent text, not a repeated token


def test_a_database_of_another_tokenizer_is_refused_before_any_weight_is_read():
  """RETROfitting SmolLM2 on a chunk database tokenized otherwise is one error naming the flag to
  rebuild it with; with SmolLM2's own tokenizer the model config takes the GGUF's shapes."""
  from types import SimpleNamespace

  from realm_jax.configs.retro import get_config
  from realm_jax.text.lm_tokenizer import LmTokenizer
  from realm_jax.train.retro import model_config
  config = get_config("retrofit_smollm2")
  other = LmTokenizer("wordpiece:0123456789abcdef", 30522, 102, 0)
  db = SimpleNamespace(tokenizer=other, chunk_length=32, seq_chunks=8)
  with pytest.raises(ValueError, match=r"--config.init=smollm2 reads its own tokenizer \(gguf:.*"
                                       r"built with another \(wordpiece:.*"
                                       r"--config.db.tokenizer_file=smollm2"):
    model_config(config, db, retrieval=True)
  db.tokenizer = llama.load_tokenizer(llama.SMOLLM2, FLAG)
  got = model_config(config, db, retrieval=True)
  assert (got.family, got.num_layers, got.kv_heads, got.cca_layers, got.pad_id) == (
      "llama", 30, 3, (6, 12, 18, 24, 30), 2)
