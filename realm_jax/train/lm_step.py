"""RETRO's decoder language-model step, below its trainer (realm_jax/train/retro.py) so that
realm_jax/compile compiles the same step: the RetroConfig of a run, its random parameters,
AdamW (a RETROfit's frozen decoder gets no update), the next-token loss and `train_step`.

A batch (retro_batches' arrays, sharded along B): inputs, segments, targets [B, L] int32;
loss_mask, target_bytes [B, L] float32; neighbours [B, n, k, 2m] int32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from realm_jax.checkpoints import decoder
from realm_jax.models.retro import RetroConfig, RetroModel, cca_layers, token_nll
from realm_jax.train.optimizer import default_warmup_steps
from realm_jax.train.realm_step import loss_step

LN2 = math.log(2.0)


def model_config(config, db, retrieval: bool) -> RetroConfig:
  """The decoder of a run: config.model's shapes (or the pre-trained decoder's, RETROfitting),
  the database's tokens and chunks; no CCA for the baseline. `db`: a RetroDb, or anything with
  its tokenizer, chunk_length and seq_chunks (realm_jax/compile/steps.py: a database not built)."""
  c = config.model
  fields = dict(num_layers=c.num_layers, hidden_size=c.hidden_size, num_heads=c.num_heads,
                mlp_size=c.mlp_size, max_length=c.max_length, vocab_size=db.tokenizer.vocab_size,
                family=c.family, num_kv_heads=c.num_kv_heads, rope_theta=c.rope_theta)
  if config.init != "random":
    fields.update(decoder.decoder_settings(config.init, flag="--config.init"))
    own = decoder.load_tokenizer(config.init, flag="--config.init")
    if (own is not None and own.name != db.tokenizer.name) or (
        fields["vocab_size"] != db.tokenizer.vocab_size):
      raise ValueError(
          f"--config.init={config.init} reads its own tokenizer "
          f"({own.name if own else str(fields['vocab_size']) + ' tokens'}), but the chunk "
          f"database was built with another ({db.tokenizer.name}): build the database with "
          f"--config.db.tokenizer_file={decoder.tokenizer_source(config.init)} (another "
          "--config.db.dir).")
  length = db.chunk_length * db.seq_chunks
  if length > fields["max_length"]:
    raise ValueError(f"The database's sequences ({length} tokens) are longer than the decoder's "
                     f"context ({fields['max_length']}): lower --config.db.seq_chunks.")
  layers = tuple(c.cca_layers) or cca_layers(fields["num_layers"], c.cca_start, c.cca_every)
  return RetroConfig(**fields, chunk_length=db.chunk_length,
                     cca_layers=layers if retrieval else (), encoder_layers=c.encoder_layers,
                     encoder_size=c.encoder_size if retrieval else 0,
                     num_neighbours=c.num_neighbours, pad_id=db.tokenizer.pad_id,
                     dropout=c.dropout, dtype=c.dtype, remat=c.remat,
                     zero_init_cca=c.zero_init_cca, attention=c.attention,
                     encoder_input_norm=c.encoder_input_norm, cca_memory=c.cca_memory)


def decay_mask(params):
  """Weight decay on kernels and embeddings; not on biases, LayerNorms, position-bias tables."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], "key", "") in ("kernel", "embedding"), params)


def trainable(params, freeze_decoder: bool):
  """"train" / "frozen" per parameter: frozen = the pre-trained decoder when RETROfitting."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "frozen" if freeze_decoder and decoder.is_decoder_param(path) else "train",
      params)


def optimizer(config, params) -> tuple[optax.Schedule, optax.GradientTransformation]:
  """(schedule, AdamW): linear warmup (warmup_steps; -1: BERT's default) then cosine decay to
  a tenth; b2 0.95; decay on kernels and embeddings; the frozen decoder gets no update."""
  warmup = (default_warmup_steps(config.num_steps) if config.warmup_steps < 0
            else config.warmup_steps)
  warmup = min(warmup, config.num_steps - 1)
  schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, max(warmup, 1),
                                                config.num_steps, config.learning_rate * 0.1)
  adamw = optax.chain(optax.clip_by_global_norm(config.clip_norm),
                      optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8,
                                  weight_decay=config.weight_decay, mask=decay_mask))
  tx = optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()},
                             trainable(params, config.freeze_decoder))
  return schedule, tx


def sequence_loss(module: RetroModel, params, batch: dict, retrieval: bool,
                  dropout_rng=None) -> tuple[jax.Array, dict]:
  """(mean next-token loss over scored targets, summed statistics) of a batch: nats (`nll`),
  scored tokens, and the bytes those tokens stand for (`bytes`: bits per byte = nll / ln 2 /
  bytes)."""
  rngs = {"dropout": dropout_rng} if dropout_rng is not None else {}
  logits = module.apply({"params": params}, batch["inputs"],
                        batch["neighbours"] if retrieval else None,
                        deterministic=dropout_rng is None, rngs=rngs,
                        segments=batch.get("segments"))
  nll = token_nll(logits, batch["targets"]) * batch["loss_mask"]
  tokens = batch["loss_mask"].sum()
  stats = {"nll": nll.sum(), "tokens": tokens, "bytes": batch["target_bytes"].sum()}
  return nll.sum() / jnp.maximum(tokens, 1.0), stats


def init_params(module: RetroModel, seq_chunks: int, retrieval: bool, rng) -> dict:
  """Random parameters of `module` (traced on one sequence of `seq_chunks` chunks and, with
  `retrieval`, its neighbours); under jax.eval_shape, their shapes alone."""
  m = module.config
  tokens = jnp.zeros((1, seq_chunks * m.chunk_length), jnp.int32)
  neighbours = (jnp.zeros((1, seq_chunks, m.num_neighbours, 2 * m.chunk_length), jnp.int32)
                if retrieval else None)
  return module.init(rng, tokens, neighbours)["params"]


def train_step(state, batch: dict, rng, *, module: RetroModel, retrieval: bool,
               freeze_decoder: bool, dropout: bool):
  """One update on a batch (retro_batches' arrays): next-token loss, AdamW through `state.tx`.
  Returns (state, {loss, bits_per_byte, grad_norm, skipped})."""
  def loss_fn(p, dropout_rng):
    if freeze_decoder:  # no gradient computed for the frozen decoder's weights
      p = decoder.freeze(p)
    loss, stats = sequence_loss(module, p, batch, retrieval, dropout_rng)
    return loss, {"loss": loss, "bits_per_byte": stats["nll"] / LN2 / stats["bytes"]}
  return loss_step(state, loss_fn, rng, dropout=dropout)
