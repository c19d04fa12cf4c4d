"""kNN-LM's neighbour search over a built datastore (experiments/knnlm_eval.py builds it): the
queries/s of realm_jax's exact search and of ScaNN at k neighbours, ScaNN's recall@k against the
exact neighbours, and what the difference does to log p_kNN of the target.

  python benchmarks/knnlm_search.py --workdir=work/retro_demo --model=baseline
  python benchmarks/knnlm_search.py --db=work/retrofit_smollm2/db \
      --export=work/retrofit_smollm2/seed0/retro/export --decoder_memory \
      --datastore_dir=work/retrofit_smollm2/datastore-smollm2 --bfloat16

The queries are the decoder's hidden states at the first --queries scored tokens of the held-out
split (as the evaluation asks them; --decoder_memory: a RETRO decoder's states without its
neighbours, as `knnlm_eval.py --decoder_memory`); each searcher is timed after a warm-up call, over
the same Datastore.search the evaluation times (search + exact distances of the k found).
--bfloat16 adds the exact search over the same keys stored in bfloat16 (as `--key_dtype=bfloat16`
stores them): its recall@k against float32 storage.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", default="work/retro_demo")
  parser.add_argument("--model", default="baseline", help="retro or baseline")
  parser.add_argument("--datastore_dir", default="", help="default <workdir>/datastore-<model>")
  parser.add_argument("--db", default="", help="default <workdir>/db")
  parser.add_argument("--export", default="", help="default <workdir>/<model>/export")
  parser.add_argument("--decoder_memory", action="store_true",
                      help="queries without the RETRO decoder's neighbours (CCA skipped)")
  parser.add_argument("--bfloat16", action="store_true",
                      help="also exact search over the keys stored in bfloat16")
  parser.add_argument("--temperature", type=float, default=1.0, help="of log p_kNN")
  parser.add_argument("--queries", type=int, default=1024)
  parser.add_argument("--k", type=int, default=1024)
  parser.add_argument("--scann", default="{}", help='ScaNN settings as JSON, e.g. '
                      '\'{"num_leaves_to_search": 300}\' (retrieval/scann_searcher.py)')
  parser.add_argument("--skip_exact", action="store_true", help="ScaNN only (no recall)")
  args = parser.parse_args()
  scann_options = json.loads(args.scann)

  import jax
  from realm_jax.checkpoints import retro_export
  from realm_jax.data.retro_batches import retro_batches
  from realm_jax.models.knnlm import knn_log_prob
  from realm_jax.models.retro import RetroModel
  from realm_jax.retrieval.chunk_db import RetroDb
  from realm_jax.retrieval.datastore import Datastore, augment_queries
  from realm_jax.retrieval.index import DocIndex

  db = RetroDb.open(args.db or os.path.join(args.workdir, "db"), verify=False)
  config, params, _ = retro_export.load(args.export or os.path.join(args.workdir, args.model,
                                                                     "export"))
  module = RetroModel(config)
  hidden_fn = jax.jit(lambda p, t, n, g: module.apply({"params": p}, t, n, return_hidden=True,
                                                      segments=g)[1])
  with_neighbours = config.retrieval and not args.decoder_memory
  queries, targets = [], []
  for batch in retro_batches(db, "heldout", batch_size=8, seed=0, shuffle=False, num_epochs=1,
                             num_neighbours=config.num_neighbours or 1):
    scored = batch["target_docs"] >= 0
    hidden = hidden_fn(params, batch["inputs"], batch["neighbours"] if with_neighbours else None,
                       batch["segments"])
    queries.append(np.asarray(hidden)[scored])
    targets.append(batch["targets"][scored])
    if sum(map(len, queries)) >= args.queries:
      break
  queries = np.concatenate(queries)[:args.queries]
  targets = np.concatenate(targets)[:args.queries]
  directory = args.datastore_dir or os.path.join(args.workdir, f"datastore-{args.model}")
  found = {}
  searchers = ("scann",) if args.skip_exact else ("exact", "scann")
  for searcher in searchers + (("bfloat16",) if args.bfloat16 else ()):
    start = time.perf_counter()
    if searcher == "bfloat16":   # the float32 keys as --key_dtype=bfloat16 stores them
      f32 = Datastore.open(directory)
      keys = np.asarray(f32.index.embeddings())
      store = Datastore(DocIndex(keys, np.arange(len(keys)), dtype="bfloat16"), f32.values,
                        f32.manifest)
      del f32, keys
    else:
      store = Datastore.open(directory, searcher=searcher,
                             **(scann_options if searcher == "scann" else {}))
    opened = time.perf_counter() - start
    store.search(queries[:64], args.k)   # compiles
    start = time.perf_counter()
    distances, values = store.search(queries, args.k)
    seconds = time.perf_counter() - start
    _, rows = store.index.search(augment_queries(queries), args.k)
    found[searcher] = (rows, np.asarray(knn_log_prob(distances, values, targets,
                                                     args.temperature)))
    print(json.dumps({"searcher": searcher, **(scann_options if searcher == "scann" else {}),
                      "entries": store.count, "k": args.k,
                      "queries": len(queries), "open_s": round(opened, 1),
                      "queries_per_s": round(len(queries) / seconds, 1)}), flush=True)
    del store
  if args.skip_exact:
    return
  exact_rows, exact_lp = found["exact"]
  for searcher in found:
    if searcher == "exact":
      continue
    rows, lp = found[searcher]
    recall = np.mean([len(np.intersect1d(a, b)) / args.k for a, b in zip(exact_rows, rows)])
    finite = np.isfinite(exact_lp) & np.isfinite(lp)
    print(json.dumps({"searcher": searcher, "recall_at_k_vs_exact_float32": round(float(recall), 4),
                      "log_p_knn_mean_abs_difference": round(float(
                          np.abs(exact_lp[finite] - lp[finite]).mean()), 5),
                      "target_found_exact": round(float(np.isfinite(exact_lp).mean()), 4),
                      f"target_found_{searcher}": round(float(np.isfinite(lp).mean()), 4)}))


if __name__ == "__main__":
  main()
