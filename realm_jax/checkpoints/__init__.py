"""Checkpoints: Hugging Face REALM/BERT state dicts and original TF1 checkpoints in and out
(weights), the one resolver of a run's starting weights (`resolve`: MiniLM, a HF directory or a TF1
checkpoint), and the orbax checkpoints of a training run (`realm_jax.checkpoints.training`)."""

from realm_jax.checkpoints.hf import (CheckpointError, KINDS, detect_kind, from_hf_state_dict,
                                      load_hf_checkpoint, overlay, read_state_dict,
                                      save_hf_checkpoint, to_hf_state_dict)
from realm_jax.checkpoints.minilm import load_minilm, minilm_dir
from realm_jax.checkpoints.tf1 import load_tf1_block_emb, load_tf1_checkpoint
from realm_jax.checkpoints.weights import Weights, resolve

__all__ = [
    "CheckpointError", "KINDS", "detect_kind", "from_hf_state_dict", "load_hf_checkpoint",
    "load_minilm", "load_tf1_block_emb", "load_tf1_checkpoint", "minilm_dir", "overlay",
    "read_state_dict", "resolve", "save_hf_checkpoint", "to_hf_state_dict", "Weights",
]
