"""RETRO training on the shared loop (experiments/retro_train.py): the chunk database once, then
the RETRO decoder and, on the same batches, the baseline decoder of the same size, then the
held-out evaluation (realm_jax/eval/retro.py).

    <workdir>/db            the chunk database (unless config.db.dir): tokens, keys, index,
                            precomputed neighbours (realm_jax/retrieval/chunk_db.py)
    <workdir>/retro         a run: checkpoints (state + data iterator), tb/, metrics.jsonl,
                            export/ (model.safetensors + retro.json) when it ends
    <workdir>/baseline      the same without retrieval (config.models)
    <workdir>/eval.json     held-out bits per byte (with / without neighbours / baseline), by
                            neighbour overlap; eval.md and bpb.png beside it

A step is next-token cross-entropy over the sequence's scored targets (padding and the stream's
first token are not), AdamW (b2 0.95, decay on kernels and embeddings only, global-norm clip) with
linear warmup and cosine decay. RETROfitting (config.init = smollm2, a GGUF or a HF GPT-2 / Llama
directory: checkpoints/decoder.py) loads the decoder and, with config.freeze_decoder, trains only
the neighbour encoder and the CCA layers.
"""

from __future__ import annotations

import functools
import logging
import os

import jax
import numpy as np

from realm_jax import config_checks, distributed, sharding, workdir_lock
from realm_jax.checkpoints import decoder, retro_export
from realm_jax.data.retro_batches import retro_batches
from realm_jax.models import flash
from realm_jax.models.retro import CCA_MEMORY, RetroModel
from realm_jax.retrieval.chunk_db import RetroDb, build_database
from realm_jax.train import loop, memory
# The step and what it is made of live below the trainer (realm_jax/compile compiles it too).
from realm_jax.train.lm_step import (LN2, init_params, model_config, optimizer, sequence_loss,
                                     train_step)

MODELS = ("retro", "baseline")
# What a run's parameters, optimiser state and data depend on: a workdir made with other values
# is refused (loop.check_workdir_config).
FIXED_SETTINGS = ("model", "init", "freeze_decoder", "batch_size", "seed", "db")


def database_dir(config, workdir: str) -> str:
  return config.db.dir or os.path.join(workdir, "db")


def check_settings(config, workdir: str) -> None:
  """Refuses settings no run can use, naming the flag, before the database or any compiling."""
  config_checks.workdir(workdir)
  sharding.check_config(config)
  loop.rng_impl(config)
  config_checks.at_least(config, {
      **loop.LOOP_MINIMUMS, "learning_rate": 0, "eval_sequences": 1, "eval_batch_size": 1,
      "model.num_layers": 1,
      "model.hidden_size": 8, "model.num_heads": 1, "model.mlp_size": 1,
      "model.encoder_layers": 1, "model.num_neighbours": 1, "model.cca_start": 1,
      "model.cca_every": 1, "db.chunk_length": 2, "db.seq_chunks": 1, "db.num_neighbours": 1,
      "db.key_length": 4, "db.max_docs": 0})
  config_checks.one_of(config, {"model.dtype": ("float32", "bfloat16"),
                                "model.family": ("gpt2", "llama")})
  config_checks.below(config, "model.num_neighbours", "db.num_neighbours")
  unknown = [m for m in config.models if m not in MODELS]
  if unknown or not config.models:
    raise ValueError(f"--config.models={tuple(config.models)!r}: name one or both of {MODELS}.")
  if config.model.num_kv_heads and config.model.num_heads % config.model.num_kv_heads:
    raise ValueError(f"--config.model.num_heads={config.model.num_heads} is not a multiple of "
                     f"--config.model.num_kv_heads={config.model.num_kv_heads}.")
  if config.model.hidden_size % config.model.num_heads:
    raise ValueError(f"--config.model.hidden_size={config.model.hidden_size} is not divisible by "
                     f"--config.model.num_heads={config.model.num_heads}.")
  length = config.db.chunk_length * config.db.seq_chunks
  if config.init == "random" and length > config.model.max_length:
    raise ValueError(f"Sequences of --config.db.seq_chunks={config.db.seq_chunks} chunks of "
                     f"--config.db.chunk_length={config.db.chunk_length} tokens ({length}) are "
                     f"longer than --config.model.max_length={config.model.max_length}.")
  if config.freeze_decoder and config.init == "random":
    raise ValueError("--config.freeze_decoder=True needs trained decoder weights: set "
                     "--config.init to smollm2, a .gguf file or a Hugging Face GPT-2 / Llama / "
                     "Mistral / Qwen2 directory (RETROfitting).")
  config_checks.one_of(config, {"model.attention": flash.ATTENTION,
                                "model.cca_memory": CCA_MEMORY})
  if config.db.heldout_percent <= 0:
    raise ValueError(f"--config.db.heldout_percent={config.db.heldout_percent!r}: the models are "
                     "evaluated on held-out documents, and none would be held out: give a "
                     "percentage above 0 (the configs hold out 10).")
  num_layers, family = config.model.num_layers, config.model.family
  if config.init != "random":  # the decoder's metadata alone (a missing one is refused here)
    settings = decoder.decoder_settings(config.init, flag="--config.init")
    num_layers, family = settings["num_layers"], settings["family"]
  _check_cca_layers(config, num_layers)
  if config.model.cca_memory == "decoder" and family != "llama":
    raise ValueError(f"--config.model.cca_memory=decoder reads the decoder's states with an "
                     f"attention shaped like a Llama-family layer's, and this decoder is {family} "
                     f"({'--config.init' if config.init != 'random' else '--config.model.family'})"
                     ": use --config.model.cca_memory=encoder.")


def _check_cca_layers(config, num_layers: int) -> None:
  """Refuses CCA layers outside the decoder's `num_layers` (1-based)."""
  c, of = config.model, ("--config.init" if config.init != "random"
                         else "--config.model.num_layers")
  bad = [l for l in c.cca_layers
         if isinstance(l, bool) or not isinstance(l, int) or not 1 <= l <= num_layers]
  if bad:
    raise ValueError(f"--config.model.cca_layers={tuple(c.cca_layers)!r}: {bad} are not layers of "
                     f"the decoder, 1 to {num_layers} ({of}): name layers among them, or give () "
                     "for every --config.model.cca_every-th from --config.model.cca_start.")


class RetroTrainer(loop.TrainLoop):
  """One decoder (RETRO, or the baseline with `retrieval=False`) trained on the database's train
  sequences; held-out evaluation on the first config.eval_sequences held-out sequences."""

  name = "retro"
  progress = {"loss": ("loss", ".3f"), "bpb": ("bits_per_byte", ".3f")}

  def __init__(self, config, workdir: str, db: RetroDb, retrieval: bool):
    super().__init__(config, workdir)
    self.name = "retro" if retrieval else "baseline"
    self.db, self.retrieval = db, retrieval
    if db.num_sequences("heldout") == 0:
      raise ValueError(f"The chunk database in {db.directory} has no held-out sequences: raise "
                       "--config.db.heldout_percent.")
    self.model_config = model_config(config, db, retrieval)  # refusals before the first write
    loop.check_workdir_config(config, workdir, FIXED_SETTINGS)
    self.module = RetroModel(self.model_config)
    est = memory.retro_estimate(config, jax.device_count(), self.model_config,
                                platform=memory.platform_of())
    logging.info("%s", memory.format_retro_estimate(est, title=f"{self.name}: memory per device "
                                                    "(estimate)"))
    params = self._initial_params()
    self.schedule, tx = optimizer(config, params)
    k = self.model_config.num_neighbours
    self.data_iterator = retro_batches(db, "train", batch_size=self.host_batch, seed=config.seed,
                                       num_neighbours=k, shard_index=jax.process_index(),
                                       shard_count=jax.process_count())
    self.heldout = [b for b in retro_batches(
        db, "heldout", batch_size=self.host_batch, seed=0, shuffle=False, num_epochs=1,
        num_neighbours=k, limit=config.eval_sequences)]
    module = self.module
    self.eval_fn = self.jit_eval(lambda p, b: sequence_loss(module, p, b, retrieval)[1])
    if retrieval:
      self.eval_off = self.jit_eval(lambda p, b: sequence_loss(module, p, b, False)[1])
    self.start(params, tx, functools.partial(
        train_step, module=module, retrieval=retrieval, freeze_decoder=config.freeze_decoder,
        dropout=config.model.dropout > 0))

  def _initial_params(self):
    c = self.config
    params = self.init_params(functools.partial(init_params, self.module, self.db.seq_chunks,
                                                self.retrieval), jax.random.key(c.seed))
    if c.init != "random":
      params = decoder.retrofit(params, decoder.load_decoder(c.init, flag="--config.init"),
                                flag="--config.init")
    return params

  def next_batch(self):
    return self.put(next(self.data_iterator))

  def checkpoint_meta(self, step):
    return {"step": step, "db_files_fingerprint": self.db.files_fingerprint}

  def resumed(self, meta):
    """Refuses to go on with a run trained on another database than `db` (rebuilt, or built from
    other text): its weights and its results would mix the two."""
    trained_on = (meta or {}).get("db_files_fingerprint")  # (None: saved before it was recorded)
    if trained_on is not None and trained_on != self.db.files_fingerprint:
      raise ValueError(
          f"{self.workdir} was trained on another chunk database than the one in "
          f"{self.db.directory} now (its files' fingerprint was {trained_on}, now "
          f"{self.db.files_fingerprint}: built again, or from other text). To train it on this "
          f"database, move {self.workdir} away (or delete it) and run again; to keep it, restore "
          "the database it was trained on, or give another --workdir.")

  def train_metrics(self, step):
    return {"learning_rate": float(self.schedule(step))}

  def _bpb(self, fn) -> dict[str, float]:
    sums = None
    for batch in self.heldout:
      out = jax.device_get(fn(self.state.params, self.put(batch)))
      sums = out if sums is None else jax.tree.map(np.add, sums, out)
    return {"loss": float(sums["nll"] / sums["tokens"]),
            "bits_per_byte": float(sums["nll"] / LN2 / sums["bytes"])}

  def evaluate(self):
    metrics = self._bpb(self.eval_fn)
    if self.retrieval:
      off = self._bpb(self.eval_off)
      metrics.update(loss_no_neighbours=off["loss"],
                     bits_per_byte_no_neighbours=off["bits_per_byte"])
    return metrics

  def finish(self, last_eval, trained):
    export = os.path.join(self.workdir, "export")
    if jax.process_index() == 0 and (trained or not os.path.exists(export)):
      retro_export.save(export, self.model_config, jax.device_get(self.state.params), {
          "step": int(self.state.step), "tokenizer": self.db.tokenizer.name,
          "key_fingerprint": self.db.manifest["key_fingerprint"],
          "db_fingerprint": self.db.manifest["fingerprint"],
          "db_files_fingerprint": self.db.files_fingerprint, "retrieval": self.retrieval})
      logging.info("Exported the %s decoder to %s", self.name, export)
    return last_eval


def train_and_evaluate(config, workdir: str) -> dict:
  """The database, then each of config.models trained to config.num_steps (resuming), then the
  held-out evaluation of them all; returns the evaluation report."""
  from realm_jax.eval import retro as retro_eval
  check_settings(config, workdir)
  if config.distributed:  # before the database's embedding, the first JAX work (loop.train's
    distributed.initialize()  # own call then finds it done)
  sharding.config_mesh(config)  # a mesh the devices cannot make: refused before the database
  if config.model.attention == "flash" and jax.default_backend() != "tpu":  # (devices known now)
    raise ValueError(f"--config.model.attention=flash is a TPU kernel and this run's devices are "
                     f"{jax.default_backend()}: use --config.model.attention=dense here, or "
                     "compile the step for a TPU slice with experiments/compile_for.py.")
  with workdir_lock.hold(workdir):  # one writer of the database and the report
    db = build_database(config.db, database_dir(config, workdir))
    for name in config.models:
      loop.train(lambda c, w, n=name: RetroTrainer(c, w, db, retrieval=n == "retro"), config,
                 os.path.join(workdir, name))
    exports = {name: os.path.join(workdir, name, "export") for name in config.models}
    return retro_eval.evaluate_exports(exports, db, workdir, batch_size=config.eval_batch_size)


def summary(report: dict, workdir: str) -> str:
  """The lines retro_train.py prints at its end."""
  from realm_jax.eval import retro as retro_eval
  return (retro_eval.markdown(report) + f"\nWritten to {os.path.join(workdir, 'eval.md')}, "
          f"eval.json and bpb.png.")
