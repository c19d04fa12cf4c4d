"""SmolLM2-135M in realm_jax vs Hugging Face PyTorch `LlamaForCausalLM` (the same GGUF weights),
side by side in one run on this machine, and what retrieval costs a RETROfit:

  forward       logits of B x L tokens: realm_jax (jit, float32) vs PyTorch (no_grad, float32)
  train step    next-token loss, backward and AdamW over every decoder weight (no retrieval):
                realm_jax (the trainer's step, train/lm_step.train_step: its loss, guarded AdamW
                update and gradient norm, jitted, state donated) vs
                PyTorch (loss.backward(), torch.optim.AdamW)
  RETROfit step the retrofit_smollm2 config's step (decoder frozen, 5 CCA layers trained), its
                model built as retro_train.py builds it (train/lm_step.model_config): the default,
                CCA reading the decoder's own states of the neighbours, and the paper's variant
                (--config.model.cca_memory=encoder: a 2-layer neighbour encoder), each against
                realm_jax's forward: the cost of retrieval

  python benchmarks/smollm2.py                     # B 8 x 256 tokens, the RETROfit's shapes
  python benchmarks/smollm2.py --batch=2 --repeats=2

Each figure is the median of --repeats timed calls after one warm-up call (compilation). Both
frameworks use every core (torch.set_num_threads(os.cpu_count())). Prints a table and writes
benchmarks/results/smollm2.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
import types

import numpy as np


def _median_seconds(fn, repeats: int) -> float:
  fn()  # warm-up: compilation, allocation
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--length", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default="benchmarks/results/smollm2.json")
  args = parser.parse_args()

  import jax
  import torch
  import transformers

  from realm_jax.checkpoints import decoder
  from realm_jax.checkpoints.llama import SMOLLM2
  from realm_jax.configs.retro import get_config
  from realm_jax.models.retro import RetroConfig, RetroModel
  from realm_jax.text.lm_tokenizer import smollm2_path
  from realm_jax.train.lm_step import init_params, model_config, optimizer, train_step
  from realm_jax.train.realm_step import TrainState

  torch.set_num_threads(os.cpu_count())
  b, length = args.batch, args.length
  config = get_config("retrofit_smollm2")
  m, k = config.db.chunk_length, config.model.num_neighbours
  rng = np.random.default_rng(0)
  settings = decoder.decoder_settings(SMOLLM2)
  vocab = settings["vocab_size"]
  batch = {"inputs": rng.integers(17, vocab, (b, length)).astype(np.int32),
           "targets": rng.integers(17, vocab, (b, length)).astype(np.int32),
           "neighbours": rng.integers(17, vocab, (b, length // m, k, 2 * m)).astype(np.int32),
           "segments": np.zeros((b, length), np.int32),
           "loss_mask": np.ones((b, length), np.float32),
           "target_bytes": np.full((b, length), 4.6, np.float32)}
  weights = decoder.load_decoder(SMOLLM2)
  results = {}

  # realm_jax: forward, full training step, RETROfit step.
  plain = RetroModel(RetroConfig(**settings))
  params = jax.device_put(weights)
  fwd = jax.jit(lambda p, t, s: plain.apply({"params": p}, t, segments=s))
  results["jax_forward_s"] = _median_seconds(
      lambda: jax.block_until_ready(fwd(params, batch["inputs"], batch["segments"])), args.repeats)

  def trainer(module, params, retrieval, freeze):
    """The trainer's own step (train/lm_step.train_step: loss, guarded AdamW update, grad norm),
    jitted with its state donated as the loop does; dropout as the config says (0: none)."""
    cfg = get_config("retrofit_smollm2")
    cfg.freeze_decoder, cfg.num_steps = freeze, 100
    _, tx = optimizer(cfg, params)
    state = TrainState.create(apply_fn=None, params=params, tx=tx)
    step = jax.jit(functools.partial(train_step, module=module, retrieval=retrieval,
                                     freeze_decoder=freeze, dropout=cfg.model.dropout > 0),
                   donate_argnums=0)
    box, rng = [state], jax.random.key(0)

    def run():
      box[0], out = step(box[0], batch, rng)
      jax.block_until_ready((box[0], out))
    return run

  results["jax_train_step_s"] = _median_seconds(trainer(plain, params, False, False),
                                                args.repeats)
  # The RETROfit's model as the trainer builds it from the config (its database stands in: the
  # tokenizer and the chunking are all model_config reads of it).
  db = types.SimpleNamespace(tokenizer=decoder.load_tokenizer(SMOLLM2), chunk_length=m,
                             seq_chunks=length // m)
  for memory in ("decoder", "encoder"):
    cfg = get_config("retrofit_smollm2")
    cfg.model.cca_memory = memory
    retro = RetroModel(model_config(cfg, db, True))
    init = jax.jit(functools.partial(init_params, retro, db.seq_chunks, True))(jax.random.key(0))
    rparams = decoder.retrofit(init, weights)
    results[f"jax_retrofit_{memory}_step_s"] = _median_seconds(
        trainer(retro, rparams, True, True), args.repeats)
    del rparams, init

  # Hugging Face PyTorch, the same GGUF.
  path = smollm2_path("--benchmark")
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
  tokens = torch.as_tensor(batch["inputs"], dtype=torch.long)
  targets = torch.as_tensor(batch["targets"], dtype=torch.long)
  hf.eval()

  def hf_forward():
    with torch.no_grad():
      hf(tokens)
  results["torch_forward_s"] = _median_seconds(hf_forward, args.repeats)
  hf.train()
  opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1)

  def hf_step():
    opt.zero_grad(set_to_none=True)
    logits = hf(tokens).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
    opt.step()
  results["torch_train_step_s"] = _median_seconds(hf_step, args.repeats)

  tokens_per_call = b * length
  rows = [("forward", "jax_forward_s", "torch_forward_s"),
          ("training step (every weight)", "jax_train_step_s", "torch_train_step_s")]
  cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
              if line.startswith("model name")), "?")
  print(f"SmolLM2-135M, B {b} x L {length} tokens, float32, {os.cpu_count()} cores ({cpu})\n")
  print("| what | realm_jax tokens/s | PyTorch tokens/s | realm_jax / PyTorch |")
  print("| --- | --- | --- | --- |")
  for name, ours, theirs in rows:
    a, t = tokens_per_call / results[ours], tokens_per_call / results[theirs]
    print(f"| {name} | {a:,.0f} | {t:,.0f} | {a / t:.2f}x |")
  print()
  for memory, name in (("decoder", "the default, CCA reading the decoder's states"),
                       ("encoder", "the paper's neighbour encoder")):
    step = results[f"jax_retrofit_{memory}_step_s"]
    print(f"RETROfit step ({name}): {step:.2f} s ({tokens_per_call / step:,.0f} tokens/s) = "
          f"{step / results['jax_forward_s']:.2f}x the frozen decoder's forward "
          f"({results['jax_forward_s']:.2f} s)")
  results.update(batch=b, length=length, repeats=args.repeats, cpu=cpu, cores=os.cpu_count(),
                 jax=jax.__version__, torch=torch.__version__)
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out + ".tmp", "w") as f:
    json.dump(results, f, indent=1)
  os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
  main()
