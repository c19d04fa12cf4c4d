"""Top-k search speed and recall: numpy brute force vs realm_jax's DocIndex searchers, in one run.

  python benchmarks/search.py                           # 1M x 128 clustered random vectors
  python benchmarks/search.py --n=100000 --queries=200  # quick
  python benchmarks/search.py --embeddings=work/wiki_vital_minilm/index/index-00000000 \
      --questions=../shared/data/nq_open/NQ-open.dev.jsonl   # the real corpus, real questions
  python benchmarks/search.py ... --scann_trees=100:10,100:30   # also ScaNN with these trees
  python benchmarks/search.py ... --scann_dims_per_block=2,4     # ScaNN rows for each code size
  python benchmarks/search.py ... --scann_reorder=100,250        # ... and each re-ordering depth

Each method indexes the same [N, D] float32 vectors and answers the same queries for the top
`--k`; recall@k is measured against numpy brute force (float32 matmul + argpartition). Every
method is warmed up on the full query set (compilation, ScaNN's first touch) before it is timed.
Index build time (host -> device copy, or ScaNN's training) is reported separately.

Without `--embeddings` the vectors are clustered Gaussians; with it, a safetensors file with key
"embeddings" ([N, D] float32): `--queries` random rows are held out of the index and perturbed
to serve as queries.
"""

import argparse
import os
import time

import numpy as np


def make_data(args, rng):
  """(index vectors [N, D], queries [Q, D]) float32."""
  if args.embeddings and os.path.isdir(args.embeddings):  # an index published by build_index.py
    from realm_jax.retrieval.index import DocIndex
    emb = DocIndex.load(args.embeddings).embeddings().astype(np.float32)
  elif args.embeddings:
    from safetensors.numpy import load_file
    emb = load_file(args.embeddings)["embeddings"].astype(np.float32)
  if args.embeddings and args.questions:  # real questions, embedded with MiniLM, as queries
    from realm_jax.data.qa import load_qa_jsonl
    from realm_jax.retrieval.recall import embed_questions
    from realm_jax.retrieval.towers import load_tower
    questions = [q["question"] for q in load_qa_jsonl(args.questions, limit=args.queries)]
    return np.ascontiguousarray(emb), embed_questions(load_tower("minilm"), questions)
  if args.embeddings:
    if len(emb) <= args.queries:
      raise ValueError(f"{args.embeddings} has {len(emb)} rows: too few to hold out "
                       f"--queries={args.queries} of them as queries.")
  else:
    centers = rng.standard_normal((args.clusters, args.dim), dtype=np.float32)
    emb = centers[rng.integers(0, args.clusters, args.n + args.queries)]
    emb += 0.5 * rng.standard_normal(emb.shape, dtype=np.float32)
  held_out = np.zeros(len(emb), bool)
  held_out[rng.choice(len(emb), args.queries, replace=False)] = True
  queries = emb[held_out]
  queries += 0.1 * emb.std(0) * rng.standard_normal(queries.shape, dtype=np.float32)
  return np.ascontiguousarray(emb[~held_out]), queries


def timed(search, queries, repeats):
  """Warms up once on all queries, then returns (best seconds of `repeats` runs, found rows)."""
  search(queries)
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    found = search(queries)
    best = min(best, time.perf_counter() - start)
  return best, found


def recall_at_k(found, truth) -> float:
  """Mean fraction of each query's true top k (rows of `truth`) among its found rows."""
  return float(np.mean([len(set(f) & set(t)) / len(t) for f, t in zip(found, truth)]))


def positive_ints(parser, flag: str, value: str, example: str) -> list[int]:
  """A comma-separated list of positive whole numbers, or a parser error naming --flag."""
  try:
    out = [int(x) for x in value.split(",")]
    if min(out) >= 1:
      return out
  except ValueError:
    pass
  parser.error(f"--{flag}={value!r}: give positive whole numbers, e.g. {example}.")


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--n", type=int, default=1_000_000, help="index rows (without --embeddings)")
  p.add_argument("--dim", type=int, default=128, help="dimension (without --embeddings)")
  p.add_argument("--clusters", type=int, default=1000,
                 help="Gaussian clusters (without --embeddings)")
  p.add_argument("--queries", type=int, default=1000)
  p.add_argument("--k", type=int, default=10)
  p.add_argument("--embeddings", default=None,
                 help="safetensors file with key 'embeddings', or an index directory")
  p.add_argument("--questions", default=None,
                 help="with --embeddings: NQ-Open style JSONL whose questions, embedded with "
                      "MiniLM, are the queries (instead of perturbed held-out rows)")
  p.add_argument("--repeats", type=int, default=3, help="timed runs per method (best is kept)")
  p.add_argument("--query_batch_size", type=int, default=256, help="queries per device call")
  p.add_argument("--skip", default="", help="comma-separated methods to leave out, e.g. scann")
  p.add_argument("--scann_trees", default="",
                 help="more ScaNN rows, comma-separated LEAVES:SEARCHED tree settings (e.g. "
                      "100:10,100:30); the library's default is always measured")
  p.add_argument("--scann_dims_per_block", default="2",
                 help="comma-separated dimensions per 4-bit ScaNN code; every ScaNN row (no "
                      "tree and each of --scann_trees) is measured with each")
  p.add_argument("--scann_reorder", default="100",
                 help="comma-separated numbers of hashed candidates that ScaNN re-scores exactly; "
                      "every ScaNN row is measured with each")
  p.add_argument("--scann_hash_only", action="store_true",
                 help="also measure ScaNN's hashing pass alone for each --scann_dims_per_block "
                      "(no tree, no re-ordering, approximate scores: not a DocIndex setting). "
                      "No ScaNN setting with a full scan can be faster, so this bounds them all")
  args = p.parse_args()
  try:
    trees = [tuple(int(x) for x in t.split(":")) for t in filter(None, args.scann_trees.split(","))]
    if any(len(t) != 2 or not 1 <= t[1] <= t[0] for t in trees):
      raise ValueError
  except ValueError:
    p.error(f"--scann_trees={args.scann_trees!r}: give LEAVES:SEARCHED pairs with "
            "1 <= SEARCHED <= LEAVES, e.g. 100:10,100:30.")
  code_sizes = positive_ints(p, "scann_dims_per_block", args.scann_dims_per_block, "2,4")
  depths = positive_ints(p, "scann_reorder", args.scann_reorder, "100,250")

  import jax

  from realm_jax.retrieval.exact import brute_force_top_k
  from realm_jax.retrieval.index import DocIndex
  from realm_jax.retrieval.scann_searcher import scann_ops

  rng = np.random.default_rng(0)
  emb, queries = make_data(args, rng)
  n, dim = emb.shape
  ids = np.arange(n, dtype=np.int64)  # so that results compare directly with row numbers
  print(f"{n} x {dim} index, {len(queries)} queries, k={args.k}; jax {jax.__version__} on "
        f"{jax.device_count()} x {jax.devices()[0].device_kind}, {os.cpu_count()} CPU cores")

  seconds, truth = timed(lambda q: brute_force_top_k(q, emb, args.k)[1], queries, args.repeats)
  rows = [("numpy brute force (float32)", 0.0, seconds, 1.0)]
  device = dict(query_batch_size=args.query_batch_size)  # ScaNN takes all queries in one call
  methods = {
      "exact float32": dict(device, searcher="exact"),
      "exact bfloat16": dict(device, searcher="exact", dtype="bfloat16"),
      "approx float32 (recall_target 0.95)": dict(device, searcher="approx"),
  }
  for dims in code_sizes:
    for depth in depths:
      base = dict(searcher="scann", dims_per_block=dims, reorder_num_neighbors=depth)
      methods[f"scann {dims}/{depth}"] = base  # (the printed name comes from its settings)
      for leaves, searched in trees:
        methods[f"scann {dims}/{depth}/{leaves}:{searched}"] = dict(
            base, num_leaves=leaves, num_leaves_to_search=searched)
  skip = set(filter(None, args.skip.split(",")))
  for name, options in methods.items():
    if options["searcher"] in skip:
      continue
    if options["searcher"] == "scann":
      scann_ops()  # (imported before the build is timed)
    start = time.perf_counter()
    index = DocIndex(emb, ids, **options)
    build = time.perf_counter() - start
    seconds, found = timed(lambda q: index.search(q, args.k)[1], queries, args.repeats)
    recall = recall_at_k(found, truth)
    if options["searcher"] == "scann":
      settings = index.searcher.settings
      tree = (f"{settings['num_leaves']} leaves, {settings['num_leaves_to_search']} searched"
              if settings["num_leaves"] > 1 else "no tree")
      name = "scann + exact re-scoring"
      name += (f" ({tree}, {settings['dims_per_block']} dims per code, "
               f"{settings['reorder_num_neighbors']} re-ordered)")
    rows.append((f"realm_jax {name}", build, seconds, recall))
    del index

  if args.scann_hash_only and "scann" not in skip:
    for dims in code_sizes:
      start = time.perf_counter()
      searcher = scann_ops().builder(emb, args.k, "dot_product").score_ah(
          dims, anisotropic_quantization_threshold=0.2).build()
      build = time.perf_counter() - start
      seconds, found = timed(lambda q: searcher.search_batched_parallel(
          q, batch_size=-(-len(q) // (os.cpu_count() or 1)))[0],  # as DocIndex does
                             queries, args.repeats)
      recall = recall_at_k(found, truth)
      rows.append((f"ScaNN hashing alone (no tree, {dims} dims per code, no re-ordering)", build,
                   seconds, recall))

  print(f"\n| method | build s | queries/s | recall@{args.k} |\n| --- | --- | --- | --- |")
  for name, build, seconds, recall in rows:
    print(f"| {name} | {build:.1f} | {len(queries) / seconds:,.0f} | {recall:.4f} |")


if __name__ == "__main__":
  main()
