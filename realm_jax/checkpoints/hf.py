"""Hugging Face REALM / BERT state dicts <-> realm_jax Flax parameter trees.

The Flax modules use HF's own names, so a Flax path maps to a HF key by joining with dots
(`layer_3` <-> `layer.3`), with `kernel` = `weight`.T, `embedding`/`scale` = `weight`.

Kinds and the HF classes they correspond to:
  bert       BertModel (e.g. all-MiniLM-L6-v2; keys bare or under `bert.`)
  embedder   RealmEmbedder (one retriever tower)
  retriever  RealmScorer (`embedder`, and `query_embedder` when the towers differ)
  encoder    RealmKnowledgeAugEncoder
  reader     RealmReader

Keys of the HF checkpoint that the Flax model does not use (the unused MLM heads that HF keeps in
its embedder and reader, buffers such as `position_ids`) come back as `extras`, so that
HF -> realm_jax -> HF is bit-identical. Files are read with safetensors only: pickled `.bin`
checkpoints are refused (see `read_state_dict`). A gs:// checkpoint directory is read from its copy
in the local cache (`io_utils.local_copy_of_dir`) and written with config.json last: readers take
a directory without config.json for incomplete.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from realm_jax.io_utils import as_path, atomic_write, is_remote, local_copy_of_dir, write_json
from realm_jax.models import (BertModel, KnowledgeAugEncoder, RealmConfig, RealmEmbedder,
                              RealmReader, RealmRetriever)
from realm_jax.models.config import RUN_TIME_FIELDS

KINDS = ("bert", "embedder", "retriever", "encoder", "reader")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


class CheckpointError(ValueError):
  """A checkpoint that does not fit the requested model; the message says what to do."""


def build_model(kind: str, config: RealmConfig, share_embedders: bool = True,
                pooling: str = "projected_cls"):
  if kind == "bert":
    return BertModel(config, add_pooling_layer=True)
  if kind == "embedder":
    return RealmEmbedder(config)
  if kind == "retriever":
    return RealmRetriever(config, share_embedders=share_embedders, pooling=pooling)
  if kind == "encoder":
    return KnowledgeAugEncoder(config)
  if kind == "reader":
    return RealmReader(config)
  raise CheckpointError(f"Unknown model kind {kind!r}; use one of {KINDS}.")


def abstract_params(kind: str, config: RealmConfig, share_embedders: bool = True,
                    pooling: str = "projected_cls") -> dict:
  """Shapes of the Flax parameters of a model kind, without allocating them (`pooling`: of a
  retriever's towers; a mean-pooled one has no pooler and no [CLS] projection)."""
  model = build_model(kind, config, share_embedders, pooling)
  n = max(8, config.max_span_width)
  ids = jnp.zeros((1, 1, n), jnp.int32)
  if kind in ("bert", "embedder"):
    args = (ids[0], ids[0], ids[0])
  elif kind == "retriever":
    q = dict(input_ids=ids[0], attention_mask=ids[0], token_type_ids=ids[0])
    args = (q, dict(input_ids=ids, attention_mask=ids, token_type_ids=ids))
  elif kind == "encoder":
    args = (ids, ids, ids)
  else:
    args = (ids, ids, ids, ids, jnp.zeros((1, 1)))
  shapes = jax.eval_shape(model.init, jax.random.key(0), *args)
  return shapes["params"]


def hf_key(path: tuple[str, ...], prefix: str = "") -> tuple[str, bool]:
  """Flax parameter path -> (HF state-dict key, whether the array is transposed)."""
  parts = []
  for p in path[:-1]:
    m = re.fullmatch(r"layer_(\d+)", p)
    parts += ["layer", m.group(1)] if m else [p]
  leaf = path[-1]
  if leaf == "kernel":
    return prefix + ".".join(parts + ["weight"]), True
  if leaf in ("embedding", "scale"):
    return prefix + ".".join(parts + ["weight"]), False
  return prefix + ".".join(parts + [leaf]), False


def detect_kind(keys) -> str | None:
  """Which model a HF state dict holds, from its key names (None if it is not REALM/BERT)."""
  keys = set(keys)
  if any(k.startswith("qa_outputs.") for k in keys):
    return "reader"
  if any(k.startswith("embedder.") for k in keys):
    return "retriever"
  if "cls.dense.weight" in keys:
    return "embedder"
  if "cls.predictions.bias" in keys and "realm.embeddings.word_embeddings.weight" in keys:
    return "encoder"
  if _bert_prefix(keys) is not None:
    return "bert"
  return None


def _bert_prefix(keys) -> str | None:
  for prefix in ("", "bert.", "realm."):
    if prefix + "embeddings.word_embeddings.weight" in keys:
      return prefix
  return None


def _to_numpy(v) -> np.ndarray:
  if hasattr(v, "detach"):  # torch.Tensor, without importing torch here
    v = v.detach().cpu().numpy()
  return np.asarray(v)


def _derived_keys(kind: str, flat: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """HF keys that are copies of other parameters (tied weights, the shared query tower)."""
  if kind == "encoder":
    return {"cls.predictions.decoder.weight": flat["realm.embeddings.word_embeddings.weight"],
            "cls.predictions.decoder.bias": flat["cls.predictions.bias"]}
  if kind == "retriever" and not any(k.startswith("query_embedder.") for k in flat):
    return {"query_embedder." + k[len("embedder."):]: v for k, v in flat.items()
            if k.startswith("embedder.")}
  return {}


def retriever_pooling(keys) -> str:
  """The pooling of a REALM scorer's towers, from its keys: REALM's projected [CLS] when it has the
  projection (`embedder.cls.dense`), else mean pooling (a mean-pooled export of realm_jax's
  retriever trainers, e.g. DPR from all-MiniLM-L6-v2)."""
  return "projected_cls" if "embedder.cls.dense.weight" in keys else "mean"


def _shares_embedders(state: Mapping[str, np.ndarray]) -> bool:
  query = {k[len("query_embedder."):]: v for k, v in state.items() if k.startswith("query_embedder.")}
  if not query:
    return True
  return all(np.array_equal(v, state.get("embedder." + k)) for k, v in query.items())


def _shape_hint(key: str) -> str:
  if "word_embeddings" in key or "predictions.bias" in key:
    return "the vocabulary size differs: set vocab_size to the checkpoint's (and use its vocab file)"
  if "position_embeddings" in key:
    return "max_position_embeddings differs"
  if "token_type_embeddings" in key:
    return "type_vocab_size differs"
  return "the checkpoint was saved with another architecture"


def from_hf_state_dict(state_dict: Mapping[str, Any], kind: str, config: RealmConfig,
                       source: str = "<state dict>", strict: bool = True):
  """Converts a HF state dict (torch tensors or numpy arrays) to Flax parameters.

  Args:
    state_dict: HF `model.state_dict()` or the contents of a `model.safetensors`.
    kind: one of KINDS.
    config: the model config; its sizes must match the checkpoint.
    source: file name used in error messages.
    strict: refuse keys that belong to another kind of model.
  Returns:
    (params, extras): the Flax `params` tree (numpy float32) and the HF entries the Flax model
    does not use, for `to_hf_state_dict`. For kind "retriever", whether the towers are shared is
    read from the checkpoint: `"query_embedder" in params` tells.
  """
  if kind not in KINDS:
    raise CheckpointError(f"Unknown model kind {kind!r}; use one of {KINDS}.")
  state = {k: _to_numpy(v) for k, v in state_dict.items()}
  found = detect_kind(state)
  if found is None:
    sample = ", ".join(sorted(state)[:4]) or "(no keys)"
    raise CheckpointError(
        f"{source} does not look like a REALM or BERT checkpoint (keys: {sample}, ...). "
        "Pass a Hugging Face REALM/BERT model.safetensors, or a TF1 checkpoint via load_tf1_checkpoint.")
  if strict and found != kind and not (kind == "bert" and found in ("encoder", "embedder", "reader")):
    raise CheckpointError(
        f"{source} holds a {found!r} checkpoint, not a {kind!r} one; load it with kind={found!r}.")
  prefix = (_bert_prefix(state) or "") if kind == "bert" else ""
  for key, value in state.items():
    if key.endswith("embeddings.word_embeddings.weight") and value.shape[0] != config.vocab_size:
      raise CheckpointError(
          f"{source}: the checkpoint's vocabulary has {value.shape[0]} entries ({key!r} has shape "
          f"{tuple(value.shape)}) but config.vocab_size={config.vocab_size}. Use the config.json "
          "and vocab.txt saved with the checkpoint.")
  share = _shares_embedders(state) if kind == "retriever" else True
  shapes = traverse_util.flatten_dict(abstract_params(kind, config, share,
                                                      retriever_pooling(state)))
  flat_params, used = {}, set()
  for path, spec in shapes.items():
    key, transpose = hf_key(path, prefix)
    if key not in state:
      raise CheckpointError(
          f"{source} is missing parameter {key!r} needed by the {kind} model "
          f"(num_hidden_layers={config.num_hidden_layers}?). Check that the checkpoint and the "
          "config belong together.")
    value = state[key].T if transpose else state[key]
    if value.shape != spec.shape:
      raise CheckpointError(
          f"{source}: parameter {key!r} has shape {tuple(state[key].shape)} but the config "
          f"expects {tuple(spec.shape[::-1] if transpose else spec.shape)}: {_shape_hint(key)}. "
          "Load the config.json saved with the checkpoint (RealmConfig.from_json_file).")
    flat_params[path] = np.ascontiguousarray(value, dtype=np.float32)
    used.add(key)
  derived = _derived_keys(kind, {hf_key(p, prefix)[0]: v for p, v in flat_params.items()})
  extras = {k: v for k, v in state.items() if k not in used and k not in derived}
  return traverse_util.unflatten_dict(flat_params), extras


def overlay(base: dict, loaded: dict, what: str) -> dict:
  """`base` with every leaf that `loaded` has replaced; shapes must agree."""
  flat, new = traverse_util.flatten_dict(base), traverse_util.flatten_dict(loaded)
  for key, value in new.items():
    if key not in flat:
      continue  # e.g. a BERT pooler the model has no use for
    if flat[key].shape != value.shape:
      raise CheckpointError(f"{what}: parameter {'/'.join(key)} has shape {value.shape} in the "
                            f"checkpoint but {flat[key].shape} in the model; the checkpoint was "
                            "made for another model config.")
    flat[key] = jnp.asarray(value, flat[key].dtype)
  return traverse_util.unflatten_dict(flat)


def to_hf_state_dict(params: Mapping, kind: str, extras: Mapping[str, np.ndarray] | None = None,
                     prefix: str = "") -> dict[str, np.ndarray]:
  """Flax parameters -> HF state dict (numpy), including tied copies and any `extras`."""
  flat = {}
  for path, value in traverse_util.flatten_dict(dict(params)).items():
    key, transpose = hf_key(path, prefix)
    value = np.asarray(value)
    flat[key] = np.ascontiguousarray(value.T if transpose else value)
  flat.update(_derived_keys(kind, flat))
  for k, v in (extras or {}).items():
    flat.setdefault(k, np.asarray(v))
  return flat


_SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")


def _training_run(path: str, names: list[str]) -> str | None:
  """The work directory of the realm_jax training run whose orbax checkpoints `path` holds: a step
  directory (`<workdir>/checkpoints/<step>`), the `checkpoints` folder, or the work directory; None
  when it is none of these. `names`: the entries of `path`."""
  p = as_path(path)
  if "_CHECKPOINT_METADATA" in names or {"state", "meta"} <= set(names):  # orbax's step layout
    return str(p.parent.parent)
  if any(n.isdigit() and (p / n / "_CHECKPOINT_METADATA").exists() for n in names):
    return str(p.parent)
  if "checkpoints" in names and (p / "checkpoints").is_dir():
    return path
  return None


def no_safetensors(path: str, names: list[str]) -> FileNotFoundError:
  workdir = _training_run(path, names)
  if workdir is not None:
    export = os.path.join(workdir, "export")
    return FileNotFoundError(
        f"{path} holds orbax checkpoints of a realm_jax training run (work directory {workdir}), "
        "not a Hugging Face checkpoint (config.json + model.safetensors). An ICT run "
        "(experiments/ict.py) exports its retriever as one to <workdir>/export when it ends "
        f"(run it again with the same --config and --workdir={workdir} to write a missing "
        f"export): pass {export}. Pre-training and fine-tuning checkpoints cannot be used "
        "directly: realm_jax has no export of their retriever.")
  pickled = [f for f in names if f.endswith(_PICKLE_SUFFIXES)]
  hint = (f" It has {pickled[0]}, a pickle, which realm_jax does not load." if pickled else "")
  return FileNotFoundError(
      f"No model.safetensors in {path}.{hint} Convert once with transformers: "
      "`Model.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)`.")


def read_config_json(directory: str, flag: str, what: str) -> dict:
  """config.json of the decoder checkpoint directory `directory` (config.json + safetensors),
  after checking that both are there; errors name `flag` and say to pass `what`.

  Raises FileNotFoundError (no directory, config.json or safetensors) or CheckpointError (a
  config.json that is not JSON)."""
  p = as_path(directory)
  if not directory or not p.is_dir():
    raise FileNotFoundError(f"{flag}={directory} is not a directory: pass {what}.")
  names = sorted(q.name for q in p.iterdir())
  if "config.json" not in names:
    raise FileNotFoundError(f"{flag}={directory} has no config.json: put there the config.json "
                            "saved with the weights (`save_pretrained` writes both).")
  if not any(n in names for n in ("model.safetensors", "model.safetensors.index.json")):
    raise FileNotFoundError(f"{flag}={directory}: {no_safetensors(directory, names)}")
  try:
    return json.loads((p / "config.json").read_text(encoding="utf-8"))
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{flag}={directory}: config.json is not valid JSON ({e}).") from None


def local_checkpoint(path: str) -> str:
  """`path` itself when local; for a gs:// checkpoint directory, or a file in one, the same in
  its copy in the local cache (safetensors reads local files only)."""
  if not is_remote(path) or path.endswith(_PICKLE_SUFFIXES):  # read_state_dict refuses pickles
    return path
  src = as_path(path)
  if src.is_file():  # its directory holds the config.json and any other shards
    parent, name = path.rsplit("/", 1)
    return os.path.join(local_checkpoint(parent), name)
  names = [p.name for p in src.iterdir()] if src.is_dir() else []
  if not any(f in names for f in _SAFETENSORS) and (  # before a download
      "config.json" in names or _training_run(path, names) is not None):
    raise no_safetensors(path, names)
  return local_copy_of_dir(path, marker="config.json", what="Checkpoint directory")


def read_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """Reads `model.safetensors` (a file, or a directory holding one or a sharded index); a gs://
  one from its copy in the local cache."""
  from safetensors.numpy import load_file  # local: only this function needs it

  path = local_checkpoint(os.fspath(path))
  if os.path.isdir(path):
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(single):
      path = single
    elif os.path.exists(index):
      with open(index, encoding="utf-8") as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
      out = {}
      for shard in shards:
        out.update(read_state_dict(os.path.join(os.path.dirname(index), shard)))
      return out
    else:
      raise no_safetensors(path, os.listdir(path))
  if path.endswith(_PICKLE_SUFFIXES):
    raise CheckpointError(
        f"{path} is a pickled PyTorch checkpoint; realm_jax never loads pickles. Convert it once "
        "with transformers: `Model.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)` "
        "and pass the resulting model.safetensors.")
  if not os.path.exists(path):
    raise FileNotFoundError(f"Checkpoint file {path} does not exist.")
  try:
    return load_file(path)
  except Exception as e:  # safetensors raises its own error types
    raise CheckpointError(f"{path} is not a readable safetensors file ({e}).") from None


def load_hf_checkpoint(path: str | os.PathLike, kind: str | None = None,
                       config: RealmConfig | None = None, strict: bool = True):
  """Loads a HF REALM/BERT checkpoint directory (config.json + model.safetensors) or file, local
  or gs://.

  Returns (config, params, extras). `kind` defaults to what the keys say.
  """
  path = os.fspath(path)
  local = local_checkpoint(path)
  state = read_state_dict(local)
  if config is None:
    directory = local if os.path.isdir(local) else os.path.dirname(local)
    cfg_path = os.path.join(directory, "config.json")
    if not os.path.exists(cfg_path):
      raise FileNotFoundError(
          f"{cfg_path} does not exist: pass `config=` or keep the config.json saved with the weights.")
    config = RealmConfig.from_json_file(cfg_path)
  kind = kind or detect_kind(state)
  params, extras = from_hf_state_dict(state, kind or "bert", config, source=path, strict=strict)
  return config, params, extras


def save_hf_checkpoint(directory: str | os.PathLike, config: RealmConfig, params: Mapping, kind: str,
                       extras: Mapping[str, np.ndarray] | None = None) -> None:
  """Writes `model.safetensors` + `config.json` readable by HF `from_pretrained`; each file is
  written under a temporary name and renamed, so an interrupted save never leaves a half file.
  From a gs:// `directory` config.json, which readers take to mean "complete", is deleted first
  and comes back last."""
  from safetensors.numpy import save_file

  directory = os.fspath(directory)
  if is_remote(directory):  # no directories to make in an object store
    (as_path(directory) / "config.json").unlink(missing_ok=True)
  else:
    os.makedirs(directory, exist_ok=True)
  state = to_hf_state_dict(params, kind, extras)
  hf_config = {k: v for k, v in config.to_dict().items() if k not in RUN_TIME_FIELDS}
  if config.retriever_layer_norm_eps is None:
    hf_config.pop("retriever_layer_norm_eps")
  hf_config["model_type"] = "bert" if kind == "bert" else "realm"
  atomic_write(os.path.join(directory, "model.safetensors"),
               lambda p: save_file(state, p, metadata={"format": "pt"}))
  write_json(os.path.join(directory, "config.json"), hf_config)
