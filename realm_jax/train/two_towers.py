"""What the retriever trainers (ICT, DPR) share: the two-tower retriever they train, its starting
weights, the in-batch softmax loss and the export that build_index.py, pre-training, fine-tuning
and ask.py read.

Towers: separate query and document BERTs (`RealmRetriever(share_embedders=False)`), pooled
either as REALM's projected [CLS] (`projected_cls`, scores used as they are) or as
sentence-transformers' L2-normalised mean of the word pieces (`mean`, cosines scaled by the
trainer's score scale), which is how all-MiniLM-L6-v2 was trained.

The export is a HF REALM scorer directory (config.json, model.safetensors with `embedder` and
`query_embedder`, vocab.txt). A mean-pooled export has no [CLS] projection (`cls.dense`) and no
pooler: `retrieval/towers.py` reads it with mean pooling and normalisation by itself.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from realm_jax.checkpoints.export import export_hf
from realm_jax.checkpoints.hf import overlay
from realm_jax.checkpoints.weights import MINILM, Weights, resolve
from realm_jax.io_utils import as_path
from realm_jax.models.config import RealmConfig
from realm_jax.models.retriever import POOLINGS, RealmRetriever
from realm_jax.train import loop
from realm_jax.train.init import sized_model_config

Array = jax.Array
INITS = ("minilm", "bert", "random")


def bert_weights(config) -> Weights | None:
  """The weights whose BERT both towers start from: the installed all-MiniLM-L6-v2 (init=minilm),
  config.bert_weights (init=bert: a HF BERT directory or a TF1 BERT checkpoint), or None
  (random)."""
  if config.init not in INITS:
    raise ValueError(f"--config.init={config.init!r}: use one of {INITS}.")
  if config.init == "minilm":
    return resolve(MINILM, flag="--config.init")
  if config.init == "bert":
    return resolve(config.bert_weights, flag="--config.bert_weights")
  return None


def pooling_of(config) -> str:
  """config.pooling ("auto": mean for MiniLM, which was trained so, else projected_cls); configs
  without the setting (ICT's) pool REALM's way."""
  pooling = config.get("pooling", "projected_cls")
  if pooling == "auto":
    return "mean" if config.init == "minilm" else "projected_cls"
  if pooling not in POOLINGS:
    raise ValueError(f"--config.pooling={pooling!r}: use auto, {' or '.join(POOLINGS)}.")
  return pooling


def build_retriever(config) -> tuple[RealmRetriever, RealmConfig, str]:
  """(separate-tower retriever, its config, vocab file).

  config.init: "minilm" (the installed all-MiniLM-L6-v2), "bert" (config.bert_weights, a HF BERT
  directory with config.json, model.safetensors, vocab.txt) or "random" (config.model). The vocab
  file: config.vocab_file when given (init=bert or random), else the weights' (random: MiniLM's).
  Mean pooling is L2-normalised; projected [CLS] is not.
  """
  weights = bert_weights(config)
  pooling = pooling_of(config)
  if weights is None:
    model_config = RealmConfig(**dict(config.model))
    vocab = config.vocab_file or resolve(MINILM, flag="--config.vocab_file").vocab()
  else:
    model_config = weights.config
    override = config.vocab_file if config.init == "bert" else ""  # MiniLM reads its own vocab
    vocab = override or weights.vocab()
  model_config = sized_model_config(config, model_config)
  model = RealmRetriever(model_config, share_embedders=False, pooling=pooling,
                         normalize=pooling == "mean")
  return model, model_config, vocab


def init_params(config, model: RealmRetriever, model_config: RealmConfig, rng) -> dict:
  """{"embedder", "query_embedder"} (float32, on the host): both towers' BERT from the weights of
  config.init, the pooler and projection (projected_cls, when the weights lack them) at random."""
  ids = jnp.zeros((1, 8), jnp.int32)
  q = dict(input_ids=ids, attention_mask=ids, token_type_ids=ids)
  # One compiled program rather than hundreds of eagerly compiled ops.
  params = jax.jit(model.init)(rng, q, {k: v[:, None] for k, v in q.items()})["params"]
  weights = bert_weights(config)
  if weights is not None:
    bert, _ = weights.load("bert", model_config, strict=False)
    params = {t: overlay(p, {"realm": bert}, weights.name) for t, p in params.items()}
  return jax.tree.map(lambda x: np.asarray(x, np.float32), params)


def embed(params, model: RealmRetriever, inputs: dict, method: str, rng) -> Array:
  """[B, D] embeddings of {input_ids, attention_mask, token_type_ids} [B, L] by one tower
  (`method`: "embed_queries" or "embed_documents"); dropout when `rng` is given."""
  return model.apply({"params": params}, inputs["input_ids"], inputs["attention_mask"],
                     inputs["token_type_ids"], rng is None, method=method,
                     rngs=None if rng is None else {"dropout": rng})


def in_batch_metrics(logits: Array) -> tuple[Array, dict[str, Array]]:
  """Softmax cross-entropy of logits [B, C] (C >= B) with label i for row i, and its retrieval
  metrics.

  Returns (loss [], {loss, accuracy (argmax == i), mean_rank (1 = best), recall_at_5}), means
  over the B queries.
  """
  logits = logits.astype(jnp.float32)
  b = logits.shape[0]
  labels = jnp.arange(b)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  positive = logits[labels, labels]                                         # [B]
  rank = 1 + jnp.sum(logits > positive[:, None], axis=-1)                   # [B]
  return loss, {"loss": loss,
                "accuracy": jnp.mean(jnp.argmax(logits, axis=-1) == labels),
                "mean_rank": jnp.mean(rank.astype(jnp.float32)),
                "recall_at_5": jnp.mean(rank <= 5)}


def export_retriever(directory: str, model_config: RealmConfig, params, vocab_file: str) -> None:
  """Writes `directory` as a HF REALM scorer (`export_hf`)."""
  export_hf(directory, model_config, params, "retriever", vocab_file)


class RetrieverTrainer(loop.TrainLoop):
  """What a retriever trainer (ICT, DPR) adds to the loop: the learning rate in the train metrics,
  mean in-batch metrics over a few fixed batches, and the export when the run ends. A subclass
  sets `export_dir`, `model_config`, `vocab_file`, `schedule` and `eval_fn(params, batch)`."""

  def train_metrics(self, step: int) -> dict[str, float]:
    return {"learning_rate": float(self.schedule(step))}

  def mean_in_batch_metrics(self, batches) -> dict[str, float] | None:
    """The mean of `eval_fn` (no dropout) over the first config.eval_batches of `batches` (global
    arrays); None when `batches` yields none."""
    sums, n = None, 0
    for i, batch in enumerate(batches):
      if i >= self.config.eval_batches:
        break
      out = jax.device_get(self.eval_fn(self.state.params, batch))
      sums = out if sums is None else jax.tree.map(np.add, sums, out)
      n += 1
    return None if n == 0 else {k: float(v) / n for k, v in sums.items()}

  def export(self) -> None:
    if jax.process_index() == 0:
      export_retriever(self.export_dir, self.model_config, self.state.params, self.vocab_file)

  def finish(self, last_eval: dict[str, float], trained: bool) -> dict[str, float]:
    if trained or not as_path(os.path.join(self.export_dir, "config.json")).exists():
      self.export()
    return last_eval
