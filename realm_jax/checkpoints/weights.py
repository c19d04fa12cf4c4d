"""Which weights a run starts from: one resolver for every trainer, build_index, ask and the memory
estimate.

    weights = resolve(config.reader_weights, flag="--config.reader_weights")
    weights.config        # RealmConfig of the weights' config.json: read without any array
    weights.vocab()       # the vocab.txt beside them
    weights.kind          # "bert" | "embedder" | "retriever" | "encoder" | "reader"
    params, extras = weights.load("bert")   # Flax parameters, numpy float32

A source is one of
  minilm            all-MiniLM-L6-v2 from its installed package (`minilm.py`), a BERT;
  a directory       a Hugging Face REALM/BERT checkpoint (config.json + model.safetensors +
                    vocab.txt), local or gs://; a realm_jax export (ICT's `<workdir>/export`)
                    is one;
  a TF1 checkpoint  an original REALM/ORQA/BERT checkpoint (`tf1.py`): its prefix
                    (`.../model.ckpt-200000`, beside its `.index`) or a directory whose TF
                    `checkpoint` file names one, with the model's config.json (or BERT's
                    bert_config.json) and vocab.txt in the same directory. Reading it needs
                    TensorFlow (`pip install 'realm-jax[tf]'`).
Anything else is refused with one error that names the user's flag and says what to pass.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re

from realm_jax.checkpoints import tf1
from realm_jax.checkpoints.hf import (CheckpointError, local_checkpoint, no_safetensors,
                                      detect_kind, from_hf_state_dict, read_state_dict)
from realm_jax.checkpoints.minilm import minilm_dir
from realm_jax.io_utils import as_path
from realm_jax.models.config import RealmConfig
from realm_jax.text.tokenizer import checkpoint_lowercase

MINILM = "minilm"
SOURCES = ("'minilm', a Hugging Face REALM/BERT checkpoint directory (config.json + "
           "model.safetensors + vocab.txt, local or gs://) or an original TF1 checkpoint "
           "(its prefix, with config.json and vocab.txt beside it)")
_SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
_TF1_CONFIGS = ("config.json", "bert_config.json")  # BERT's own TF1 releases name it the latter
_KIND_WORDS = {"bert": "a BERT", "embedder": "a REALM embedder (one retriever tower)",
               "retriever": "a REALM scorer (the retriever's towers)",
               "encoder": "a REALM knowledge-augmented encoder", "reader": "a REALM reader"}


@dataclasses.dataclass(frozen=True)
class Weights:
  """Starting weights, found but not read: `config` and `vocab_file` come from small files, `kind`
  from the names of the arrays, and only `load` reads the arrays.

  Attributes:
    source: as the user gave it ("minilm", a directory, a TF1 checkpoint), for messages.
    flag: the user's flag that named it (e.g. "--config.reader_weights"), for messages.
    format: "hf" (a Hugging Face directory, MiniLM's included) or "tf1".
    path: what `load` reads: the HF directory (MiniLM's inside its package), or the TF1
      checkpoint prefix or directory.
    directory: the directory holding config.json and vocab.txt.
    config: the model config of the weights, sizes as saved (no run-time dtype, remat, ...).
    vocab_file: the vocab.txt in `directory`; None when there is none.
  """
  source: str
  flag: str
  format: str
  path: str
  directory: str
  config: RealmConfig
  vocab_file: str | None

  @property
  def name(self) -> str:
    """What messages call the weights: all-MiniLM-L6-v2, else the source."""
    return "all-MiniLM-L6-v2" if self.source == MINILM else self.source

  @property
  def lowercase(self) -> bool:
    """Whether the weights read lowercased text: uncased unless the tokenizer_config.json in
    `directory` says `"do_lower_case": false` (as `BertTokenizer` of `vocab_file` decides)."""
    return checkpoint_lowercase(os.path.join(self.directory, "vocab.txt"))

  @functools.cached_property
  def names(self) -> frozenset[str]:
    """The names of the arrays: HF state-dict keys from the safetensors headers, or TF1 variable
    names from the checkpoint's index; no array is read (a gs:// HF directory is copied into the
    local cache first, where `load` then finds it)."""
    if self.format == "tf1":
      return frozenset(_tf1_names(self.path, self.source, self.flag))
    local = local_checkpoint(self.path)
    single = os.path.join(local, "model.safetensors")
    if not os.path.exists(single):  # sharded: the index lists every key
      with open(os.path.join(local, "model.safetensors.index.json"), encoding="utf-8") as f:
        return frozenset(json.load(f)["weight_map"])
    from safetensors import safe_open  # local: only reading weights needs it
    try:
      with safe_open(single, framework="numpy") as f:
        return frozenset(f.keys())
    except Exception as e:  # safetensors raises its own error types
      raise CheckpointError(f"{self.flag}={self.source}: {single} is not a readable safetensors "
                            f"file ({e}).") from None

  @functools.cached_property
  def kind(self) -> str:
    """Which model the weights hold, one of `hf.KINDS` (TF1: bert, embedder, encoder or reader)."""
    kind = detect_kind(self.names) if self.format == "hf" else _tf1_kind(self.names)
    if kind is None:
      sample = ", ".join(sorted(self.names)[:4]) or "(none)"
      raise CheckpointError(f"{self.flag}={self.source} does not hold a REALM or BERT model "
                            f"(its arrays: {sample}, ...): pass {SOURCES}.")
    return kind

  def check_kind(self, kinds: tuple[str, ...], what: str) -> str:
    """`kind` when it is one of `kinds`, else a CheckpointError naming the flag; `what` says in
    words what the caller takes ("a REALM embedder or scorer")."""
    if self.kind not in kinds:
      raise CheckpointError(f"{self.flag}={self.source} holds {_KIND_WORDS[self.kind]}: pass "
                            f"{what}.")
    return self.kind

  def check_layers(self, num_layers: int, flag: str) -> None:
    """A ValueError naming `flag` unless `num_layers` is 0 (all of the weights' transformer
    layers) or 1 to their number (the first ones kept)."""
    have = self.config.num_hidden_layers
    if (isinstance(num_layers, bool) or not isinstance(num_layers, int)
        or not 0 <= num_layers <= have):
      raise ValueError(f"{flag}={num_layers}: {self.name} has {have} transformer layers; keep 1 "
                       f"to {have} of them, or 0 for all.")

  def vocab(self, fallback: str = "") -> str:
    """The vocab.txt beside the weights, else `fallback` (a --config.vocab_file); a
    FileNotFoundError naming the flag when there is neither."""
    vocab = self.vocab_file or fallback
    if not vocab:
      raise FileNotFoundError(f"{self.flag}={self.source} has no vocab.txt: put the vocab.txt "
                              f"the weights were trained with in {self.directory}.")
    return vocab

  def load(self, kind: str | None = None, config: RealmConfig | None = None,
           strict: bool = True) -> tuple[dict, dict]:
    """Reads the weights: (params, extras).

    Args:
      kind: the model to read them as, default `kind`; "bert" also reads the BERT inside a REALM
        encoder, embedder or reader.
      config: default `config`; with fewer layers than the weights, the first ones are read.
      strict: refuse HF weights that hold another kind of model (see `from_hf_state_dict`).
    Returns:
      params: the Flax parameter tree of `kind`, numpy float32.
      extras: the HF entries the model does not use (e.g. a BERT's MLM head); {} for TF1.
    """
    kind, config = kind or self.kind, config or self.config
    if self.format == "tf1":
      return tf1.load_tf1_checkpoint(self.path, kind, config)[1], {}
    return from_hf_state_dict(read_state_dict(self.path), kind, config, source=self.path,
                              strict=strict)


def resolve(source: str, *, flag: str) -> Weights:
  """The weights `source` names (see the module docstring), checked and with their config read;
  `flag` is the user's flag that gave `source`, named by every error.

  Raises:
    FileNotFoundError: `source` is empty, missing, not a directory, or a directory without a
      checkpoint or without its config.json (also the MiniLM package not installed).
    CheckpointError: a TF1 checkpoint without TensorFlow installed.
  """
  if source == MINILM:
    path = minilm_dir()
    return Weights(source, flag, "hf", path, path, _config(path, "config.json"),
                   os.path.join(path, "vocab.txt"))
  if not source:
    raise FileNotFoundError(f"{flag} is empty: pass {SOURCES}.")
  if as_path(source + ".index").exists():
    return _resolve_tf1(source, flag, os.path.dirname(source))
  p = as_path(source)
  if not p.is_dir():
    raise FileNotFoundError(f"{flag}={source} is not a directory: pass {SOURCES}.")
  names = sorted(q.name for q in p.iterdir())
  if not any(n in names for n in _SAFETENSORS):
    state = p / "checkpoint"  # TF's checkpoint state: names the newest prefix in `source`
    if "checkpoint" in names and state.is_file() and "model_checkpoint_path" in state.read_text():
      return _resolve_tf1(source, flag, source)
    # Says what the directory holds instead: orbax checkpoints of a training run, a pickle.
    raise FileNotFoundError(f"{flag}={source}: {no_safetensors(source, names)}")
  if "config.json" not in names:
    raise FileNotFoundError(f"{flag}={source} has no config.json: keep the config.json saved "
                            "with model.safetensors beside it.")
  vocab = os.path.join(source, "vocab.txt") if "vocab.txt" in names else None
  return Weights(source, flag, "hf", source, source, _config(source, "config.json"), vocab)


def _config(directory: str, name: str) -> RealmConfig:
  return RealmConfig.from_json_file(os.path.join(directory, name))


def _resolve_tf1(source: str, flag: str, directory: str) -> Weights:
  configs = [n for n in _TF1_CONFIGS if as_path(os.path.join(directory, n)).exists()]
  if not configs:
    raise FileNotFoundError(
        f"{flag}={source} is a TF1 checkpoint without config.json (or BERT's bert_config.json) "
        f"in {directory}: put the model's config there (a TF1 checkpoint does not hold its sizes).")
  config = _config(directory, configs[0])
  names = _tf1_names(source, source, flag)
  if _tf1_kind(names) == "embedder" and any(
      re.fullmatch(r"(module/)+layer_normalization/gamma", n) for n in names):
    config = config.replace(retriever_layer_norm_eps=1e-3)  # ORQA's ICT export, as tf1.py reads it
  vocab = os.path.join(directory, "vocab.txt")
  return Weights(source, flag, "tf1", source, directory, config,
                 vocab if as_path(vocab).exists() else None)


def _tf1_names(path: str, source: str, flag: str) -> list[str]:
  try:
    return list(tf1.tf1_variable_names(path))
  except ImportError:
    raise CheckpointError(f"{flag}={source} is a TF1 checkpoint: reading it needs TensorFlow, "
                          "`pip install 'realm-jax[tf]'`.") from None


def _tf1_kind(names) -> str | None:
  """Which model a TF1 checkpoint holds, from its variable scopes (listed in tf1.py)."""
  if any(n.startswith("reader/") for n in names):
    return "reader"
  if any(re.match(r"module/(module/)+bert/", n) for n in names):
    return "embedder"
  if any(n.startswith("bert/") for n in names):
    return "encoder" if "cls/predictions/output_bias" in names else "bert"
  return None
