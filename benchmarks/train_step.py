"""One REALM pre-training step: realm_jax vs the HF PyTorch port, same config, weights and batch,
side by side in one run.

  python benchmarks/train_step.py                   # MiniLM-shaped BERT, B=8, K=8 (~5 min, 2 cores)
  python benchmarks/train_step.py --no_dropout      # the two first-step losses must then agree
  python benchmarks/train_step.py --preset=bert_base --dtype=bfloat16   # on a GPU
  python benchmarks/train_step.py --profile_dir=/tmp/ts   # + the XLA ops that took longest

A step is the whole of REALM pre-training's update: the (shared) retriever embeds the B queries
and their B * K candidates, p(z|x) is the softmax of their inner products, the knowledge-augmented
encoder reads the B * K joint inputs `[CLS] x [SEP] body [SEP]`, the loss is the marginal MLM
log-likelihood of the (at most M) masked tokens; then the backward pass, the global-norm clip
(1.0) and AdamW (weight decay 0.01 except biases and LayerNorm, eps 1e-6).

  HF PyTorch  `RealmScorer` (shared embedder) -> `relevance_score` -> `RealmKnowledgeAugEncoder(
              ..., relevance_score, labels, mlm_mask).loss`, `.backward()`,
              `clip_grad_norm_`, `torch.optim.AdamW.step()`; train mode (dropout on) unless
              `--no_dropout`. Its MLM head projects every joint position onto the vocabulary.
  realm_jax   `jax.jit(partial(train_step, models=RealmModels(...)), donate_argnums=0)` on a
              `TrainState` with `bert_adamw`; the MLM head only sees the M masked positions;
              each BERT call runs in chunks of <= `--chunk_tokens` tokens (2048 on CPU).

The weights are the HF models' seeded random init, converted with `from_hf_state_dict`; the batch
is random word pieces with random lengths (padding), the query's masked tokens replaced by [MASK]
in both the query and the joint input. Compilation (realm_jax) and the first step (both) are
timed apart from the `--steps` timed steps. `--breakdown` also times the forward alone (the loss,
no gradient) and the forward + backward (gradients, no clip or update) of each, at the initial
weights. Timings on a shared machine move with its load: the load average is printed.

Model FLOPs of a step (matmuls only; embeddings, softmax, LayerNorm, the optimiser not counted):
  a sequence of padded length L through the BERT:  n_layers * (L * (8 H^2 + 4 H I) + 4 L^2 H)
    (Q, K, V, output projections: 4 * 2 H^2 per token; FFN: 2 * 2 H I per token;
     attention scores and context: 2 * 2 L H per token)
  retriever:  B queries of length Lq + B K candidates of length Ld, each + pooler 2 H^2
              + projection 2 H P;  relevance 2 B K P
  encoder:    B K joint inputs of length Le
  MLM head:   B K M (2 H^2 + 2 H V)   (transform + tied decoder, at the M masked positions)
  forward F = the sum;  backward = 2 F;  step = 3 F.
The HF port also projects the other B K (Le - M) positions onto the vocabulary: it executes
3 B K (Le - M) (2 H^2 + 2 H V) more FLOPs per step, which are not counted as model FLOPs (they
are reported on their own). XLA's own count (`cost_analysis`) of the realm_jax forward and
gradient is within 1% of this. Achieved FLOP/s = step FLOPs / time per step; on a GPU
MFU = achieved / `--peak_tflops`, and the HF step runs only with `--torch_device cuda` and a
CUDA build of torch (otherwise its loss is checked with a forward on the CPU).
"""

import argparse
import functools
import os
import time

os.environ.setdefault("USE_TF", "0")
os.environ.setdefault("TRANSFORMERS_NO_TF", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

PRESETS = {
    "minilm": dict(hidden_size=384, num_layers=6, heads=12, intermediate=1536),
    "bert_base": dict(hidden_size=768, num_layers=12, heads=12, intermediate=3072),
}
PAD, CLS, SEP, MASK = 0, 101, 102, 103
NAMES = ("input_ids", "attention_mask", "token_type_ids")


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", choices=sorted(PRESETS), default="minilm")
  p.add_argument("--hidden_size", type=int, default=None, help="default: the preset's")
  p.add_argument("--num_layers", type=int, default=None, help="default: the preset's")
  p.add_argument("--heads", type=int, default=None, help="default: the preset's")
  p.add_argument("--intermediate", type=int, default=None, help="default: the preset's")
  p.add_argument("--vocab_size", type=int, default=30522)
  p.add_argument("--retriever_proj_size", type=int, default=128)
  p.add_argument("--batch_size", type=int, default=8)
  p.add_argument("--num_candidates", type=int, default=8)
  p.add_argument("--query_length", type=int, default=32)
  p.add_argument("--doc_length", type=int, default=128)
  p.add_argument("--joint_length", type=int, default=160)
  p.add_argument("--num_masked", type=int, default=10,
                 help="M: masked positions per query, at most")
  p.add_argument("--steps", type=int, default=5, help="timed steps per implementation")
  p.add_argument("--lr", type=float, default=1e-5)
  p.add_argument("--no_dropout", action="store_true", help="dropout off on both sides")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                 help="realm_jax compute dtype (the PyTorch side is always float32)")
  p.add_argument("--chunk_tokens", type=int, default=None,
                 help="realm_jax: run each BERT call over at most this many tokens at a time "
                      "(RealmConfig.chunk_tokens); default 2048 on CPU, 0 (off) on accelerators")
  p.add_argument("--microbatch", type=int, default=0,
                 help="realm_jax: examples at a time through the step, gradients added up "
                      "(config.microbatch; 0 = the whole batch); needs --chunk_tokens=0")
  p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                 help="torch.set_num_threads (default: the cores this process may use)")
  p.add_argument("--torch_device", default="cpu", help="cpu or cuda")
  p.add_argument("--peak_tflops", type=float, default=989.0,
                 help="peak FLOP/s of the accelerator for MFU (989: H100 SXM bf16 dense)")
  p.add_argument("--breakdown", action="store_true",
                 help="also time the forward (loss only) and forward + backward (no update)")
  p.add_argument("--profile_dir", default="",
                 help="also trace 2 more realm_jax steps into this directory (jax.profiler; "
                      "TensorBoard's Profile tab or ui.perfetto.dev) and print the XLA ops that "
                      "took longest (realm_jax/train/profile.py)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--keep_freed_memory", action="store_true",
                 help="glibc keeps freed blocks for reuse (no mmap, no trim) for both "
                      "implementations: realm_jax/host_memory.py")
  args = p.parse_args()
  for name, value in PRESETS[args.preset].items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  if args.joint_length > 512 or args.doc_length > 512:
    p.error("lengths are limited to 512 (max_position_embeddings)")
  return args


# ---------------------------------------------------------------------------------------------
# The batch.


def make_batch(args) -> dict:
  """A REALM pre-training batch in realm_jax's layout (numpy), with realistic padding.

  query [CLS] x [SEP] (x with [MASK]s); candidates [CLS] title [SEP] body [SEP]; joint
  [CLS] x [SEP] body [SEP] truncated to the joint length; 1..M masked tokens per query.
  """
  rng = np.random.default_rng(args.seed)
  b, k, lq, ld, le, m = (args.batch_size, args.num_candidates, args.query_length,
                         args.doc_length, args.joint_length, args.num_masked)
  lo = 1000 if args.vocab_size > 2000 else 1  # ordinary word pieces, past the special tokens
  words = lambda n: list(rng.integers(lo, args.vocab_size, n))
  q_ids, q_types = np.zeros((b, lq), np.int32), np.zeros((b, lq), np.int32)
  c_ids, c_types = np.zeros((b, k, ld), np.int32), np.zeros((b, k, ld), np.int32)
  j_ids, j_types = np.zeros((b, k, le), np.int32), np.zeros((b, k, le), np.int32)
  positions, targets = np.zeros((b, m), np.int32), np.zeros((b, m), np.int32)
  weights = np.zeros((b, m), np.float32)

  def put(ids, types, i, segments):
    row = [t for seg in segments for t in seg][:ids.shape[-1]]
    seg_types = [s for s, seg in enumerate(segments) for _ in seg][:ids.shape[-1]]
    ids[i][:len(row)], types[i][:len(row)] = row, [min(s, 1) for s in seg_types]

  for i in range(b):
    x = words(int(rng.integers(min(8, lq - 2), lq - 1)))            # query word pieces
    n = int(rng.integers(1, min(m, len(x)) + 1))
    masked = np.sort(rng.choice(len(x), n, replace=False))
    positions[i, :n], targets[i, :n], weights[i, :n] = masked + 1, [x[p] for p in masked], 1
    for p in masked:
      x[p] = MASK
    put(q_ids, q_types, i, [[CLS] + x + [SEP]])
    for c in range(k):
      title = words(int(rng.integers(1, 9)))
      body = words(int(rng.integers(max(1, ld // 4), ld - len(title) - 2)))
      put(c_ids, c_types, (i, c), [[CLS] + title + [SEP], body + [SEP]])
      put(j_ids, j_types, (i, c), [[CLS] + x + [SEP], body + [SEP]])
  group = lambda ids, types: {"input_ids": ids, "attention_mask": (ids != PAD).astype(np.int32),
                              "token_type_ids": types}
  return {"query": group(q_ids, q_types), "candidates": group(c_ids, c_types),
          "joint": group(j_ids, j_types), "candidate_mask": np.ones((b, k), np.float32),
          "mlm_positions": positions, "mlm_targets": targets, "mlm_weights": weights}


def hf_labels(batch) -> np.ndarray:
  """[B, Le] MLM labels for the HF encoder: the target at masked positions, -100 elsewhere."""
  b, _, le = batch["joint"]["input_ids"].shape
  labels = np.full((b, le), -100, np.int64)
  for i in range(b):
    for p, y, w in zip(batch["mlm_positions"][i], batch["mlm_targets"][i], batch["mlm_weights"][i]):
      if w:
        labels[i, p] = y
  return labels


# ---------------------------------------------------------------------------------------------
# FLOPs.


def step_flops(args) -> tuple[float, float]:
  """(model FLOPs of one step, the extra FLOPs of HF's all-positions MLM head); module docstring."""
  h, i, n, v, p = (args.hidden_size, args.intermediate, args.num_layers, args.vocab_size,
                   args.retriever_proj_size)
  b, k, m = args.batch_size, args.num_candidates, args.num_masked
  bert = lambda length: n * (length * (8 * h * h + 4 * h * i) + 4 * length * length * h)
  tower = lambda length: bert(length) + 2 * h * h + 2 * h * p
  head = 2 * h * h + 2 * h * v
  forward = (b * tower(args.query_length) + b * k * tower(args.doc_length) + 2 * b * k * p
             + b * k * bert(args.joint_length) + b * k * m * head)
  return 3.0 * forward, 3.0 * b * k * (args.joint_length - m) * head


# ---------------------------------------------------------------------------------------------
# The two implementations.


def timed(fn, steps: int) -> float:
  """Seconds per call of `fn` (which must wait for its result), after one untimed call."""
  fn()
  start = time.perf_counter()
  for _ in range(steps):
    fn()
  return (time.perf_counter() - start) / steps


def build_hf(args):
  """Seeded random HF RealmScorer (shared embedder) and RealmKnowledgeAugEncoder."""
  import torch
  from transformers.models.deprecated.realm import modeling_realm as realm_hf
  from transformers.models.deprecated.realm.configuration_realm import RealmConfig as HFConfig
  cfg = HFConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                 num_hidden_layers=args.num_layers, num_attention_heads=args.heads,
                 intermediate_size=args.intermediate, hidden_act="gelu_new",
                 retriever_proj_size=args.retriever_proj_size, num_candidates=args.num_candidates,
                 max_position_embeddings=512, pad_token_id=PAD)
  torch.manual_seed(args.seed)
  scorer = realm_hf.RealmScorer(cfg)
  encoder = realm_hf.RealmKnowledgeAugEncoder(cfg)
  return cfg, scorer, encoder


def _torch_inputs(batch, device):
  import torch
  t = lambda x: torch.as_tensor(np.asarray(x, np.int64), device=device)
  q, c, j = (tuple(t(batch[g][n]) for n in NAMES) for g in ("query", "candidates", "joint"))
  b, k, le = batch["joint"]["input_ids"].shape
  labels = t(hf_labels(batch))
  return q, c, tuple(x.view(b * k, le) for x in j), labels


def _hf_loss(scorer, encoder, inputs):
  q, c, j, labels = inputs
  rel = scorer(q[0], attention_mask=q[1], token_type_ids=q[2], candidate_input_ids=c[0],
               candidate_attention_mask=c[1], candidate_token_type_ids=c[2]).relevance_score
  return encoder(j[0], attention_mask=j[1], token_type_ids=j[2], relevance_score=rel,
                 labels=labels, mlm_mask=labels != -100).loss


def run_torch(args, scorer, encoder, batch, device) -> dict:
  """first_loss, first_s, step_s (seconds per timed step); forward_s, grad_s with --breakdown."""
  import torch
  torch.set_num_threads(args.threads)
  scorer.to(device).train(not args.no_dropout)
  encoder.to(device).train(not args.no_dropout)
  named = {}
  for model in (scorer, encoder):
    for name, param in model.named_parameters():  # the tied MLM decoder comes once
      named.setdefault(id(param), (name, param))
  params = [param for _, param in named.values()]
  no_decay = lambda name: name.endswith("bias") or "LayerNorm" in name
  groups = [{"params": [p for n, p in named.values() if not no_decay(n)], "weight_decay": 0.01},
            {"params": [p for n, p in named.values() if no_decay(n)], "weight_decay": 0.0}]
  opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.999), eps=1e-6)
  inputs = _torch_inputs(batch, device)
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

  def step():
    opt.zero_grad(set_to_none=True)
    loss = _hf_loss(scorer, encoder, inputs)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return loss.item()  # also waits for the step (eager on CPU; a sync on CUDA)

  out = {}
  if args.breakdown:  # before any update: the same (initial) weights as realm_jax's breakdown
    def forward():
      with torch.no_grad():
        _hf_loss(scorer, encoder, inputs).item()

    def grad():
      opt.zero_grad(set_to_none=True)
      _hf_loss(scorer, encoder, inputs).backward()
      sync()
    out.update(forward_s=timed(forward, args.steps), grad_s=timed(grad, args.steps))
  start = time.perf_counter()
  out["first_loss"] = step()
  sync()
  out["first_s"] = time.perf_counter() - start
  start = time.perf_counter()
  for _ in range(args.steps):
    step()
  sync()
  out["step_s"] = (time.perf_counter() - start) / args.steps
  return out


def hf_reference_loss(scorer, encoder, batch) -> float:
  """The HF loss at the initial weights, forward only in eval mode (when no HF step runs)."""
  import torch
  with torch.no_grad():
    return _hf_loss(scorer.eval(), encoder.eval(), _torch_inputs(batch, "cpu")).item()


def run_jax(args, params, hf_cfg, batch) -> dict:
  """compile_s, first_loss, first_s, step_s; forward_s, grad_s with --breakdown."""
  import jax
  from realm_jax.models import KnowledgeAugEncoder, RealmConfig, RealmRetriever
  from realm_jax.train.optimizer import bert_adamw
  from realm_jax.train.realm_step import RealmModels, TrainState, realm_loss, train_step
  cfg = RealmConfig.from_dict(hf_cfg.to_dict()).replace(dtype=args.dtype,
                                                         chunk_tokens=args.chunk_tokens)
  models = RealmModels(RealmRetriever(cfg), KnowledgeAugEncoder(cfg))
  # warmup 0 and a long decay: the learning rate stays ~lr, as the constant one of the HF side.
  tx = bert_adamw(args.lr, total_steps=100_000, warmup_steps=0, weight_decay=0.01, eps=1e-6,
                  clip_norm=1.0)
  batch = jax.device_put(batch)
  rng = jax.random.key(args.seed)
  out = {}
  if args.breakdown:
    initial = jax.device_put(params)
    dropout_rng = None if args.no_dropout else rng
    loss = lambda p, b, r: realm_loss(p, b, models, r)[0]
    forward, grad = jax.jit(loss), jax.jit(jax.grad(loss))
    out["forward_s"] = timed(lambda: forward(initial, batch, dropout_rng).block_until_ready(),
                             args.steps)
    out["grad_s"] = timed(lambda: jax.block_until_ready(grad(initial, batch, dropout_rng)),
                          args.steps)
    del initial
  state = TrainState.create(apply_fn=None, params=jax.device_put(params), tx=tx)
  pieces = args.batch_size // args.microbatch if args.microbatch else 1
  fn = jax.jit(functools.partial(train_step, models=models, dropout=not args.no_dropout,
                                 pieces=pieces), donate_argnums=0)
  start = time.perf_counter()
  step = fn.lower(state, batch, rng).compile()
  out["compile_s"] = time.perf_counter() - start
  start = time.perf_counter()
  state, metrics = step(state, batch, rng)
  metrics = jax.block_until_ready(metrics)
  out["first_s"] = time.perf_counter() - start
  out["first_loss"] = float(metrics["loss_sum"]) / float(metrics["tokens"])
  start = time.perf_counter()
  for _ in range(args.steps):
    state, metrics = step(state, batch, rng)
  jax.block_until_ready((state, metrics))
  out["step_s"] = (time.perf_counter() - start) / args.steps
  if args.profile_dir:
    from realm_jax.train.profile import op_table
    jax.profiler.start_trace(args.profile_dir, create_perfetto_trace=True)
    for _ in range(2):
      state, metrics = step(state, batch, rng)
    jax.block_until_ready((state, metrics))
    jax.profiler.stop_trace()
    out["profile"] = op_table(args.profile_dir, steps=2, top=15) or []
  return out


# ---------------------------------------------------------------------------------------------


def main():
  args = parse_args()
  if args.keep_freed_memory:
    from realm_jax.host_memory import keep_freed_memory
    keep_freed_memory()
  import jax
  import torch
  from realm_jax.checkpoints import from_hf_state_dict
  from realm_jax.models import RealmConfig

  backend = jax.default_backend()
  on_gpu = backend == "gpu"
  if args.chunk_tokens is None:
    args.chunk_tokens = 2048 if backend == "cpu" and not args.microbatch else 0
  if args.microbatch and (args.chunk_tokens or args.batch_size % args.microbatch):
    raise SystemExit("error: --microbatch must divide --batch_size, with --chunk_tokens=0")
  torch_device = args.torch_device
  run_hf = not on_gpu or (torch_device == "cuda" and torch.cuda.is_available())
  if torch_device == "cuda" and not torch.cuda.is_available():
    print("--torch_device cuda: torch has no CUDA here", "(HF step skipped)" if on_gpu else "(CPU)")
    torch_device = "cpu"

  hf_cfg, scorer, encoder = build_hf(args)
  cfg = RealmConfig.from_dict(hf_cfg.to_dict())
  copy = lambda tree: jax.tree.map(np.array, tree)  # HF tensors move in place when torch steps
  params = {"retriever": copy(from_hf_state_dict(scorer.state_dict(), "retriever", cfg)[0]),
            "encoder": copy(from_hf_state_dict(encoder.state_dict(), "encoder", cfg)[0])}
  n_params = sum(x.size for x in jax.tree.leaves(params))
  batch = make_batch(args)
  b, k = args.batch_size, args.num_candidates
  padded = b * (args.query_length + k * args.doc_length + k * args.joint_length)
  real = sum(int(batch[g]["attention_mask"].sum()) for g in ("query", "candidates", "joint"))
  flops, hf_extra = step_flops(args)

  print(f"BERT H={args.hidden_size} layers={args.num_layers} heads={args.heads} "
        f"I={args.intermediate} V={args.vocab_size} gelu_new, retriever proj "
        f"{args.retriever_proj_size}, shared embedder; {n_params / 1e6:.1f}M parameters "
        f"(retriever + encoder)")
  print(f"B={b} K={k} Lq={args.query_length} Ld={args.doc_length} Le={args.joint_length} "
        f"M<={args.num_masked} ({int(batch['mlm_weights'].sum())} masked tokens); "
        f"{padded:,} token positions per step ({real:,} not padding)")
  print("host allocator: " + ("glibc keeps freed blocks (--keep_freed_memory)"
                              if args.keep_freed_memory else "glibc defaults (mmap + trim)"))
  print(f"dropout {'off' if args.no_dropout else 'on'}; AdamW lr {args.lr:g} wd 0.01 eps 1e-6, "
        f"clip 1.0; realm_jax dtype {args.dtype}, chunk_tokens {args.chunk_tokens}, "
        f"microbatch {args.microbatch or args.batch_size}; "
        f"{args.steps} timed steps each")
  print(f"model FLOPs per step {flops / 1e12:.3f} TFLOP (3 x forward); the HF all-positions MLM "
        f"head adds {hf_extra / 1e12:.3f} TFLOP ({hf_extra / flops:.0%})")
  print(f"jax {jax.__version__} on {backend} ({jax.devices()[0].device_kind}), torch "
        f"{torch.__version__} ({torch_device}, {args.threads} threads), "
        f"{len(os.sched_getaffinity(0))} of {os.cpu_count()} CPU cores, load average "
        f"{os.getloadavg()[0]:.2f}", flush=True)

  jx = run_jax(args, params, hf_cfg, batch)
  print(f"realm_jax done: compile {jx['compile_s']:.1f} s, {jx['step_s'] * 1e3:,.0f} ms/step "
        f"(load average {os.getloadavg()[0]:.2f})", flush=True)
  if run_hf:
    hf = run_torch(args, scorer, encoder, batch, torch_device)
    print(f"HF done: {hf['step_s'] * 1e3:,.0f} ms/step (load average {os.getloadavg()[0]:.2f})",
          flush=True)
  else:
    hf = {"first_loss": hf_reference_loss(scorer, encoder, batch)}
    print("HF step skipped (jax on GPU, torch without CUDA); its loss is a CPU forward in eval "
          "mode")

  mfu = lambda s: f" | {flops / s / (args.peak_tflops * 1e12) * 100:.1f}%" if on_gpu else ""
  print(f"\n| implementation | compile s | first step s | ms/step | examples/s | tokens/s "
        f"| model TFLOP/s | first-step loss{' | MFU' if on_gpu else ''} |")
  print("| --- " * (8 + on_gpu) + "|")
  row = lambda name, comp, r: print(
      f"| {name} | {comp} | {r['first_s']:.2f} | {r['step_s'] * 1e3:,.0f} | {b / r['step_s']:.2f} "
      f"| {padded / r['step_s']:,.0f} | {flops / r['step_s'] / 1e12:.3f} "
      f"| {r['first_loss']:.6f}{mfu(r['step_s'])} |")
  hf_name = (f"HF PyTorch RealmScorer + RealmKnowledgeAugEncoder (torch {torch.__version__}, "
             f"{torch_device})")
  jax_name = f"realm_jax train_step (jax {jax.__version__}, {args.dtype})"
  if run_hf:
    row(hf_name, "-", hf)
  row(jax_name, f"{jx['compile_s']:.1f}", jx)
  if run_hf:
    print(f"\nspeed-up {hf['step_s'] / jx['step_s']:.2f}x (HF executes "
          f"{(flops + hf_extra) / hf['step_s'] / 1e12:.3f} TFLOP/s counting its extra MLM head); ",
          end="")
  else:
    print("\nHF reference (forward only): ", end="")
  print(f"first-step loss HF {hf['first_loss']:.6f} vs realm_jax {jx['first_loss']:.6f}, "
        f"difference {abs(hf['first_loss'] - jx['first_loss']):.1e}"
        + ("" if args.no_dropout else " (dropout on: other dropout masks, so not equal)"))
  if on_gpu:
    print(f"MFU against a peak of {args.peak_tflops:g} TFLOP/s (--peak_tflops)")
  if args.breakdown:
    print("\n| implementation | forward ms | forward + backward ms | full step ms "
          "| backward / forward |\n| --- | --- | --- | --- | --- |")
    for name, r in ((hf_name, hf), (jax_name, jx)):
      if "forward_s" in r:
        print(f"| {name} | {r['forward_s'] * 1e3:,.0f} | {r['grad_s'] * 1e3:,.0f} "
              f"| {r['step_s'] * 1e3:,.0f} "
              f"| {(r['grad_s'] - r['forward_s']) / r['forward_s']:.2f} |")
    if "forward_s" in hf:
      print(f"speed-up: forward {hf['forward_s'] / jx['forward_s']:.2f}x, forward + backward "
            f"{hf['grad_s'] / jx['grad_s']:.2f}x")
  if "profile" in jx:
    print(f"\nrealm_jax's step, the XLA ops that took longest (time inside each op on the thread "
          f"that ran it; trace in {args.profile_dir}):")
    print("\n".join(jx["profile"]))


if __name__ == "__main__":
  main()
