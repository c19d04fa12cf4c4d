"""Checkpoint import/export: Hugging Face REALM/BERT state dicts and original TF1 checkpoints."""

from realm_jax.checkpoints.hf import (CheckpointError, KINDS, detect_kind, from_hf_state_dict,
                                      load_hf_checkpoint, read_state_dict, save_hf_checkpoint,
                                      to_hf_state_dict)
from realm_jax.checkpoints.minilm import load_minilm, minilm_dir

__all__ = [
    "CheckpointError", "KINDS", "detect_kind", "from_hf_state_dict", "load_hf_checkpoint",
    "load_minilm", "minilm_dir", "read_state_dict", "save_hf_checkpoint", "to_hf_state_dict",
]
