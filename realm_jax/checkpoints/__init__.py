"""Checkpoint import/export: Hugging Face REALM/BERT state dicts and original TF1 checkpoints."""

from realm_jax.checkpoints.hf import (CheckpointError, KINDS, detect_kind, from_hf_state_dict,
                                      load_hf_checkpoint, read_state_dict, save_hf_checkpoint,
                                      to_hf_state_dict)
from realm_jax.checkpoints.minilm import load_minilm, minilm_dir
from realm_jax.checkpoints.tf1 import load_tf1_block_emb, load_tf1_checkpoint

__all__ = [
    "CheckpointError", "KINDS", "detect_kind", "from_hf_state_dict", "load_hf_checkpoint",
    "load_minilm", "load_tf1_block_emb", "load_tf1_checkpoint", "minilm_dir", "read_state_dict", "save_hf_checkpoint", "to_hf_state_dict",
]
