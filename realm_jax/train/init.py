"""The models and starting weights of a pre-training run, from its config.

config.init:
  minilm  both the retriever and the encoder start from the all-MiniLM-L6-v2 BERT installed from
          the registry (mean pooling, L2-normalised, scores scaled by config.score_scale); the
          MLM head (transform, bias) starts at random, its decoder tied to the word embeddings
          (config.mlm_transform_init='identity': the transform's dense layer starts as the
          identity, for any new head).
  hf      config.retriever_weights: a HF REALM embedder/scorer directory (REALM's projected [CLS]),
          e.g. the output of experiments/ict.py; config.encoder_weights: a HF REALM
          knowledge-augmented encoder or a BERT directory (a BERT keeps its MLM head, as
          bert-base-uncased's BertForPreTraining has one; one without gets a new head). Either
          may also be a TF1 checkpoint of such a model (`checkpoints.resolve`).
  random  random weights of config.model (tests; the tiny config).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from realm_jax.checkpoints.hf import CheckpointError, hf_key, overlay, retriever_pooling
from realm_jax.checkpoints.weights import MINILM, Weights, resolve
from realm_jax.models.config import RealmConfig
from realm_jax.models.encoder import KnowledgeAugEncoder
from realm_jax.models.retriever import RealmRetriever
from realm_jax.text import BertTokenizer
from realm_jax.train.realm_step import RealmModels

INITS = ("minilm", "hf", "random")
MLM_TRANSFORM_INITS = ("random", "identity")  # the dense layer of a new MLM head
_MLM_HEAD = "cls.predictions."  # the MLM head's keys in a HF BERT checkpoint


def _init(module, config: RealmConfig, rng, k: int = 2, length: int = 8):
  """Random parameters of `module` (jitted: op-by-op init of a BERT takes seconds)."""
  del config
  ids = jnp.zeros((1, k, length), jnp.int32)
  if isinstance(module, RealmRetriever):
    q = dict(input_ids=ids[:, 0], attention_mask=ids[:, 0], token_type_ids=ids[:, 0])
    init = lambda r: module.init(r, q, dict(input_ids=ids, attention_mask=ids, token_type_ids=ids))
  else:
    init = lambda r: module.init(r, ids, ids, ids, jnp.zeros((1, 1), jnp.int32))
  return jax.jit(init)(rng)["params"]


def sized_model_config(config, model_config: RealmConfig) -> RealmConfig:
  """`model_config` with the run's compute dtype, layer recomputation (config.remat) and chunking
  (config.chunk_tokens) and, if config.num_layers > 0, only the first num_layers transformer
  layers of the weights (small CPU demos)."""
  model_config = model_config.replace(dtype=config.dtype, remat=bool(config.get("remat", False)),
                                      chunk_tokens=int(config.get("chunk_tokens", 0)))
  if config.num_layers:
    if config.num_layers > model_config.num_hidden_layers:
      raise ValueError(f"--config.num_layers={config.num_layers} is more than the "
                       f"{model_config.num_hidden_layers} layers of the weights.")
    model_config = model_config.replace(num_hidden_layers=config.num_layers)
  return model_config


def retriever_model_config(config, model_config: RealmConfig) -> RealmConfig:
  """The retriever's model config: `model_config` (sized), with only the first
  config.retriever_num_layers transformer layers if that is > 0 (a smaller retriever than encoder,
  e.g. 2 retriever layers beside 6 encoder layers)."""
  layers = config.get("retriever_num_layers", 0)
  if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
    raise ValueError(f"--config.retriever_num_layers={layers!r}: give 0 (as many layers as the "
                     "encoder) or a positive number of layers.")
  if not layers:
    return model_config
  if layers > model_config.num_hidden_layers:
    raise ValueError(f"--config.retriever_num_layers={layers} is more than the "
                     f"{model_config.num_hidden_layers} layers the encoder keeps "
                     "(config.num_layers or the weights); the retriever can only keep fewer.")
  return model_config.replace(num_hidden_layers=layers)


def starting_weights(config) -> dict[str, Weights]:
  """{"retriever": Weights, "encoder": Weights} that config.init starts from, resolved (their
  config.json read, no array); {} for random weights."""
  if config.init not in INITS:
    raise ValueError(f"--config.init={config.init!r}: use one of {INITS}.")
  if config.init == "minilm":
    minilm = resolve(MINILM, flag="--config.init")
    return {"retriever": minilm, "encoder": minilm}
  if config.init == "hf":
    return {name: resolve(config.get(f"{name}_weights"), flag=f"--config.{name}_weights")
            for name in ("retriever", "encoder")}
  return {}


def build_models(config) -> tuple[RealmModels, RealmConfig, str]:
  """(models, model config, vocab file) for `config.init`, without weights. The model config is
  the retriever weights' (the encoder's must have the same sizes); the vocab file theirs, else
  config.vocab_file (init=random: config.vocab_file, else the MiniLM package's uncased one)."""
  weights = starting_weights(config)
  if weights:
    model_config = weights["retriever"].config
    vocab = weights["retriever"].vocab(config.get("vocab_file", ""))
  else:
    model_config = RealmConfig(**dict(config.model))
    vocab = config.vocab_file or resolve(MINILM, flag="--config.vocab_file").vocab()
  model_config = sized_model_config(config, model_config)
  mask_id = BertTokenizer(vocab).mask_id if config.get("query_hides_mask", False) else -1
  return make_models(config, model_config, mask_id), model_config, vocab


def make_models(config, model_config: RealmConfig, mask_id: int = -1) -> RealmModels:
  """The modules of a run of `config` with the given (sized) model config: the encoder's, and the
  retriever's unless config.retriever_num_layers keeps fewer of its layers. Pooling follows the
  weights: MiniLM is mean-pooled and L2-normalised, HF REALM uses its projected [CLS], random
  models take config.pooling / config.normalize. With config.query_hides_mask, the query tower
  ignores the [MASK] token `mask_id` (no parameter depends on it). config.retriever_learning_rate
  = 0 freezes the retriever (`RealmModels.train_retriever`)."""
  if config.init == "minilm":
    pooling, normalize = "mean", True
  elif config.init == "hf":
    pooling, normalize = "projected_cls", False
  else:
    pooling, normalize = config.get("pooling", "projected_cls"), config.get("normalize", False)
  return RealmModels(
      RealmRetriever(retriever_model_config(config, model_config),
                     share_embedders=config.share_embedders, pooling=pooling,
                     normalize=normalize, query_ignore_id=mask_id),
      KnowledgeAugEncoder(model_config), float(config.score_scale),
      train_retriever=config.get("retriever_learning_rate", -1.0) != 0)


def param_shapes(models: RealmModels, model_config: RealmConfig) -> dict:
  """Shapes and dtypes of the parameters {"retriever", "encoder"}, nothing allocated."""
  key = jax.random.key(0)
  return {"retriever": jax.eval_shape(lambda r: _init(models.retriever, model_config, r), key),
          "encoder": jax.eval_shape(lambda r: _init(models.encoder, model_config, r), key)}


def identity_mlm_transform(encoder_params: dict) -> dict:
  """Encoder parameters whose MLM transform's dense layer is the identity (zero bias).

  The decoder is tied to the word embeddings, so the head then starts by scoring each word by how
  close its embedding is to the (GELU'd, normalised) hidden state: a hidden state that attention
  filled with a word of the evidence already points at that word. Measured on the demo with the
  sentence's own block as the only candidate (300 steps, lr 1e-3): held-out accuracy 8.2% vs
  4.3% with the null document, against 4.6% vs 2.8% with a random transform.
  """
  flat = traverse_util.flatten_dict(encoder_params)
  key = ("cls", "predictions", "transform", "dense")
  h = flat[key + ("kernel",)].shape[0]
  flat[key + ("kernel",)] = np.eye(h, dtype=np.float32)
  flat[key + ("bias",)] = np.zeros((h,), np.float32)
  return traverse_util.unflatten_dict(flat)


def bert_mlm_head(encoder_params: dict, extras: dict, source: str) -> dict:
  """The encoder's MLM head `{"cls": ...}` from the `cls.predictions.*` entries of a BERT
  checkpoint (HF BertForPreTraining / BertForMaskedLM, e.g. bert-base-uncased: REALM's head, same
  names, decoder tied to the word embeddings); {} when the checkpoint has no MLM head.

  `encoder_params` gives the head's paths; `extras` are the entries a "bert" load left unused.
  """
  if not any(k.startswith(_MLM_HEAD) for k in extras):
    return {}
  flat = {}
  for path in traverse_util.flatten_dict(encoder_params):
    if path[0] != "cls":
      continue
    key, transpose = hf_key(path)
    if key not in extras:
      raise CheckpointError(f"{source} has an MLM head ({_MLM_HEAD}*) without {key!r}: pass a "
                            "complete BertForPreTraining / BertForMaskedLM checkpoint, or a BERT "
                            "without any MLM head (the encoder then starts with a new one).")
    value = np.asarray(extras[key])
    flat[path] = value.T if transpose else value
  return traverse_util.unflatten_dict(flat)


def init_params(config, models: RealmModels, model_config: RealmConfig, rng) -> dict:
  """Starting weights {"retriever", "encoder"} (float32, on the host).

  With config.init='hf', a BERT `encoder_weights` that has an MLM head (bert-base-uncased's
  BertForPreTraining) gives the encoder that head too; only a BERT without one gets a new head.
  """
  head_init = config.get("mlm_transform_init", "random")
  if head_init not in MLM_TRANSFORM_INITS:
    raise ValueError(f"--config.mlm_transform_init={head_init!r}: use one of {MLM_TRANSFORM_INITS}.")
  weights = starting_weights(config)
  if config.init == "hf":
    retriever, encoder = weights["retriever"], weights["encoder"]
    retriever.check_kind(("embedder", "retriever"),
                         "a REALM embedder or scorer (e.g. ICT's export, experiments/ict.py)")
    if retriever.kind == "retriever" and retriever_pooling(retriever.names) != "projected_cls":
      raise ValueError(
          f"--config.retriever_weights={retriever.source} is a mean-pooled scorer (no [CLS] "
          "projection `cls.dense`, e.g. a DPR or ICT export trained with pooling=mean); "
          "pre-training with init=hf reads REALM's projected [CLS]. Use a scorer trained with "
          "--config.pooling=projected_cls, or --config.init=minilm.")
    kind = encoder.check_kind(("encoder", "bert"),
                              "a REALM knowledge-augmented encoder or a BERT")
    has_head = kind == "encoder" or any(k.startswith(_MLM_HEAD) for k in encoder.names)
    if has_head and head_init == "identity":
      raise ValueError(f"--config.mlm_transform_init='identity' would overwrite the MLM head of "
                       f"{encoder.name}; keep the default 'random' (only a new head "
                       "is initialised).")
  r1, r2 = jax.random.split(rng)
  params = {"retriever": _init(models.retriever, model_config, r1),
            "encoder": _init(models.encoder, model_config, r2)}
  if config.init == "minilm":
    bert, _ = weights["encoder"].load()
    towers = ["embedder"] + ([] if config.share_embedders else ["query_embedder"])
    for t in towers:
      params["retriever"][t] = overlay(params["retriever"][t], {"realm": bert}, "MiniLM")
    params["encoder"] = overlay(params["encoder"], {"realm": bert}, "MiniLM")
  elif config.init == "hf":
    retr, _ = retriever.load(config=retriever_model_config(config, model_config))
    if "embedder" not in retr:  # an embedder checkpoint: both towers start from it
      retr = {"embedder": retr}
    if config.share_embedders and "query_embedder" in retr:
      logging.warning("%s has a separate query tower (e.g. from ICT), but share_embedders=True "
                      "uses only its document tower; set --config.share_embedders=False to keep "
                      "both.", retriever.name)
    if not config.share_embedders and "query_embedder" not in retr:
      retr["query_embedder"] = retr["embedder"]
    params["retriever"] = overlay(params["retriever"], retr, retriever.name)
    enc, extras = encoder.load(kind, model_config, strict=False)
    if kind != "encoder":  # a BERT: its MLM head, if it has one, is the encoder's
      enc = {"realm": enc, **bert_mlm_head(params["encoder"], extras, encoder.name)}
    params["encoder"] = overlay(params["encoder"], enc, encoder.name)
  if head_init == "identity":
    params["encoder"] = identity_mlm_transform(params["encoder"])
  return jax.tree.map(lambda x: np.asarray(x, np.float32), params)
