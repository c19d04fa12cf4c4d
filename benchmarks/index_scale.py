"""A paper-scale index on one host: REALM's 13.35M blocks x 128, built from embedding shards on
disk, saved, loaded and searched, with the memory each step takes.

  python benchmarks/index_scale.py                       # 13,353,718 x 128 (~20 GB of disk)
  python benchmarks/index_scale.py --rows=200000 --queries=200 --workdir=/tmp/scale   # minutes

The rows are clustered Gaussians (`--clusters` centres, as benchmarks/search.py), written as the
embedding shards `experiments/build_index.py` writes (`--shard_rows` rows each, float32
safetensors); the queries are `--queries` more rows of the same clusters, not in the index,
perturbed (0.1 of each dimension's spread), as a question lands near its evidence block. Each step
runs in its own process, so that its memory is its own; the peak resident memory (VmHWM, reset at
the start of the step) is reported with the index's bytes:

  build   `DocIndex(ConcatRows(shard files), ids, "exact", dtype=...)`: each device's rows filled
          from the files a slice at a time.
  save    `index.save(...)` (safetensors + manifest, written a slice at a time, CRC-32 on the way).
  load    `DocIndex.load(...)` (CRC-32 pass, then the device filled a slice at a time), then the
          exact search of every query (one warm-up call first), `--query_batch_size` at a time.
  numpy   the rows in memory as float32, `brute_force_top_k` of every query: the reference top
          `--k` that recall is measured against, and numpy's queries/s.
  scann   `DocIndex(rows, ids, "scann", ...)` with `--scann_leaves` leaves (default sqrt(N)) and
          `--scann_training` training points; then each query-time setting of `--scann_search`
          (LEAVES_SEARCHED:REORDERED pairs, `ScannSearcher.retune`: no rebuild): queries/s and
          recall@k.

Results: `<workdir>/results.json` (rewritten after every step; a finished step is not run again
unless `--again`), and a markdown table printed at the end. The shards and saved indexes stay in
`--workdir` (delete it when done).
"""

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from realm_jax import cli  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from search import recall_at_k  # noqa: E402  (benchmarks/search.py)

REALM_BLOCKS = 13_353_718
ID_MULTIPLIER = 0x9E3779B97F4A7C15  # odd: a bijection modulo 2**63, so ids stay unique


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    cli.fail(f"{message} (see --help)")


def parse_args(argv=None):
  p = _Parser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", default=os.path.join(ROOT, "work", "index_scale"))
  p.add_argument("--rows", type=int, default=REALM_BLOCKS)
  p.add_argument("--dim", type=int, default=128)
  p.add_argument("--clusters", type=int, default=1000)
  p.add_argument("--shard_rows", type=int, default=1 << 20)
  p.add_argument("--queries", type=int, default=1000)
  p.add_argument("--k", type=int, default=10)
  p.add_argument("--query_batch_size", type=int, default=256)
  p.add_argument("--dtypes", default="float32,bfloat16", help="storage dtypes to build and load")
  p.add_argument("--scann_leaves", type=int, default=0, help="0: sqrt(rows)")
  p.add_argument("--scann_training", type=int, default=250_000)
  p.add_argument("--scann_search", default="100:100,200:100,400:100,200:250",
                 help="LEAVES_SEARCHED:REORDERED pairs measured on one ScaNN build")
  p.add_argument("--skip", default="", help="steps to leave out: comma-separated of "
                 "build,save,load,numpy,scann")
  p.add_argument("--again", action="store_true", help="run the steps that have results again")
  p.add_argument("--step", default=None, help=argparse.SUPPRESS)  # a child process's one step
  p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  for name in ("rows", "dim", "clusters", "shard_rows", "queries", "k", "query_batch_size",
               "scann_training"):
    if getattr(args, name) < 1:
      p.error(f"--{name}={getattr(args, name)}: give a whole number >= 1")
  if args.k > args.rows:
    p.error(f"--k={args.k} is more than --rows={args.rows}")
  args.dtypes = [d for d in args.dtypes.split(",") if d]
  if not args.dtypes or set(args.dtypes) - {"float32", "bfloat16"}:
    p.error(f"--dtypes={','.join(args.dtypes)}: give float32 and/or bfloat16")
  try:
    args.scann_search = [tuple(int(x) for x in pair.split(":"))
                         for pair in args.scann_search.split(",") if pair]
    if not args.scann_search or any(len(t) != 2 or min(t) < 1 for t in args.scann_search):
      raise ValueError
  except ValueError:
    p.error(f"--scann_search={args.scann_search!r}: give LEAVES_SEARCHED:REORDERED pairs of "
            "positive numbers, e.g. 200:100,400:100")
  args.skip = set(filter(None, args.skip.split(",")))
  if args.skip - {"build", "save", "load", "numpy", "scann"}:
    p.error(f"--skip={','.join(sorted(args.skip))}: name steps of build,save,load,numpy,scann")
  return args


# ---------------------------------------------------------------------------------------------
# Memory of this process.


def reset_peak() -> int:
  """Resets this process's peak resident memory to its current one (Linux); returns it in
  bytes."""
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
  return memory()["rss"]


def memory() -> dict:
  """{"rss": bytes resident now, "peak": peak bytes since the last reset} (/proc/self/status)."""
  out = {}
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(("VmRSS:", "VmHWM:")):
        out["rss" if line.startswith("VmRSS") else "peak"] = int(line.split()[1]) * 1024
  return out


def measured(fn):
  """(fn(), seconds, {"before": rss, "peak": peak rss}) with the peak reset first."""
  gc.collect()
  before = reset_peak()
  start = time.perf_counter()
  out = fn()
  seconds = time.perf_counter() - start
  return out, seconds, {"before": before, "peak": memory()["peak"]}


# ---------------------------------------------------------------------------------------------
# The data: shard files and queries.


def block_ids(n: int) -> np.ndarray:
  """n unique non-negative int64 ids that look like hashes (not 0..n-1)."""
  ids = np.arange(n, dtype=np.uint64) * np.uint64(ID_MULTIPLIER)  # wraps modulo 2**64
  return (ids & np.uint64(2**63 - 1)).astype(np.int64)


def shard_paths(args) -> list[str]:
  count = -(-args.rows // args.shard_rows)
  return [os.path.join(args.workdir, "shards", f"shard-{s:05d}-of-{count:05d}.safetensors")
          for s in range(count)]


def write_data(args) -> None:
  """The shard files and queries.safetensors under --workdir (kept: written once)."""
  from realm_jax.io_utils import atomic_write
  from realm_jax.retrieval.rows import write_safetensors

  rng = np.random.default_rng(0)
  centers = rng.standard_normal((args.clusters, args.dim), dtype=np.float32)
  paths = shard_paths(args)
  os.makedirs(os.path.dirname(paths[0]), exist_ok=True)

  def draw(seed, n):
    r = np.random.default_rng(seed)
    out = centers[r.integers(0, args.clusters, n)]
    out += 0.5 * r.standard_normal(out.shape, dtype=np.float32)
    return out

  start = time.perf_counter()
  for s, path in enumerate(paths):
    if os.path.exists(path):
      continue
    n = min(args.shard_rows, args.rows - s * args.shard_rows)
    rows = draw(1 + s, n)
    atomic_write(path, lambda p, r=rows: write_safetensors(
        p, {"embeddings": (r.shape, r.dtype, lambda: [r])}))
    print(f"  data: shard {s + 1}/{len(paths)} ({n:,} rows)", flush=True)
  queries_path = os.path.join(args.workdir, "queries.safetensors")
  if not os.path.exists(queries_path):
    queries = draw(10**6, args.queries)
    spread = draw(10**6 + 1, 100_000).std(0)
    queries += 0.1 * spread * np.random.default_rng(7).standard_normal(
        queries.shape, dtype=np.float32)
    atomic_write(queries_path, lambda p: write_safetensors(
        p, {"queries": (queries.shape, queries.dtype, lambda: [queries])}))
  print(f"  data: {args.rows:,} x {args.dim} rows in {len(paths)} shards, {args.queries} "
        f"queries ({time.perf_counter() - start:.0f} s)", flush=True)


def shard_rows(args):
  from realm_jax.retrieval.rows import ConcatRows, safetensors_rows
  return ConcatRows([safetensors_rows(p, "embeddings") for p in shard_paths(args)])


def queries_of(args) -> np.ndarray:
  from realm_jax.retrieval.rows import read_all, safetensors_rows
  return read_all(safetensors_rows(os.path.join(args.workdir, "queries.safetensors"),
                                   "queries"))


def timed_search(search, queries, batch: int):
  """(seconds for all queries, found [Q, k]) after one untimed call on the first `batch`
  queries (compilation)."""
  search(queries[:batch])
  start = time.perf_counter()
  found = search(queries)
  return time.perf_counter() - start, found


# ---------------------------------------------------------------------------------------------
# The steps, each in its own process.


def step_build_save(args) -> dict:
  from realm_jax.retrieval.index import DocIndex

  rows, ids = shard_rows(args), block_ids(args.rows)
  index, build_s, build_mem = measured(lambda: DocIndex(rows, ids, "exact", dtype=args.dtype))
  out = {"build": dict(seconds=build_s, **build_mem)}
  if "save" not in args.skip:
    directory = os.path.join(args.workdir, f"index-{args.dtype}")
    _, save_s, save_mem = measured(lambda: index.save(directory, step=0, model_fingerprint="synthetic",
                                                      corpus_fingerprint=f"synthetic-{args.rows}"))
    out["save"] = dict(seconds=save_s, bytes=sum(os.path.getsize(os.path.join(directory, f))
                                                 for f in os.listdir(directory)), **save_mem)
  return out


def step_load_search(args) -> dict:
  from realm_jax.retrieval.index import DocIndex

  directory = os.path.join(args.workdir, f"index-{args.dtype}")
  index, load_s, load_mem = measured(lambda: DocIndex.load(
      directory, query_batch_size=args.query_batch_size))
  queries = queries_of(args)
  seconds, found = timed_search(lambda q: index.search(q, args.k)[1], queries,
                                args.query_batch_size)
  np.save(os.path.join(args.workdir, f"found-exact-{args.dtype}.npy"), found)
  return {"load": dict(seconds=load_s, **load_mem),
          "search": dict(seconds=seconds, queries_per_s=len(queries) / seconds,
                         block_rows=index.searcher.block_rows, peak=memory()["peak"])}


def step_numpy(args) -> dict:
  from realm_jax.retrieval.exact import brute_force_top_k
  from realm_jax.retrieval.rows import read_all

  emb = read_all(shard_rows(args))
  queries = queries_of(args)
  ids = block_ids(args.rows)
  seconds, rows = timed_search(lambda q: brute_force_top_k(q, emb, args.k)[1], queries, 16)
  np.save(os.path.join(args.workdir, "truth.npy"), ids[rows])
  return {"numpy": dict(seconds=seconds, queries_per_s=len(queries) / seconds,
                        peak=memory()["peak"])}


def step_scann(args) -> dict:
  from realm_jax.retrieval.index import DocIndex
  from realm_jax.retrieval.rows import read_all
  from realm_jax.retrieval.scann_searcher import scann_ops
  scann_ops()  # (imported before the build is timed)

  emb = read_all(shard_rows(args))
  leaves = args.scann_leaves or math.isqrt(args.rows)
  index, build_s, build_mem = measured(lambda: DocIndex(
      emb, block_ids(args.rows), "scann", num_leaves=leaves,
      num_leaves_to_search=min(leaves, args.scann_search[0][0]),
      training_sample_size=args.scann_training))
  queries = queries_of(args)
  truth = np.load(os.path.join(args.workdir, "truth.npy"))
  runs = []
  for searched, reordered in args.scann_search:
    index.searcher.retune(num_leaves_to_search=min(leaves, searched),
                          reorder_num_neighbors=reordered)
    seconds, found = timed_search(lambda q: index.search(q, args.k)[1], queries, len(queries))
    runs.append(dict(leaves_searched=min(leaves, searched), reordered=reordered,
                     seconds=seconds, queries_per_s=len(queries) / seconds,
                     recall=recall_at_k(found, truth)))
    print(f"  scann: {runs[-1]}", flush=True)
  return {"scann": dict(leaves=leaves, training_sample_size=args.scann_training,
                        build_seconds=build_s, build_before=build_mem["before"],
                        build_peak=build_mem["peak"], search_peak=memory()["peak"], runs=runs)}


STEPS = {"build": step_build_save, "load": step_load_search, "numpy": step_numpy,
         "scann": step_scann}


# ---------------------------------------------------------------------------------------------
# The parent: runs the steps, keeps the results, prints the table.


def run_child(args, argv, step: str, dtype: str) -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), *argv, f"--step={step}", f"--dtype={dtype}"]
  out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
  lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
  if out.returncode or not lines:
    cli.fail(f"step {step} ({dtype}) failed with exit status {out.returncode}; see its output "
             "above")
  return json.loads(lines[-1])


def table(results: dict, args) -> str:
  gib = lambda b: f"{b / 2**30:.2f}"
  lines = ["| storage | index GiB | step | seconds | peak RSS GiB | peak / index | "
           "queries/s | recall@k |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for dtype in args.dtypes:
    r = results.get(dtype, {})
    size = args.rows * args.dim * (4 if dtype == "float32" else 2)
    for step in ("build", "save", "load"):
      if step in r:
        m = r[step]
        lines.append(f"| {dtype} | {gib(size)} | {step} | {m['seconds']:.1f} | {gib(m['peak'])} | "
                     f"{m['peak'] / size:.2f} | | |")
    if "search" in r:
      recall = r["search"].get("recall")
      lines.append(f"| {dtype} | {gib(size)} | exact search (device, blocks of "
                   f"{r['search']['block_rows']:,} rows) | {r['search']['seconds']:.1f} | "
                   f"{gib(r['search']['peak'])} | | {r['search']['queries_per_s']:,.1f} | "
                   f"{'-' if recall is None else f'{recall:.4f}'} |")
  if "numpy" in results:
    m = results["numpy"]["numpy"]
    lines.append(f"| float32 | | numpy brute force (the reference) | {m['seconds']:.1f} | "
                 f"{gib(m['peak'])} | | {m['queries_per_s']:,.1f} | 1.0000 |")
  if "scann" in results:
    s = results["scann"]["scann"]
    lines.append(f"| float32 | | ScaNN build ({s['leaves']:,} leaves, {s['training_sample_size']:,} "
                 f"training points) | {s['build_seconds']:.1f} | {gib(s['build_peak'])} | | | |")
    for run in s["runs"]:
      lines.append(f"| float32 | | ScaNN, {run['leaves_searched']} leaves searched, "
                   f"{run['reordered']} re-ordered | {run['seconds']:.1f} | "
                   f"{gib(s['search_peak'])} | | {run['queries_per_s']:,.1f} | "
                   f"{run['recall']:.4f} |")
  return "\n".join(lines)


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  if args.step:  # a child: one step, one JSON line
    print(json.dumps(STEPS[args.step](args)), flush=True)
    return
  parent_argv = [a for a in argv if a != "--again"]
  from realm_jax.io_utils import write_json

  os.makedirs(args.workdir, exist_ok=True)
  path = os.path.join(args.workdir, "results.json")
  results = json.load(open(path)) if os.path.exists(path) and not args.again else {}
  import jax
  results["machine"] = dict(cpu=_cpu(), cores=len(os.sched_getaffinity(0)),
                            jax=jax.__version__, device=jax.devices()[0].device_kind)
  print(f"{args.rows:,} x {args.dim} index, {args.queries} queries, k={args.k}; "
        f"{results['machine']}", flush=True)
  write_data(args)
  for dtype in args.dtypes:
    r = results.setdefault(dtype, {})
    if "build" not in args.skip and "build" not in r:
      r.update(run_child(args, parent_argv, "build", dtype))
      write_json(path, results)
    if "load" not in args.skip and "load" not in r and os.path.isdir(
        os.path.join(args.workdir, f"index-{dtype}")):
      r.update(run_child(args, parent_argv, "load", dtype))
      write_json(path, results)
  if "numpy" not in args.skip and "numpy" not in results:
    results["numpy"] = run_child(args, parent_argv, "numpy", "float32")
    write_json(path, results)
  truth_path = os.path.join(args.workdir, "truth.npy")
  if os.path.exists(truth_path):
    truth = np.load(truth_path)
    for dtype in args.dtypes:
      found = os.path.join(args.workdir, f"found-exact-{dtype}.npy")
      if os.path.exists(found) and "search" in results.get(dtype, {}):
        results[dtype]["search"]["recall"] = recall_at_k(np.load(found), truth)
    if "scann" not in args.skip and "scann" not in results:
      results["scann"] = run_child(args, parent_argv, "scann", "float32")
    write_json(path, results)
  print("\n" + table(results, args))
  print(f"\nwrote {path}")


def _cpu() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.lower().startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return "unknown CPU"


if __name__ == "__main__":
  main()
