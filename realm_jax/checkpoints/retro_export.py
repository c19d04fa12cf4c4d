"""A trained RETRO (or baseline) decoder as two files: `model.safetensors` (parameters under their
Flax paths joined by "/") and `retro.json` (the RetroConfig and what the model was trained with:
the tokenizer, the key embedder, the chunk database). Written atomically as a directory;
evaluation, sampling and the notebook read it.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from realm_jax.checkpoints.hf import CheckpointError
from realm_jax.io_utils import as_path, atomic_write_dir, local_file, read_json, write_json
from realm_jax.models.retro import RetroConfig
from realm_jax.retrieval.index_store import arrays_crc32

CONFIG = "retro.json"
PARAMS = "model.safetensors"


def save(directory: str, config: RetroConfig, params, meta: dict) -> None:
  """Writes the export; `meta` holds tokenizer, key_fingerprint, db_fingerprint, step, ..."""
  from safetensors.numpy import save_file
  flat = {"/".join(k): np.asarray(v, np.float32) for k, v in flatten_dict(params).items()}

  def write(tmp: str):
    save_file(flat, os.path.join(tmp, PARAMS),
              metadata={"arrays_crc32": arrays_crc32(*[flat[k] for k in sorted(flat)])})
    # How attention is computed is the reader's choice (flash is TPU code), not the model's.
    model = {k: v for k, v in dataclasses.asdict(config).items() if k != "attention"}
    write_json(os.path.join(tmp, CONFIG), {"model": model, **meta})

  atomic_write_dir(directory, write, marker=CONFIG)


def _read_config(directory: str, flag: str) -> tuple[RetroConfig, dict]:
  path = os.path.join(directory, CONFIG)
  if not as_path(path).exists():
    raise FileNotFoundError(
        f"{flag}={directory}: no {CONFIG} there. Pass a trained model's export directory "
        "(experiments/retro_train.py writes <workdir>/retro/export and <workdir>/baseline/export).")
  meta = read_json(path)
  fields = meta.pop("model")
  fields.pop("attention", None)
  fields["cca_layers"] = tuple(fields["cca_layers"])
  fields["rope_scaling"] = tuple(tuple(p) for p in fields.get("rope_scaling", ()))  # JSON lists
  return RetroConfig(**fields), meta


def load_config(directory: str, flag: str = "--model") -> RetroConfig:
  """The RetroConfig of an export, without reading its arrays."""
  return _read_config(directory, flag)[0]


def load(directory: str, flag: str = "--model") -> tuple[RetroConfig, dict, dict]:
  """(config, params, meta) of an export; a missing or damaged one is an error naming `flag`."""
  from safetensors import safe_open
  config, meta = _read_config(directory, flag)
  with local_file(os.path.join(directory, PARAMS)) as p:
    try:
      with safe_open(p, framework="numpy") as f:
        flat = {k: f.get_tensor(k) for k in f.keys()}
        want = (f.metadata() or {}).get("arrays_crc32")
    except Exception as e:  # safetensors raises its own error types
      raise CheckpointError(f"{flag}={directory}: {PARAMS} is not a readable safetensors file "
                            f"({e}); export the model again.") from None
  if want is not None and arrays_crc32(*[flat[k] for k in sorted(flat)]) != want:
    raise CheckpointError(f"{flag}={directory}: {PARAMS} is corrupt (its CRC-32 does not "
                          "match); export the model again.")
  return config, unflatten_dict({tuple(k.split("/")): v for k, v in flat.items()}), meta
