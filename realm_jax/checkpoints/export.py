"""A trained model written as a Hugging Face checkpoint directory that every entry point reads
(config.json, model.safetensors, vocab.txt and, for a cased vocabulary, its tokenizer_config.json):
the retriever of ICT, DPR and pre-training, and pre-training's knowledge-augmented encoder.
"""

from __future__ import annotations

import logging
import os

import jax

from realm_jax.checkpoints.hf import save_hf_checkpoint
from realm_jax.io_utils import as_path, atomic_write_dir, is_remote
from realm_jax.models.config import RealmConfig
from realm_jax.text.tokenizer import TOKENIZER_CONFIG


def export_hf(directory: str, model_config: RealmConfig, params, kind: str,
              vocab_file: str) -> None:
  """Writes `directory` as a HF REALM checkpoint of `kind` ("retriever": a scorer with `embedder`
  and `query_embedder`; "encoder": a knowledge-augmented encoder), atomically: readers see the old
  directory or the new one (on gs://, a directory whose config.json exists: it is uploaded
  last)."""
  params = jax.device_get(params)
  casing = as_path(vocab_file).parent / TOKENIZER_CONFIG  # a cased checkpoint stays cased
  has_casing = casing.exists()

  def write(tmp: str):
    save_hf_checkpoint(tmp, model_config, params, kind=kind)
    as_path(vocab_file).copy(os.path.join(tmp, "vocab.txt"))
    if has_casing:
      casing.copy(os.path.join(tmp, TOKENIZER_CONFIG))

  if is_remote(directory):
    # The upload is skipped when config.json is unchanged, and it does not change with the weights.
    (as_path(directory) / "config.json").unlink(missing_ok=True)
    # An upload leaves files the new export lacks: an old casing must not outlive its export.
    if not has_casing:
      (as_path(directory) / TOKENIZER_CONFIG).unlink(missing_ok=True)
  atomic_write_dir(directory, write, marker="config.json")
  logging.info("Exported the %s to %s", kind, directory)


def pretraining_exports(workdir: str) -> dict[str, str]:
  """Where a pre-training run exports its retriever and its encoder when it ends."""
  return {name: os.path.join(workdir, "export", name) for name in ("retriever", "encoder")}
