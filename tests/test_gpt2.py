"""GPT-2 checkpoints into the RETRO decoder (realm_jax/checkpoints/gpt2.py), against the Hugging
Face PyTorch GPT-2 on the same perturbed weights."""

import json
import shutil

import jax
import numpy as np
import pytest
from conftest import jit_init, perturbed
from flax import traverse_util

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from realm_jax.checkpoints import decoder as decoders, gpt2  # noqa: E402
from realm_jax.checkpoints.hf import CheckpointError  # noqa: E402
from realm_jax.models.retro import RetroConfig, RetroModel  # noqa: E402

ATOL = 1e-5
FLAG = "--config.test_init"
B, L, M, K = 2, 16, 4, 2  # batch, tokens, chunk length, neighbours per chunk
HF = dict(n_layer=3, n_embd=32, n_head=4, vocab_size=97, n_positions=64, resid_pdrop=0.0,
          embd_pdrop=0.0, attn_pdrop=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """(directory of a saved tiny GPT2LMHeadModel, the model in eval mode)."""
  torch.manual_seed(0)
  config = transformers.GPT2Config(**HF, attn_implementation="eager")
  model = perturbed(transformers.GPT2LMHeadModel(config), seed=3)
  directory = tmp_path_factory.mktemp("gpt2")
  model.save_pretrained(directory, safe_serialization=True)
  return str(directory), model


@pytest.fixture(scope="module")
def inputs():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, HF["vocab_size"], (B, L)).astype(np.int32)
  neighbours = rng.integers(1, HF["vocab_size"], (B, L // M, K, 2 * M)).astype(np.int32)
  return tokens, neighbours


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()


def _max_error(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def test_decoder_settings(checkpoint):
  settings = gpt2.decoder_settings(checkpoint[0], FLAG)
  assert settings == dict(vocab_size=97, num_layers=3, hidden_size=32, num_heads=4, mlp_size=128,
                          max_length=64, layer_norm_eps=1e-5)


def test_baseline_matches_hf(checkpoint, inputs):
  directory, hf = checkpoint
  tokens, _ = inputs
  model = RetroModel(RetroConfig(**gpt2.decoder_settings(directory, FLAG), cca_layers=()))
  params = jit_init(model, 0, tokens)
  params = decoders.retrofit(params, gpt2.load_decoder(directory, FLAG), FLAG)
  assert _max_error(model.apply({"params": params}, tokens), _hf_logits(hf, tokens)) <= ATOL


def test_retro_matches_hf_without_neighbours(checkpoint, inputs):
  directory, hf = checkpoint
  tokens, neighbours = inputs
  config = RetroConfig(**gpt2.decoder_settings(directory, FLAG), cca_layers=(2,), chunk_length=M,
                       num_neighbours=K)
  model = RetroModel(config)
  init = jit_init(model, 1, tokens, neighbours)
  decoder = gpt2.load_decoder(directory, FLAG)
  params = decoders.retrofit(init, decoder, FLAG)

  # The decoder arrays are the checkpoint's, the CCA and encoder ones stay as initialised.
  flat, flat_init = traverse_util.flatten_dict(params), traverse_util.flatten_dict(init)
  flat_decoder = traverse_util.flatten_dict(decoder)
  assert {p for p in flat if p[1] in ("cca", "encoder")}, "the RETRO model has no CCA arrays"
  for path, value in flat.items():
    np.testing.assert_array_equal(value, flat_decoder.get(path, flat_init[path]))

  want = _hf_logits(hf, tokens)
  plain = model.apply({"params": params}, tokens, None)
  assert _max_error(plain, want) <= ATOL

  # CCA adds nothing before the first chunk is complete (positions 0 .. m-2), then changes all.
  retrieved = np.asarray(model.apply({"params": params}, tokens, neighbours))
  assert _max_error(retrieved[:, :M - 1], want[:, :M - 1]) <= ATOL
  changed = np.abs(retrieved - np.asarray(plain)).max(axis=(0, 2))
  assert np.all(changed[:M - 1] <= 1e-6) and np.all(changed[M - 1:] > 1e-6), changed


def test_is_decoder_param_marks_the_gpt2_arrays(checkpoint, inputs):
  directory, _ = checkpoint
  tokens, neighbours = inputs
  config = RetroConfig(**gpt2.decoder_settings(directory, FLAG), cca_layers=(2, 3),
                       chunk_length=M, num_neighbours=K)
  shapes = jax.eval_shape(RetroModel(config).init, jax.random.key(0), tokens, neighbours)
  flat = traverse_util.flatten_dict(shapes["params"])
  decoder = set(traverse_util.flatten_dict(gpt2.load_decoder(directory, FLAG)))
  assert {p for p in flat if decoders.is_decoder_param(p)} == decoder
  assert {p[1] for p in set(flat) - decoder} == {"cca", "ln_cca", "encoder"}
  # jax key paths (with the "params" collection in front) say the same.
  marks = jax.tree_util.tree_map_with_path(lambda p, _: decoders.is_decoder_param(p), shapes)
  assert {p for p, v in traverse_util.flatten_dict(marks["params"]).items() if v} == decoder


def test_state_dict_without_prefix(checkpoint, tmp_path):
  """GPT2Model's keys (no `transformer.`) load the same arrays."""
  from safetensors.numpy import load_file, save_file
  directory, _ = checkpoint
  state = load_file(f"{directory}/model.safetensors")
  assert "transformer.wte.weight" in state
  save_file({k.removeprefix("transformer."): v for k, v in state.items()},
            str(tmp_path / "model.safetensors"))
  shutil.copy(f"{directory}/config.json", tmp_path)
  want = traverse_util.flatten_dict(gpt2.load_decoder(directory, FLAG))
  got = traverse_util.flatten_dict(gpt2.load_decoder(str(tmp_path), FLAG))
  assert got.keys() == want.keys()
  for k, v in want.items():
    assert got[k].dtype == np.float32
    np.testing.assert_array_equal(got[k], v)


def _variant(checkpoint, tmp_path, config=None, drop=None, files=("config.json",
                                                                 "model.safetensors")):
  """A copy of the checkpoint with config.json's keys `config` changed, and the array `drop`
  missing, or only `files`."""
  from safetensors.numpy import load_file, save_file
  directory, _ = checkpoint
  for name in files:
    shutil.copy(f"{directory}/{name}", tmp_path)
  if config:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
  if drop:
    state = load_file(f"{directory}/model.safetensors")
    save_file({k: v for k, v in state.items() if k != drop}, str(tmp_path / "model.safetensors"))
  return str(tmp_path)


@pytest.mark.parametrize("change, message", [
    (dict(model_type="bert"), "'bert' model"),
    (dict(activation_function="gelu"), "activation_function='gelu'"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx=True"),
    (dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn=True"),
    (dict(tie_word_embeddings=False), "tie_word_embeddings=False"),
])
def test_refuses_other_models(checkpoint, tmp_path, change, message):
  directory = _variant(checkpoint, tmp_path, config=change)
  for read in (gpt2.decoder_settings, gpt2.load_decoder):
    with pytest.raises(ValueError, match=FLAG) as e:
      read(directory, FLAG)
    assert message in str(e.value) and directory in str(e.value)


def test_refuses_missing_files(checkpoint, tmp_path):
  with pytest.raises(FileNotFoundError, match=f"{FLAG}=.*not a directory"):
    gpt2.decoder_settings(str(tmp_path / "nowhere"), FLAG)
  (tmp_path / "a").mkdir()
  with pytest.raises(FileNotFoundError, match=f"{FLAG}=.*No model.safetensors.*safe_serialization"):
    gpt2.load_decoder(_variant(checkpoint, tmp_path / "a", files=("config.json",)), FLAG)
  (tmp_path / "b").mkdir()
  with pytest.raises(FileNotFoundError, match=f"{FLAG}=.*no config.json"):
    gpt2.decoder_settings(_variant(checkpoint, tmp_path / "b", files=("model.safetensors",)), FLAG)


def test_refuses_missing_and_misshaped_arrays(checkpoint, tmp_path):
  (tmp_path / "a").mkdir()
  directory = _variant(checkpoint, tmp_path / "a", drop="transformer.h.1.mlp.c_fc.bias")
  with pytest.raises(CheckpointError, match=f"{FLAG}=.*'transformer.h.1.mlp.c_fc.bias'"):
    gpt2.load_decoder(directory, FLAG)
  (tmp_path / "b").mkdir()
  directory = _variant(checkpoint, tmp_path / "b", config=dict(n_positions=32))
  with pytest.raises(CheckpointError, match=f"{FLAG}=.*'transformer.wpe.weight' has shape"):
    gpt2.load_decoder(directory, FLAG)


def test_retrofit_refuses_another_decoder(checkpoint, inputs):
  directory, _ = checkpoint
  settings = gpt2.decoder_settings(directory, FLAG)
  decoder = gpt2.load_decoder(directory, FLAG)
  for change, message in ((dict(num_layers=2), "differ in"), (dict(mlp_size=64), "has shape")):
    model = RetroModel(RetroConfig(**{**settings, **change}))
    params = jit_init(model, 0, inputs[0])
    with pytest.raises(CheckpointError, match=f"{FLAG}.*{message}"):
      decoders.retrofit(params, decoder, FLAG)


def test_tokenizer_file(checkpoint, tmp_path):
  directory = _variant(checkpoint, tmp_path)
  assert gpt2.tokenizer_file(directory) is None
  (tmp_path / "tokenizer.json").write_text("{}")
  assert gpt2.tokenizer_file(directory) == f"{directory}/tokenizer.json"
