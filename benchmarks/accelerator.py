"""What realm_jax achieves on the device jax finds: the REALM pre-training step's model FLOPs
utilisation, corpus embedding docs/s at 288 word pieces, and exact search's FLOP/s, each as a
fraction of the device's peak; one JSON and one markdown table row.

  python benchmarks/accelerator.py            # on a GPU / TPU: bert_base, bf16, 13.35M x 128 search
  python benchmarks/accelerator.py --quick    # tiny shapes, seconds on a CPU (the tests run this)

Everything runs on the first device (`jax.devices()[0]`): the figures are per device, and the JSON
records how many there are. Each measurement is compiled and run once untimed, then timed
`--repeats` times (each call waited for with `block_until_ready`, or returning host arrays); the
median is reported.

  step    one `realm_jax.train.realm_step.train_step` (retriever on the query and its K candidates,
          knowledge-augmented encoder on the K joint inputs, marginal MLM loss, backward, clip,
          AdamW; dropout on) with float32 parameters and `--dtype` compute, on a random batch from
          benchmarks/train_step.py's `make_batch`. Default shape: the project's pre-training
          config (realm_jax/configs/pretrain.py): Lq 96, Ld 288, Le 384, K 8, M 10; B 8 (REALM's
          per chip: 512 over 64 TPUs). Model FLOPs: benchmarks/train_step.py's `step_flops` (the
          formula in its docstring). On a CPU each BERT call runs in chunks of 2048 tokens, as
          there.
  embed   the document tower (`RealmEmbedder`, REALM's projected [CLS]) over full blocks of
          `--embed_length` (288) random word pieces through the library's `embed_in_buckets`,
          `--embed_batch_size` blocks per call. FLOPs per block: one tower pass of the same formula.
  search  `DocIndex(..., searcher="exact")` over N x D clustered random rows (default: REALM's
          13.35M x 128 Wikipedia blocks, fewer if the device's memory is short), `--queries`
          queries per call, top `--k`. FLOPs: the scores' matmul, 2 N D Q per call (the top-k is
          not counted). Stored as float32 and scored at "highest" precision (the library's
          defaults), so this is a fraction of a bf16 peak that float32 arithmetic cannot come near.
          A shard whose Q x N float32 scores pass `--search_max_score_mib` (default the library's
          MAX_SCORE_BYTES, 256 MiB) is scored in blocks of rows (the JSON's block_rows).

--quick: a 1-layer BERT of width 64 ("tiny"); the step at B 2, K 2, Lq 16, Ld 32, Le 48, M 4; 2
calls of 4 blocks of 288 word pieces; 20,000 x 128 rows, 64 queries; 3 repeats. ~35 s on 2 busy
cores, most of it compiling the step.

Writes `--out` (atomically, again after each measurement, so a later failure keeps what was
measured) and prints a markdown header and row for the table in benchmarks/README.md.

Peak FLOP/s: `PEAKS`, the vendors' dense bf16 figures (V100: fp16), or `--peak_tflops`. A CPU has no
table value: its peak is measured, as the faster of a float32 and a bfloat16 matmul of
`CPU_MATMUL` squares on all cores (best of the repeats), so a CPU's MFU says how close a step
comes to that machine's own matmul speed. Every figure printed on a CPU is labelled as a CPU
figure: such numbers say nothing about an accelerator.
"""

import argparse
import datetime
import functools
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_step as step_bench  # noqa: E402  (benchmarks/train_step.py: batch and FLOPs)

import numpy as np  # noqa: E402

from realm_jax import cli  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Peak dense bf16 FLOP/s by device kind (the first pattern that matches `device_kind`, lowercased).
PEAKS = (
    # NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 TFLOPS (SXM) / 1,513 (PCIe) with sparsity.
    # NVL: 1,671 with sparsity (the same datasheet; and the H200 datasheet for the H200 NVL).
    (r"h100.*pcie", 756e12),
    (r"h[12]00.*nvl", 835e12),
    (r"h100", 989e12),
    # NVIDIA H200 Tensor Core GPU datasheet: BF16 1,979 TFLOPS (SXM) with sparsity.
    (r"h200", 989e12),
    # NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS dense (SXM and PCIe).
    (r"a100", 312e12),
    # NVIDIA L4 Tensor Core GPU datasheet: BF16 242 TFLOPS with sparsity.
    (r"\bl4\b", 121e12),
    # NVIDIA V100 Tensor Core GPU datasheet: 125 TFLOPS fp16 tensor (SXM2); it has no bf16.
    (r"v100", 125e12),
    # Google Cloud TPU documentation, system architecture pages: bf16 peak per chip.
    (r"tpu v4", 275e12),
    (r"tpu v5 ?lite|tpu v5e", 197e12),
    (r"tpu v5", 459e12),       # v5p reports "TPU v5"
    (r"tpu v6 ?lite|tpu v6e", 918e12),
)
REALM_BLOCKS = 13_353_718     # REALM's Wikipedia index: blocks of 288 word pieces
CPU_SEARCH_ROWS = 1_000_000   # a CPU reports no memory limit: this many rows without --quick
CPU_MATMUL = 2048             # the side of the squares whose matmul measures a CPU's peak (half
                              # with --quick)
SEARCH_CLUSTERS = 1000

# Shapes without and with --quick; a flag given on the command line wins.
FULL = dict(preset="bert_base", batch_size=8, num_candidates=8, query_length=96, doc_length=288,
            joint_length=384, num_masked=10, embed_batch_size=256, embed_batches=4,
            search_rows=0, queries=256, repeats=10)
QUICK = dict(preset="tiny", batch_size=2, num_candidates=2, query_length=16, doc_length=32,
             joint_length=48, num_masked=4, embed_batch_size=4, embed_batches=2,
             search_rows=20_000, queries=64, repeats=3)
PRESETS = {**step_bench.PRESETS,
           "tiny": dict(hidden_size=64, num_layers=1, heads=2, intermediate=256)}


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    cli.fail(f"{message} (see --help)")


def parse_args(argv=None) -> argparse.Namespace:
  """The flags, the --quick or full defaults filled in and checked; a bad one exits with status 2
  and one `error:` line."""
  p = _Parser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true",
                 help="tiny shapes that run in seconds on a CPU (the tests)")
  p.add_argument("--out", default=None,
                 help="the JSON (default benchmarks/results/accelerator-<device>.json)")
  p.add_argument("--peak_tflops", type=float, default=None,
                 help="the device's peak TFLOP/s (default: PEAKS by device kind; a CPU's measured)")
  p.add_argument("--repeats", type=int, default=None, help="timed runs of each (median kept)")
  p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                 help="compute dtype of the step and the embedding (parameters stay float32)")
  p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                 help="BERT shape of the step and the embedding (default bert_base; --quick tiny)")
  p.add_argument("--vocab_size", type=int, default=30522)
  p.add_argument("--retriever_proj_size", type=int, default=128)
  for name, what in (("batch_size", "B: examples per step"),
                     ("num_candidates", "K: candidates per example"),
                     ("query_length", "Lq"), ("doc_length", "Ld"), ("joint_length", "Le"),
                     ("num_masked", "M: masked positions per example, at most"),
                     ("embed_batch_size", "blocks per embedding call"),
                     ("embed_batches", "embedding calls per timed run"),
                     ("search_rows", "N: index rows (0: REALM's 13.35M, fewer if the device's "
                                     f"memory is short; {CPU_SEARCH_ROWS:,} on a CPU)"),
                     ("queries", "Q: queries per search call")):
    p.add_argument(f"--{name}", type=int, default=None, help=f"{what} (default: see FULL, QUICK)")
  p.add_argument("--embed_length", type=int, default=288, help="word pieces per embedded block")
  p.add_argument("--search_dim", type=int, default=128, help="D: index dimension")
  p.add_argument("--search_dtype", choices=("float32", "bfloat16"), default="float32",
                 help="index storage dtype (scores are float32 either way)")
  p.add_argument("--search_max_score_mib", type=int, default=0,
                 help="float32 scores the search holds at once, MiB (0: the library's "
                      "MAX_SCORE_BYTES); above it a shard is scored in blocks of rows")
  p.add_argument("--k", type=int, default=10)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  for name, value in (QUICK if args.quick else FULL).items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  for name, value in PRESETS[args.preset].items():
    setattr(args, name, value)

  lowest = dict(search_rows=0, query_length=8, doc_length=16)  # make_batch's shortest
  for name in ("repeats", "vocab_size", "retriever_proj_size", *QUICK, "embed_length",
               "search_dim", "k"):
    if name != "preset" and getattr(args, name) < lowest.get(name, 1):
      p.error(f"--{name}={getattr(args, name)}: give a whole number >= {lowest.get(name, 1)}")
  for name in ("query_length", "doc_length", "joint_length", "embed_length"):
    if getattr(args, name) > 512:
      p.error(f"--{name}={getattr(args, name)}: lengths are limited to 512 "
              "(max_position_embeddings)")
  if args.num_masked > args.query_length - 2:
    p.error(f"--num_masked={args.num_masked}: at most --query_length - 2 = "
            f"{args.query_length - 2} (the query's word pieces)")
  if args.search_rows and args.k > args.search_rows:
    p.error(f"--k={args.k} is more than the --search_rows={args.search_rows} of the index")
  if args.peak_tflops is not None and not args.peak_tflops > 0:
    p.error(f"--peak_tflops={args.peak_tflops}: give the device's peak, a positive number")
  return args


# ---------------------------------------------------------------------------------------------
# The device and its peak.


def cpu_model() -> str:
  """The CPU's model name (`lscpu`, else /proc/cpuinfo), or "unknown CPU"."""
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
  except (OSError, subprocess.SubprocessError):
    out = ""
  if "Model name" not in out:
    try:
      with open("/proc/cpuinfo") as f:
        out = f.read()
    except OSError:
      out = ""
  found = re.search(r"^\s*model name\s*:\s*(.+)$", out, re.MULTILINE | re.IGNORECASE)
  return found.group(1).strip() if found else "unknown CPU"


def table_peak(device_kind: str) -> float | None:
  """Peak dense bf16 FLOP/s of a device kind from `PEAKS`, None for a kind not in it."""
  for pattern, peak in PEAKS:
    if re.search(pattern, device_kind.lower()):
      return peak
  return None


def timed(fn, repeats: int, pick=statistics.median) -> tuple[float, list[float]]:
  """(`pick` of the seconds per call, every call's seconds) of `fn`, which must wait for its
  result, after one untimed call (compilation, first touch)."""
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return pick(times), times


def cpu_peak(device, side: int, repeats: int) -> dict:
  """{"side": side, dtype: FLOP/s} of a [side, side] matmul on `device` for float32 and bfloat16,
  best of `repeats` each, and "peak", the faster of the two."""
  import jax
  import jax.numpy as jnp
  out = {"side": side}
  square = jax.jit(lambda a: a @ a)
  for dtype in ("float32", "bfloat16"):
    x = jax.device_put(jnp.ones((side, side), dtype), device)
    seconds, _ = timed(lambda x=x: square(x).block_until_ready(), repeats, min)
    out[dtype] = 2 * side**3 / seconds
  out["peak"] = max(out["float32"], out["bfloat16"])
  return out


# ---------------------------------------------------------------------------------------------
# The three measurements.


def model_shape(args) -> dict:
  """The BERT shape that the step and the embedding share (the JSON's "model")."""
  return dict(preset=args.preset, hidden_size=args.hidden_size, num_layers=args.num_layers,
              heads=args.heads, intermediate=args.intermediate, vocab_size=args.vocab_size,
              retriever_proj_size=args.retriever_proj_size)


def realm_config(args):
  """realm_jax's model config of the preset, with `--dtype` compute."""
  from realm_jax.models import RealmConfig
  return RealmConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                     num_hidden_layers=args.num_layers, num_attention_heads=args.heads,
                     intermediate_size=args.intermediate,
                     retriever_proj_size=args.retriever_proj_size, dtype=args.dtype)


def tower_flops(args, length: int) -> float:
  """Model FLOPs of one retriever tower pass over `length` word pieces: train_step.py's
  `step_flops` of a step with one query and no candidates is 3 such passes."""
  one = argparse.Namespace(**{**vars(args), "batch_size": 1, "num_candidates": 0,
                              "query_length": length})
  return step_bench.step_flops(one)[0] / 3


def measure_step(args, device) -> dict:
  """The REALM pre-training step at the args' shape: seconds per step, model FLOPs."""
  import jax
  import ml_collections

  from realm_jax.models import KnowledgeAugEncoder, RealmRetriever
  from realm_jax.train.init import init_params
  from realm_jax.train.optimizer import bert_adamw
  from realm_jax.train.realm_step import RealmModels, TrainState, train_step

  # As benchmarks/train_step.py: chunks of 2048 tokens help a CPU's caches, not an accelerator.
  cfg = realm_config(args).replace(chunk_tokens=2048 if device.platform == "cpu" else 0)
  models = RealmModels(RealmRetriever(cfg), KnowledgeAugEncoder(cfg))
  params = init_params(ml_collections.ConfigDict({"init": "random"}), models, cfg,
                       jax.random.key(args.seed))
  tx = bert_adamw(1e-5, total_steps=100_000, warmup_steps=0, weight_decay=0.01, eps=1e-6,
                  clip_norm=1.0)
  state = TrainState.create(apply_fn=None, params=jax.device_put(params, device), tx=tx)
  batch = jax.device_put(step_bench.make_batch(args), device)
  rng = jax.random.key(args.seed)
  step = jax.jit(functools.partial(train_step, models=models), donate_argnums=0)
  start = time.perf_counter()
  compiled = step.lower(state, batch, rng).compile()
  compile_s = time.perf_counter() - start

  def run():
    nonlocal state
    state, metrics = compiled(state, batch, rng)
    jax.block_until_ready((state, metrics))

  seconds, times = timed(run, args.repeats)
  flops = step_bench.step_flops(args)[0]
  return dict(shape=dict(batch_size=args.batch_size, num_candidates=args.num_candidates,
                         query_length=args.query_length, doc_length=args.doc_length,
                         joint_length=args.joint_length, num_masked=args.num_masked),
              dtype=args.dtype, chunk_tokens=cfg.chunk_tokens, compile_s=compile_s,
              seconds=seconds, times=times, flops=flops, flops_per_s=flops / seconds)


def measure_embedding(args, device) -> dict:
  """The document tower over full blocks of `embed_length` random word pieces: docs/s, FLOPs."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh
  from tqdm.auto import tqdm

  from realm_jax.models import RealmEmbedder
  from realm_jax.retrieval.embed import embed_in_buckets

  cfg = realm_config(args)
  tower = RealmEmbedder(cfg, pooling="projected_cls")
  ones = jnp.ones((1, args.embed_length), jnp.int32)
  params = jax.jit(tower.init)(jax.random.key(args.seed), ones, ones, ones)["params"]
  params = jax.device_put(params, device)
  apply = jax.jit(lambda p, b: tower.apply({"params": p}, b["input_ids"], b["attention_mask"],
                                           b["token_type_ids"]))
  n, length = args.embed_batch_size * args.embed_batches, args.embed_length
  rng = np.random.default_rng(args.seed)
  ids = rng.integers(1000, args.vocab_size, (n, length)).astype(np.int32)  # ordinary word pieces
  ids[:, 0], ids[:, -1] = step_bench.CLS, step_bench.SEP
  inputs = {"input_ids": ids, "attention_mask": np.ones_like(ids),
            "token_type_ids": np.zeros_like(ids)}
  mesh = Mesh(np.array([device]), ("data",))
  seconds, times = timed(
      lambda: embed_in_buckets(lambda b: apply(params, b), inputs, args.embed_batch_size,
                               buckets=[length], mesh=mesh, progress=tqdm(disable=True),
                               tokens_per_batch=None), args.repeats)
  per_doc = tower_flops(args, length)
  return dict(shape=dict(length=length, batch_size=args.embed_batch_size, docs=n),
              dtype=args.dtype, seconds=seconds, times=times, flops_per_doc=per_doc,
              docs_per_s=n / seconds, flops_per_s=n * per_doc / seconds)


def search_rows(args, device) -> int:
  """N when --search_rows is 0: REALM's block count, fewer if the stored rows and three [Q, N]
  float32 buffers (scores, their masked copy, top-k's work) would take more than 80% of the
  device's memory; `CPU_SEARCH_ROWS` on a device that reports no limit (a CPU)."""
  try:
    limit = (device.memory_stats() or {}).get("bytes_limit")
  except Exception:  # pylint: disable=broad-except  (a backend without memory statistics)
    limit = None
  if limit is None:
    return CPU_SEARCH_ROWS
  from realm_jax.retrieval.index_store import DTYPES
  row_bytes = args.search_dim * DTYPES[args.search_dtype].itemsize + 3 * 4 * args.queries
  return max(args.k, min(REALM_BLOCKS, int(0.8 * limit / row_bytes)))


def measure_search(args, device) -> dict:
  """Exact top-k over N x D clustered random rows, Q queries per call: seconds, FLOPs. With an
  automatic N, a device that runs out of memory is tried again with half as many rows."""
  import jax

  n = args.search_rows or search_rows(args, device)
  while True:
    try:
      return _measure_search(args, device, n)
    except jax.errors.JaxRuntimeError as e:
      if args.search_rows or "RESOURCE_EXHAUSTED" not in str(e) or n // 2 < args.k:
        raise
      print(f"{device.device_kind}: search over {n:,} rows ran out of memory; trying {n // 2:,}",
            flush=True)
      n //= 2


def _measure_search(args, device, n: int) -> dict:
  import jax
  from jax.sharding import Mesh

  from realm_jax.retrieval.exact import MAX_SCORE_BYTES
  from realm_jax.retrieval.index import DocIndex

  d, q = args.search_dim, args.queries

  @functools.partial(jax.jit, static_argnums=(1, 2))
  def clustered(key, rows, dim):  # made on the device: 13M rows in numpy take minutes
    k1, k2, k3 = jax.random.split(key, 3)
    centers = jax.random.normal(k1, (SEARCH_CLUSTERS, dim))
    which = jax.random.randint(k2, (rows,), 0, SEARCH_CLUSTERS)
    return centers[which] + 0.5 * jax.random.normal(k3, (rows, dim))

  rows = np.asarray(clustered(jax.device_put(jax.random.key(args.seed), device), n + q, d))
  max_score_bytes = (args.search_max_score_mib << 20) or MAX_SCORE_BYTES
  index = DocIndex(rows[:n], np.arange(n, dtype=np.int64), searcher="exact",
                   mesh=Mesh(np.array([device]), ("data",)), dtype=args.search_dtype,
                   query_batch_size=q, max_score_bytes=max_score_bytes)
  queries = rows[n:]  # from the same clusters as the index
  seconds, times = timed(lambda: index.search(queries, args.k), args.repeats)
  flops = 2.0 * n * d * q
  return dict(shape=dict(rows=n, dim=d, queries=q, k=args.k), dtype=args.search_dtype,
              max_score_bytes=max_score_bytes, block_rows=index.searcher.block_rows,
              precision="highest", seconds=seconds, times=times, flops=flops,
              queries_per_s=q / seconds, flops_per_s=flops / seconds)


# ---------------------------------------------------------------------------------------------
# The report.

HEADER = ("| device | shapes | peak TFLOP/s | step ms | step TFLOP/s | step MFU | embedding docs/s "
          "| embedding MFU | search queries/s | search TFLOP/s | search / peak | jax, date |")


def table_row(r: dict) -> str:
  """The markdown row of a result (`HEADER`'s columns)."""
  st, em, se = r["train_step"], r["embedding"], r["search"]
  model = r["model"]
  tf = lambda x: f"{x / 1e12:.3g}"
  frac = lambda x: "-" if x is None else f"{x:.1%}"
  shapes = (f"{model['preset']} B {st['shape']['batch_size']} K "
            f"{st['shape']['num_candidates']} {st['dtype']}; embed L {em['shape']['length']} x "
            f"{em['shape']['batch_size']}; search {se['shape']['rows']:,} x {se['shape']['dim']} "
            f"Q {se['shape']['queries']}")
  peak = "-" if r["peak_flops"] is None else tf(r["peak_flops"])
  return (f"| {r['label']} | {shapes} | {peak} | {st['seconds'] * 1e3:,.1f} | "
          f"{tf(st['flops_per_s'])} | {frac(st['mfu'])} | {em['docs_per_s']:,.1f} | "
          f"{frac(em['mfu'])} | {se['queries_per_s']:,.0f} | {tf(se['flops_per_s'])} | "
          f"{frac(se['fraction_of_peak'])} | {r['jax_version']}, {r['date']} |")


def git_commit() -> str | None:
  try:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip() or None


def main(argv=None):
  args = parse_args(argv)
  import jax

  from realm_jax.io_utils import write_json

  device = jax.devices()[0]
  on_cpu = device.platform == "cpu"
  kind = device.device_kind
  slug = "cpu" if on_cpu else re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")
  out = args.out or os.path.join(ROOT, "benchmarks", "results",
                                 f"accelerator-{slug}{'-quick' if args.quick else ''}.json")
  try:  # before minutes of measuring
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  except OSError as e:
    cli.fail(f"--out={out}: cannot make its folder ({e.strerror}); give a writable path.")

  result = dict(platform=device.platform, device_kind=kind, device_count=jax.device_count(),
                jax_version=jax.__version__, quick=args.quick,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                commit=git_commit(), cores=len(os.sched_getaffinity(0)),
                load_average=os.getloadavg()[0])
  if on_cpu:
    result["cpu_model"] = cpu_model()
    result["cpu_matmul"] = cpu_peak(device, CPU_MATMUL // 2 if args.quick else CPU_MATMUL,
                                    args.repeats)
    mode = "quick, not an accelerator figure" if args.quick else "not an accelerator figure"
    label = f"CPU ({mode}): {result['cpu_model']}, {result['cores']} cores"
  else:
    label = kind
  if args.peak_tflops is not None:
    peak, source = args.peak_tflops * 1e12, "--peak_tflops"
  elif on_cpu:
    peak = result["cpu_matmul"]["peak"]
    side = result["cpu_matmul"]["side"]
    source = (f"CPU, peak = measured matmul ({side} x {side}, the faster of float32 and "
              "bfloat16)")
  else:
    peak = table_peak(kind)
    source = "PEAKS (vendor spec sheet, dense bf16)" if peak else (
        f"none: {kind!r} is not in PEAKS; pass --peak_tflops for the fractions")
  result.update(label=label, peak_flops=peak, peak_source=source, model=model_shape(args))
  tag = "CPU" if on_cpu else kind  # every printed figure says where it was measured
  print(f"{label}; {result['device_count']} device(s), measuring on the first; jax "
        f"{jax.__version__}; peak {'-' if peak is None else f'{peak / 1e12:.3g} TFLOP/s'} "
        f"({source}); load average {result['load_average']:.2f}", flush=True)
  fraction = lambda flops_per_s: None if peak is None else flops_per_s / peak

  for name, measure in (("train_step", measure_step), ("embedding", measure_embedding),
                        ("search", measure_search)):
    r = measure(args, device)
    r["mfu" if name != "search" else "fraction_of_peak"] = fraction(r["flops_per_s"])
    result[name] = r
    write_json(out, result)  # what was measured survives a later failure
    shape = ", ".join(f"{k} {v:,}" for k, v in r["shape"].items())
    print(f"{tag}: {name} ({shape}): {r['seconds'] * 1e3:,.2f} ms per call (median of "
          f"{args.repeats}), {r['flops_per_s'] / 1e12:.3g} TFLOP/s", flush=True)

  print(f"\n{HEADER}\n" + "| --- " * (HEADER.count("|") - 1) + "|")
  print(table_row(result))
  print(f"\n{tag}: wrote {out}")


if __name__ == "__main__":
  main()
