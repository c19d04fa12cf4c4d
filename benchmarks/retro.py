"""RETRO's costs, in one run: the training step with retrieval vs the baseline decoder of the same
size (tokens/s: what retrieval costs), the chunk database's build time per million chunks, and the
neighbour search's queries/s (numpy brute force, realm_jax exact, ScaNN).

  python benchmarks/retro.py                              # the demo's shapes, this machine
  python benchmarks/retro.py --config=realm_jax/configs/retro.py:paper_172m --steps=3 --batch=2
  python benchmarks/retro.py --db=work/retro_demo/db      # search over that database's keys

The step: random tokens and neighbours of the config's shapes, `train/retro.py`'s loss and
optimiser, jitted with the state donated, `--steps` timed after one warm-up step. On a GPU or TPU
it also prints the model FLOPs utilisation (6 x parameters x tokens plus attention, the
encoder's neighbour tokens included, over the device's peak from --peak_tflops).

The database (`--db`, default: built here from the first --max_docs articles of the embedded
corpus into a temporary directory): its manifest's seconds per stage, per million chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np


def step_times(config, steps: int, batch: int) -> dict:
  import jax
  import optax
  from realm_jax.models.retro import RetroConfig, RetroModel
  from realm_jax.train.retro import optimizer, sequence_loss

  c = config.model
  length = config.db.chunk_length * config.db.seq_chunks
  m, k, vocab = config.db.chunk_length, c.num_neighbours, 30522
  rng = np.random.default_rng(0)
  out = {}
  for name, retrieval in (("baseline", False), ("retro", True)):
    layers = tuple(c.cca_layers) or tuple(range(c.cca_start, c.num_layers + 1, c.cca_every))
    mc = RetroConfig(vocab_size=vocab, num_layers=c.num_layers, hidden_size=c.hidden_size,
                     num_heads=c.num_heads, mlp_size=c.mlp_size, max_length=c.max_length,
                     chunk_length=m, cca_layers=layers if retrieval else (),
                     encoder_layers=c.encoder_layers,
                     encoder_size=c.encoder_size if retrieval else 0, num_neighbours=k,
                     dtype=c.dtype, remat=c.remat)
    module = RetroModel(mc)
    b = {"inputs": rng.integers(1, vocab, (batch, length)).astype(np.int32),
         "targets": rng.integers(1, vocab, (batch, length)).astype(np.int32),
         "neighbours": rng.integers(1, vocab, (batch, length // m, k, 2 * m)).astype(np.int32),
         "loss_mask": np.ones((batch, length), np.float32),
         "target_bytes": np.full((batch, length), 4.8, np.float32)}
    params = jax.jit(lambda key: module.init(key, b["inputs"][:1],
                                             b["neighbours"][:1] if retrieval else None)
                     ["params"])(jax.random.key(0))
    config.num_steps = max(config.num_steps, 2)
    _, tx = optimizer(config, params)
    opt = tx.init(params)

    def step(params, opt, batch):
      (loss, _), grads = jax.value_and_grad(
          lambda p: sequence_loss(module, p, batch, retrieval), has_aux=True)(params)
      updates, opt = tx.update(grads, opt, params)
      return optax.apply_updates(params, updates), opt, loss

    fn = jax.jit(step, donate_argnums=(0, 1))
    params, opt, loss = fn(params, opt, b)
    loss.block_until_ready()
    start = time.perf_counter()
    for _ in range(steps):
      params, opt, loss = fn(params, opt, b)
    loss.block_until_ready()
    seconds = (time.perf_counter() - start) / steps
    n_params = sum(x.size for x in jax.tree.leaves(params))
    enc_tokens = (length // m) * k * 2 * m if retrieval else 0
    out[name] = {"ms_per_step": 1000 * seconds, "tokens_per_s": batch * length / seconds,
                 "params": int(n_params), "neighbour_tokens_per_sequence": enc_tokens,
                 "flops_per_step": 6.0 * n_params * batch * (length + enc_tokens)}
  out["retro_cost"] = out["retro"]["ms_per_step"] / out["baseline"]["ms_per_step"]
  return out


def database(args) -> dict:
  from realm_jax.configs.retro import get_config
  from realm_jax.retrieval.chunk_db import RetroDb, build_database
  if args.db:
    db = RetroDb.open(args.db, verify=False)
  else:
    config = get_config("demo").db
    config.max_docs = args.max_docs
    db = build_database(config, os.path.join(tempfile.mkdtemp(), "db"))
  manifest = db.manifest
  chunks = sum(manifest["counts"][s]["chunks"] for s in ("train", "heldout"))
  seconds = manifest["seconds"]
  per_million = {k: v * 1e6 / chunks for k, v in seconds.items()}
  return {"directory": db.directory, "chunks": chunks, "seconds": seconds,
          "seconds_per_million_chunks": per_million,
          "total_per_million_chunks_h": sum(per_million.values()) / 3600, "db": db}


def search(db, queries: int, k: int) -> dict:
  from realm_jax.retrieval.index import DocIndex
  keys = np.asarray(db.array("train", "keys"), np.float32)
  rng = np.random.default_rng(0)
  q = keys[rng.integers(0, len(keys), queries)] + 0.05 * rng.standard_normal(
      (queries, keys.shape[1])).astype(np.float32)
  out = {"rows": len(keys), "dim": int(keys.shape[1]), "queries": queries}
  start = time.perf_counter()
  scores = q @ keys.T
  truth = np.argpartition(-scores, k, axis=1)[:, :k]
  out["numpy"] = {"queries_per_s": queries / (time.perf_counter() - start), "recall": 1.0}
  for name in ("exact", "scann"):
    try:
      index = DocIndex(keys, np.arange(len(keys)), name)
    except (ImportError, ValueError) as e:  # ScaNN on a tiny database, or not installed
      out[name] = {"error": str(e)[:200]}
      continue
    index.search(q, k)
    start = time.perf_counter()
    _, ids = index.search(q, k)
    qps = queries / (time.perf_counter() - start)
    recall = np.mean([len(set(a) & set(b)) / k for a, b in zip(ids, truth)])
    out[name] = {"queries_per_s": qps, "recall": float(recall)}
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="realm_jax/configs/retro.py:demo")
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--batch", type=int, default=0, help="0: the config's batch_size")
  ap.add_argument("--db", default="", help="a built chunk database (default: build one)")
  ap.add_argument("--max_docs", type=int, default=2000)
  ap.add_argument("--queries", type=int, default=2000)
  ap.add_argument("--k", type=int, default=2)
  ap.add_argument("--peak_tflops", type=float, default=0.0,
                  help="the device's peak (bf16 dense) for MFU; 0: not printed")
  ap.add_argument("--json", default="", help="also write the results here")
  args = ap.parse_args()
  import importlib.util

  import jax
  path, _, variant = args.config.partition(":")
  spec = importlib.util.spec_from_file_location("retro_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(variant or "demo")
  device = jax.devices()[0]
  print(f"device: {device.platform} {device.device_kind} x {jax.device_count()}")
  steps = step_times(config, args.steps, args.batch or config.batch_size)
  for name in ("baseline", "retro"):
    s = steps[name]
    line = (f"{name:8s} {s['ms_per_step']:9.1f} ms/step {s['tokens_per_s']:9.1f} tokens/s "
            f"{s['params'] / 1e6:6.2f}M params")
    if args.peak_tflops:
      line += f"  MFU {s['flops_per_step'] / (s['ms_per_step'] / 1e3) / (args.peak_tflops * 1e12):.3f}"
    print(line)
  print(f"retrieval costs {steps['retro_cost']:.2f}x the baseline's step time")
  db = database(args)
  print(f"database: {db['chunks']:,} chunks; seconds per stage {db['seconds']}; "
        f"{db['total_per_million_chunks_h']:.2f} h per million chunks on this machine")
  found = search(db.pop("db"), args.queries, args.k)
  for name in ("numpy", "exact", "scann"):
    r = found[name]
    said = (f"{r['queries_per_s']:10.1f} queries/s, recall@{args.k} {r['recall']:.3f}"
            if "queries_per_s" in r else r["error"])
    print(f"neighbour search {name:6s}: {said}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"device": str(device), "steps": steps, "database": db, "search": found}, f,
                indent=1)


if __name__ == "__main__":
  main()
