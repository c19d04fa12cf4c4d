"""Original TF1 REALM/ORQA checkpoints (google-research/language) -> Flax parameters.

Needs TensorFlow only to read the checkpoint files (`pip install 'realm-jax[tf]'`). TF kernels are
already [in, out] like Flax's; LayerNorm `gamma`/`beta` are `scale`/`bias`.

Variable scopes by kind:
  encoder   `bert/`, `cls/predictions/` (pre-trained knowledge-augmented encoder)
  embedder  `module/module/module/bert/` + `module/module/{dense,LayerNorm}` (pre-trained), or one
            more `module/` for a fine-tuned query tower; ORQA's ICT export names the LayerNorm
            `layer_normalization` (eps 1e-3)
  reader    `reader/module/bert/`, `reader/dense`, `reader/layer_normalization`, `reader/dense_1`
  bert      `bert/`
The corpus embeddings of a REALM export (`block_emb`) are read by `load_tf1_block_emb`.
"""

from __future__ import annotations

import os
import re

import numpy as np
from flax import traverse_util

from realm_jax.checkpoints.hf import CheckpointError, abstract_params
from realm_jax.models import RealmConfig

_SKIP = ("adam_m", "adam_v", "AdamWeightDecayOptimizer", "global_step")


def _reader(path: str):
  try:
    import tensorflow as tf
  except ImportError:
    raise ImportError(
        "Reading a TF1 checkpoint needs TensorFlow: `pip install 'realm-jax[tf]'`.") from None
  try:
    return tf.train.load_checkpoint(path)
  except Exception as e:
    raise CheckpointError(
        f"{path} is not a readable TF checkpoint ({type(e).__name__}). Pass the checkpoint prefix "
        "(e.g. .../model.ckpt-200000, without .index/.data-*) or its directory.") from None


def _bert_leaf(sub: tuple[str, ...]) -> str:
  """Flax path inside a BERT -> TF name inside `bert/`."""
  *scope, leaf = sub
  if leaf == "embedding":
    return "/".join(scope)
  return "/".join(scope + [{"scale": "gamma", "bias": "beta"}.get(leaf, leaf)
                           if scope[-1] in ("LayerNorm", "layer_normalization") else leaf])


def _tf_name(path: tuple[str, ...], kind: str, scopes: dict[str, str]) -> str:
  if kind == "bert":
    return scopes["bert"] + _bert_leaf(path)
  top, *rest = path
  if top == "realm":
    return scopes["bert"] + _bert_leaf(tuple(rest))
  if kind == "encoder" and path == ("cls", "predictions", "bias"):
    return "cls/predictions/output_bias"
  if kind == "encoder":
    return _bert_leaf(path)
  if kind == "embedder":
    name = {"LayerNorm": scopes["ln"]}.get(rest[0], rest[0])
    return scopes["head"] + _bert_leaf((name, rest[-1]))
  if kind == "reader":
    name = {"dense_intermediate": "dense", "dense_output": "dense_1"}.get(rest[0], rest[0])
    return "reader/" + _bert_leaf((name, rest[-1]))
  raise CheckpointError(f"TF1 checkpoints are read for kinds bert/encoder/embedder/reader, not {kind!r}.")


def _scopes(names: set[str], kind: str) -> dict[str, str]:
  if kind in ("bert", "encoder"):
    return {"bert": "bert/"}
  if kind == "reader":
    return {"bert": "reader/module/bert/"}
  for head in ("module/module/module/", "module/module/"):  # fine-tuned, then pre-trained
    bert = head + "module/bert/"
    if any(n.startswith(bert) for n in names) and any(n.startswith(head + "dense/") for n in names):
      ln = "LayerNorm" if any(n.startswith(head + "LayerNorm/") for n in names) else "layer_normalization"
      return {"bert": bert, "head": head, "ln": ln}
  raise CheckpointError(
      "No REALM/ORQA embedder found in the checkpoint (expected module/module/module/bert/ and "
      "module/module/dense/).")


def tf1_variable_names(path: str) -> dict[str, tuple[int, ...]]:
  return {k: tuple(v) for k, v in _reader(path).get_variable_to_shape_map().items()
          if not any(s in k for s in _SKIP)}


def load_tf1_checkpoint(path: str | os.PathLike, kind: str, config: RealmConfig):
  """Reads a TF1 checkpoint into Flax `params` for `kind`.

  Returns (config, params): the config is `config`, except that an ORQA-style projection named
  `layer_normalization` sets `retriever_layer_norm_eps=1e-3` as ORQA trained it.
  """
  path = os.fspath(path)
  reader = _reader(path)
  shapes_in_ckpt = reader.get_variable_to_shape_map()
  names = set(shapes_in_ckpt)
  scopes = _scopes(names, kind)
  if kind == "embedder" and scopes["ln"] == "layer_normalization":
    config = config.replace(retriever_layer_norm_eps=1e-3)
  flat = {}
  for p, spec in traverse_util.flatten_dict(abstract_params(kind, config)).items():
    name = _tf_name(p, kind, scopes)
    if name not in names:
      near = sorted(n for n in names if n.split("/")[0] == name.split("/")[0])[:3]
      raise CheckpointError(
          f"{path} has no variable {name!r} needed by the {kind} model (variables there start "
          f"like {near or sorted(names)[:3]}). Check the kind and num_hidden_layers.")
    value = reader.get_tensor(name)
    if tuple(value.shape) != tuple(spec.shape):
      raise CheckpointError(
          f"{path}: variable {name!r} has shape {tuple(value.shape)}, the config expects "
          f"{tuple(spec.shape)}. Use the config the checkpoint was trained with.")
    flat[p] = np.asarray(value, np.float32)
  return config, traverse_util.unflatten_dict(flat)


def load_tf1_block_emb(path: str | os.PathLike) -> np.ndarray:
  """The [N, 128] corpus embeddings `block_emb` of a REALM embedder export."""
  reader = _reader(os.fspath(path))
  names = [n for n in reader.get_variable_to_shape_map() if re.fullmatch(r"(.*/)?block_emb", n)]
  if not names:
    raise CheckpointError(f"{path} has no `block_emb` variable (the REALM corpus embeddings).")
  return np.asarray(reader.get_tensor(names[0]), np.float32)
