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
  python benchmarks/smollm2.py --write_shapes=work/smollm2_shapes    # config.json, tokenizer.json
  python benchmarks/smollm2.py --decoder=work/smollm2_shapes --random_weights --dtype=bfloat16

--random_weights times the same shapes with random weights (both frameworks), for a machine without
the 98 MB weights (an accelerator host that only takes a small working tree): --write_shapes writes
a Hugging Face directory holding only SmolLM2's config.json, tokenizer.json (3.5 MB) and a shard
index naming no shards, and --decoder names it. --dtype=bfloat16 computes in bfloat16 on both
sides (realm_jax: the config's dtype, float32 parameters; PyTorch: torch.autocast). On a GPU,
PyTorch runs on it ("cuda").

Each figure is the median of --repeats timed calls after one warm-up call (compilation), whose
seconds are kept too (`*_first_call_s`). Both frameworks use every core
(torch.set_num_threads(os.cpu_count())). Prints each figure as it is measured, then a table;
writes benchmarks/results/smollm2.json again after each figure.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
import types

import numpy as np


def _median_seconds(fn, repeats: int) -> tuple[float, float]:
  """(median of `repeats` timed calls, the first call's seconds: compilation, allocation)."""
  t = time.perf_counter()
  fn()
  first = time.perf_counter() - t
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times), first


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--length", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default="benchmarks/results/smollm2.json")
  parser.add_argument("--decoder", default="smollm2",
                      help="smollm2 (the package's GGUF) or a Llama-family HF directory")
  parser.add_argument("--random_weights", action="store_true",
                      help="random weights of the decoder's shapes (no weights file read)")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  parser.add_argument("--write_shapes", metavar="DIR",
                      help="write SmolLM2's config.json and tokenizer.json to DIR and stop")
  args = parser.parse_args()
  if args.write_shapes:
    write_shapes(args.write_shapes)
    return

  import jax
  import torch
  import transformers

  from realm_jax.checkpoints import decoder
  from realm_jax.configs.retro import get_config
  from realm_jax.io_utils import write_json
  from realm_jax.models.retro import RetroConfig, RetroModel
  from realm_jax.text.lm_tokenizer import SMOLLM2, smollm2_path
  from realm_jax.train.lm_step import init_params, model_config, optimizer, train_step
  from realm_jax.train.realm_step import TrainState

  torch.set_num_threads(os.cpu_count())
  device = "cuda" if torch.cuda.is_available() else "cpu"
  b, length = args.batch, args.length
  source = args.decoder
  config = get_config("retrofit_smollm2")
  m, k = config.db.chunk_length, config.model.num_neighbours
  rng = np.random.default_rng(0)
  settings = decoder.decoder_settings(source, "--decoder")
  vocab = settings["vocab_size"]
  batch = {"inputs": rng.integers(17, vocab, (b, length)).astype(np.int32),
           "targets": rng.integers(17, vocab, (b, length)).astype(np.int32),
           "neighbours": rng.integers(17, vocab, (b, length // m, k, 2 * m)).astype(np.int32),
           "segments": np.zeros((b, length), np.int32),
           "loss_mask": np.ones((b, length), np.float32),
           "target_bytes": np.full((b, length), 4.6, np.float32)}
  cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
              if line.startswith("model name")), "?")
  jax_device = jax.devices()[0].device_kind
  torch_device = torch.cuda.get_device_name() if device == "cuda" else "the CPU"
  results = dict(decoder=source, random_weights=args.random_weights, dtype=args.dtype,
                 batch=b, length=length, repeats=args.repeats, cpu=cpu, cores=os.cpu_count(),
                 jax_device=jax_device, torch_device=torch_device, jax=jax.__version__,
                 torch=torch.__version__, transformers=transformers.__version__)

  def measure(name: str, fn):
    """Times `fn` into results[name] (and its first call, compilation included, into
    results[<name>_first_call_s]), prints it and writes --out again, so that a run stopped later
    keeps what it measured."""
    first = name.removesuffix("_s") + "_first_call_s"
    results[name], results[first] = _median_seconds(fn, args.repeats)
    print(f"{name}: {results[name]:.4f} s (first call {results[first]:.1f} s)", flush=True)
    write_json(args.out, results)

  # realm_jax: forward, full training step, RETROfit step.
  plain = RetroModel(RetroConfig(**settings, dtype=args.dtype))
  if args.random_weights:
    weights = jax.device_get(jax.jit(functools.partial(init_params, plain, length // m, False))(
        jax.random.key(1)))  # host arrays: the steps below donate the device copies
  else:
    weights = decoder.load_decoder(source, "--decoder")
  params = jax.device_put(weights)
  fwd = jax.jit(lambda p, t, s: plain.apply({"params": p}, t, segments=s))
  measure("jax_forward_s",
          lambda: jax.block_until_ready(fwd(params, batch["inputs"], batch["segments"])))

  def trainer(module, params, retrieval, freeze):
    """The trainer's own step (train/lm_step.train_step: loss, guarded AdamW update, grad norm),
    jitted with its state donated as the loop does; dropout as the config says (0: none)."""
    cfg = get_config("retrofit_smollm2")
    cfg.freeze_decoder, cfg.num_steps = freeze, 100
    cfg.model.dtype = args.dtype
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

  measure("jax_train_step_s", trainer(plain, params, False, False))
  # The RETROfit's model as the trainer builds it from the config (its database stands in: the
  # tokenizer and the chunking are all model_config reads of it).
  db = types.SimpleNamespace(tokenizer=decoder.load_tokenizer(source, "--decoder"),
                             chunk_length=m, seq_chunks=length // m)
  for memory in ("decoder", "encoder"):
    cfg = get_config("retrofit_smollm2")
    cfg.init, cfg.model.cca_memory, cfg.model.dtype = source, memory, args.dtype
    retro = RetroModel(model_config(cfg, db, True))
    init = jax.jit(functools.partial(init_params, retro, db.seq_chunks, True))(jax.random.key(0))
    rparams = decoder.retrofit(init, weights)
    measure(f"jax_retrofit_{memory}_step_s", trainer(retro, rparams, True, True))
    del rparams, init

  # Hugging Face PyTorch: the same GGUF or directory, or random weights of its config.
  if args.random_weights:
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(source))
  elif source == SMOLLM2:
    path = smollm2_path("--decoder")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path))
  else:
    hf = transformers.AutoModelForCausalLM.from_pretrained(source)
  hf = hf.to(device=device, dtype=torch.float32)
  tokens = torch.as_tensor(batch["inputs"], dtype=torch.long, device=device)
  targets = torch.as_tensor(batch["targets"], dtype=torch.long, device=device)
  autocast = functools.partial(torch.autocast, device_type=device, dtype=torch.bfloat16,
                               enabled=args.dtype == "bfloat16")
  sync = torch.cuda.synchronize if device == "cuda" else lambda: None
  hf.eval()

  def hf_forward():
    with torch.no_grad(), autocast():
      hf(tokens)
    sync()
  measure("torch_forward_s", hf_forward)
  hf.train()
  opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1)

  def hf_step():
    opt.zero_grad(set_to_none=True)
    with autocast():
      logits = hf(tokens).logits
      loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                               targets.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
    opt.step()
    sync()
  measure("torch_train_step_s", hf_step)

  tokens_per_call = b * length
  rows = [("forward", "jax_forward_s", "torch_forward_s"),
          ("training step (every weight)", "jax_train_step_s", "torch_train_step_s")]
  print(f"\n{source}{' (random weights)' if args.random_weights else ''}, B {b} x L {length} "
        f"tokens, {args.dtype}, {os.cpu_count()} cores ({cpu}); jax on {jax_device}, PyTorch on "
        f"{torch_device}\n")
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


def write_shapes(directory: str):
  """SmolLM2's config.json (from the GGUF's metadata) and tokenizer.json (its vocabulary and
  merges): a Hugging Face directory without weights, for --random_weights elsewhere."""
  from realm_jax.checkpoints import decoder
  from realm_jax.io_utils import write_json
  from realm_jax.text.lm_tokenizer import SMOLLM2

  s = decoder.decoder_settings(SMOLLM2)
  tokenizer = decoder.load_tokenizer(SMOLLM2)
  config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "vocab_size": s["vocab_size"], "num_hidden_layers": s["num_layers"],
            "hidden_size": s["hidden_size"], "num_attention_heads": s["num_heads"],
            "num_key_value_heads": s["num_kv_heads"], "head_dim": s["head_dim"],
            "intermediate_size": s["mlp_size"], "max_position_embeddings": s["max_length"],
            "rms_norm_eps": s["layer_norm_eps"], "rope_theta": s["rope_theta"],
            "tie_word_embeddings": s["tie_embeddings"], "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "bos_token_id": tokenizer.eos_id,
            "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
  if s["rope_scaling"] or s["sliding_window"] or s["attention_bias"]:
    raise SystemExit("error: SmolLM2's settings changed (rope scaling, window or biases): "
                     "extend write_shapes in benchmarks/smollm2.py.")
  # As benchmarks/llama3_8b_shapes.py: a shard index naming no shards, so the weights resolver
  # takes the directory; reading its weights fails on the first one missing.
  index = {"metadata": {"note": "shapes only, no weights: benchmarks/smollm2.py --write_shapes"},
           "weight_map": {}}
  write_json(os.path.join(directory, "config.json"), config)
  write_json(os.path.join(directory, "model.safetensors.index.json"), index)
  tokenizer.save_json(os.path.join(directory, "tokenizer.json"))
  print(f"wrote {directory}: config.json, tokenizer.json, model.safetensors.index.json")


if __name__ == "__main__":
  main()
