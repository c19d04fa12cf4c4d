"""kNN-LM evaluation (experiments/knnlm_eval.py): each trained decoder alone and interpolated with
the nearest neighbours of its own datastore (realm_jax/retrieval/datastore.py), over the held-out
documents of its chunk database.

Every held-out token is scored once, as in eval/retro.py: -log p_LM(y) from the decoder (a RETRO
export reads its neighbours: RETRO + kNN-LM), and log p_kNN(y) from the k entries nearest its
context representation (models/knnlm.py). The held-out documents are cut in two halves by a hash
of their title: on the dev half lambda (and the temperature, when several are given) is chosen
from a grid by the interpolated perplexity; the test half gives the numbers reported: bits per
byte and perplexity with standard errors over documents (eval/stats.ratio_se), and the paired
difference interpolated - alone over the same documents.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from realm_jax import config_checks
from realm_jax.checkpoints import retro_export
from realm_jax.data.retro_batches import retro_batches
from realm_jax.eval.retro import LN2
from realm_jax.eval.stats import ratio_se
from realm_jax.io_utils import atomic_write, write_json
from realm_jax.models.knnlm import interpolate, knn_log_prob
from realm_jax.models.retro import RetroModel, token_nll
from realm_jax.retrieval import datastore as ds
from realm_jax.retrieval.searcher import SEARCHERS

LAMBDAS = tuple(round(0.05 * i, 2) for i in range(1, 20))   # 0.05 ... 0.95
DEV_SALT = "knnlm-dev"


def check_settings(*, k: int, lambdas, temperatures, searcher: str, batch_size: int,
                   dtype: str = "float32", searcher_options: dict | None = None) -> None:
  """Cheap checks of the evaluation's settings, naming their flags, before any work."""
  config_checks.whole_number("--k", k, 1, None, " (neighbours per token; the paper: 1024)")
  if not lambdas:
    raise ValueError("--lambdas is empty: give kNN weights between 0 and 1 (or one --lambda).")
  bad = [x for x in lambdas if not 0.0 <= x <= 1.0]
  if bad:
    raise ValueError(f"--lambdas / --lambda={bad[0]!r}: a kNN weight must be between 0 and 1.")
  bad = [t for t in temperatures if not (t > 0 and math.isfinite(t))]
  if not temperatures or bad:
    raise ValueError(f"--temperature={bad[0] if bad else ''!r}: give positive temperatures "
                     "(the paper: 1).")
  if searcher not in SEARCHERS:
    raise ValueError(f"--searcher={searcher!r}: use one of {tuple(SEARCHERS)}.")
  allowed = SEARCHERS[searcher].config_keys
  for key, value in (searcher_options or {}).items():
    if key not in allowed:
      raise ValueError(f"--searcher_options: {searcher} has no setting {key!r}; its settings: "
                       f"{allowed or 'none'}.")
    config_checks.whole_number(f"--searcher_options={key}", value, 1)
  ds.check_options(dtype=dtype, batch_size=batch_size)


def dev_documents(documents: list[dict]) -> np.ndarray:
  """[D] bool: whether each held-out document is in the dev half (SHA-256 of a salt and its title
  alone, so that passages of one title stay together; even first 8 bytes), the same on every machine whatever the other documents."""
  def dev(d):
    digest = hashlib.sha256(f"{DEV_SALT}\0{d['title']}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 2 == 0
  return np.array([dev(d) for d in documents], bool)


def score_heldout(config, params, store: ds.Datastore, db, *, k: int, temperatures,
                  batch_size: int = 8, desc: str = "kNN-LM",
                  decoder_memory: bool = False) -> dict:
  """Per scored held-out token, in stream order: doc [T] int, nll [T] float64 (the decoder's
  -log p(y)), log_knn [T, len(temperatures)] float32 (log p_kNN(y) at each temperature); and the
  seconds spent searching (the datastore's search and exact distances).

  decoder_memory (a RETRO decoder): the queries are its states without its neighbours (as the
  keys of a datastore built with `neighbours=False`), and nll_no_neighbours [T] is added: the
  same decoder's -log p(y) with its CCA layers skipped."""
  module = RetroModel(config)
  fn = jax.jit(lambda p, t, n, g, y: (lambda out: (token_nll(out[0], y), out[1]))(
      module.apply({"params": p}, t, n, return_hidden=True, segments=g)))
  log_prob = jax.jit(knn_log_prob)
  two = decoder_memory and config.retrieval
  docs, nll, nll_alone, log_knn, seconds = [], [], [], [], 0.0
  batches = retro_batches(db, "heldout", batch_size=batch_size, seed=0, shuffle=False,
                          num_epochs=1, num_neighbours=config.num_neighbours or 1)
  for batch in tqdm(batches, total=-(-db.num_sequences("heldout") // batch_size), desc=desc,
                    unit="batch"):
    args = (batch["inputs"], batch["neighbours"] if config.retrieval else None,
            batch["segments"], batch["targets"])
    token_nll_, hidden = fn(params, *args)
    scored = batch["target_docs"] >= 0
    if two:
      alone_, hidden = fn(params, args[0], None, *args[2:])
      nll_alone.append(np.asarray(alone_)[scored].astype(np.float64))
    targets = batch["targets"][scored]
    start = time.perf_counter()
    distances, values = store.search(np.asarray(hidden)[scored], k)
    seconds += time.perf_counter() - start
    log_knn.append(np.stack([np.asarray(log_prob(distances, values, targets, t))
                             for t in temperatures], axis=1))
    docs.append(batch["target_docs"][scored])
    nll.append(np.asarray(token_nll_)[scored].astype(np.float64))
  out = {"doc": np.concatenate(docs), "nll": np.concatenate(nll),
         "log_knn": np.concatenate(log_knn), "search_seconds": seconds}
  if two:
    out["nll_no_neighbours"] = np.concatenate(nll_alone)
  return out


def interpolated_nll(nll: np.ndarray, log_knn: np.ndarray, lam: float) -> np.ndarray:
  """-log(lam p_kNN + (1 - lam) p_LM) per token [T] float64, from nll = -log p_LM [T] and
  log p_kNN [T]."""
  return -np.asarray(interpolate(-nll, log_knn, lam), np.float64)


def tune(nll: np.ndarray, log_knn: np.ndarray, lambdas, temperatures) -> tuple[dict, list]:
  """The (lambda, temperature) of the grid with the lowest mean interpolated nll over the given
  tokens (ties: the first), and the grid: [{lambda, temperature, nats_per_token}]."""
  grid = [{"lambda": float(lam), "temperature": float(t),
           "nats_per_token": float(interpolated_nll(nll, log_knn[:, i], lam).mean())}
          for i, t in enumerate(temperatures) for lam in lambdas]
  return min(grid, key=lambda g: g["nats_per_token"]), grid


def _summary(nll_doc: np.ndarray, doc_bytes: np.ndarray, doc_tokens: np.ndarray) -> dict:
  bpb, se = ratio_se(nll_doc / LN2, doc_bytes)
  nats, nats_se = ratio_se(nll_doc, doc_tokens)
  return {"bits_per_byte": bpb, "se": se, "perplexity": math.exp(nats),
          "perplexity_se": math.exp(nats) * nats_se, "nats_per_token": nats}


def report_model(scores: dict, documents: list[dict], dev: np.ndarray, lambdas,
                 temperatures, reference: tuple[str, np.ndarray] | None = None) -> dict:
  """Lambda (and temperature) tuned on the dev documents' tokens; each half's figures alone and
  interpolated, with the paired difference; `reference` (name, nll [T] of another model over the
  same tokens) adds the paired difference interpolated - that model alone."""
  on_dev = dev[scores["doc"]]
  best, grid = tune(scores["nll"][on_dev], scores["log_knn"][on_dev], lambdas, temperatures)
  knn = interpolated_nll(scores["nll"], scores["log_knn"][:, list(temperatures).index(
      best["temperature"])], best["lambda"])
  doc_bytes = np.array([d["bytes"] for d in documents], np.float64)
  out = {"lambda": best["lambda"], "temperature": best["temperature"], "dev_grid": grid}
  for half, mask in (("dev", dev), ("test", ~dev)):
    ids = np.flatnonzero(mask)
    per_doc = lambda x: np.bincount(scores["doc"], weights=x, minlength=len(documents))[ids]
    tokens = per_doc(np.ones_like(scores["nll"]))
    alone, inter = per_doc(scores["nll"]), per_doc(knn)
    diff, diff_se = ratio_se((inter - alone) / LN2, doc_bytes[ids])
    out[half] = {"documents": len(ids), "tokens": int(tokens.sum()),
                 "bytes": int(doc_bytes[ids].sum()),
                 "alone": _summary(alone, doc_bytes[ids], tokens),
                 "knnlm": _summary(inter, doc_bytes[ids], tokens),
                 "difference": {"bits_per_byte": diff, "se": diff_se}}
    if reference is not None:
      diff, diff_se = ratio_se((inter - per_doc(reference[1])) / LN2, doc_bytes[ids])
      out[half]["vs_reference"] = {"model": reference[0], "bits_per_byte": diff, "se": diff_se}
  return out


def evaluate_knnlm(exports: dict[str, str], db, out_dir: str, *, datastore_dirs: dict[str, str],
                   k: int = 1024, lambdas=LAMBDAS, temperatures=(1.0,), searcher: str = "exact",
                   batch_size: int = 8, dtype: str = "float32",
                   searcher_options: dict | None = None, decoder_memory: bool = False) -> dict:
  """Each exported decoder alone and as a kNN-LM over its own datastore (built, resumed or
  reused in datastore_dirs[name]); writes knnlm.json and knnlm.md to `out_dir`; returns the
  report. Every setting, export and datastore directory is checked before the first build.

  decoder_memory: a RETRO decoder's datastore holds its states without its neighbours (its CCA
  layers skipped), and it is reported twice over that one memory: as `<name>_no_neighbours`
  (for a RETROfit with a frozen decoder: the pre-trained decoder and its kNN-LM) and with its
  neighbours (RETRO + the decoder's kNN-LM)."""
  check_settings(k=k, lambdas=lambdas, temperatures=temperatures, searcher=searcher,
                 batch_size=batch_size, dtype=dtype, searcher_options=searcher_options)
  if k > ds.num_entries(db):
    raise ValueError(f"--k={k}: the datastore of {db.directory} holds {ds.num_entries(db)} "
                     "entries (its train tokens); ask for fewer neighbours.")
  dirs = [datastore_dirs[name] for name in exports]
  if len({os.path.abspath(d) for d in dirs}) < len(dirs):
    raise ValueError(f"--datastore_dir={','.join(dirs)}: each model needs its own directory.")
  for name, path in exports.items():   # the cheap checks of every model before any work
    config, params, meta = retro_export.load(path, flag="--models")
    db.check_export(config, meta)
    ds.check_directory(datastore_dirs[name], ds.datastore_settings(
        config, params, db, source=path, dtype=dtype, batch_size=batch_size,
        neighbours=not decoder_memory))
  documents = db.documents("heldout")
  dev = dev_documents(documents)
  report = {"k": k, "searcher": searcher, "searcher_options": dict(searcher_options or {}),
            "decoder_memory": decoder_memory,
            "lambdas": list(lambdas), "temperatures": list(temperatures), "models": {}}
  for name, path in exports.items():
    config, params, _ = retro_export.load(path, flag="--models")
    params = jax.device_put(params)
    manifest = ds.build_datastore(config, params, db, datastore_dirs[name], source=path,
                                  dtype=dtype, batch_size=batch_size,
                                  neighbours=not decoder_memory)
    start = time.perf_counter()
    store = ds.Datastore.open(datastore_dirs[name], model_fingerprint=manifest["model_fingerprint"],
                              db_fingerprint=db.fingerprint, searcher=searcher,
                              **(searcher_options or {}))
    index_seconds = time.perf_counter() - start
    scores = score_heldout(config, params, store, db, k=k,
                           temperatures=temperatures, batch_size=batch_size,
                           desc=f"kNN-LM {name}", decoder_memory=decoder_memory)
    del store
    queries = len(scores["nll"])
    rows = {name: scores["nll"]}
    if "nll_no_neighbours" in scores:
      rows = {f"{name}_no_neighbours": scores["nll_no_neighbours"], **rows}
    for row, nll in rows.items():
      reference = (f"{name}_no_neighbours", scores["nll_no_neighbours"]) if (
          row == name and len(rows) == 2) else None
      result = report_model({**scores, "nll": nll}, documents, dev, lambdas, temperatures,
                            reference=reference)
      result["datastore"] = {key: manifest[key] for key in ("count", "dim", "dtype", "bytes",
                                                            "seconds", "reused")}
      result["datastore"]["directory"] = datastore_dirs[name]
      result["search"] = {"queries": queries, "open_seconds": round(index_seconds, 2),
                          "seconds": round(scores["search_seconds"], 2),
                          "queries_per_s": round(queries / max(scores["search_seconds"], 1e-9),
                                                 1)}
      report["models"][row] = result
      logging.info("kNN-LM %s: test bits per byte %.4f alone, %.4f interpolated (lambda %.2f).",
                   row, result["test"]["alone"]["bits_per_byte"],
                   result["test"]["knnlm"]["bits_per_byte"], result["lambda"])
  write_json(os.path.join(out_dir, "knnlm.json"), report)
  atomic_write(os.path.join(out_dir, "knnlm.md"),
               lambda p: open(p, "w", encoding="utf-8").write(markdown(report)))
  return report


def markdown(report: dict) -> str:
  """The report as knnlm.md: test-half figures, the tuned weights, datastores and search."""
  models = report["models"]
  first = next(iter(models.values()), None)
  lines = []
  if first:
    t = first["test"]
    lines += [f"Test half of the held-out documents: {t['documents']:,} documents, "
              f"{t['tokens']:,} tokens, {t['bytes']:,} bytes (lambda and the temperature chosen "
              f"on the other half, {first['dev']['documents']:,} documents). k = {report['k']}, "
              f"searcher {report['searcher']}"
              + (f" {report['searcher_options']}" if report.get("searcher_options") else "")
              + "." + (" Every datastore holds its decoder's states without neighbours (CCA "
                       "skipped), also the queries of the rows with neighbours."
                       if report.get("decoder_memory") else ""), ""]
  lines += ["| model | bits per byte ± s.e. | perplexity ± s.e. | + kNN-LM: bits per byte "
            "± s.e. | perplexity ± s.e. | difference (paired), bits per byte ± s.e. | lambda | T |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for name, m in models.items():
    a, b, d = m["test"]["alone"], m["test"]["knnlm"], m["test"]["difference"]
    lines.append(f"| {name} | {a['bits_per_byte']:.4f} ± {a['se']:.4f} | {a['perplexity']:.1f} ± "
                 f"{a['perplexity_se']:.1f} | {b['bits_per_byte']:.4f} ± {b['se']:.4f} | "
                 f"{b['perplexity']:.1f} ± {b['perplexity_se']:.1f} | {d['bits_per_byte']:+.4f} "
                 f"± {d['se']:.4f} | {m['lambda']:.2f} | {m['temperature']:g} |")
  for name, m in models.items():
    v = m["test"].get("vs_reference")
    if v:
      lines += ["", f"{name} + kNN-LM - {v['model']} alone (paired over the test documents): "
                f"{v['bits_per_byte']:+.4f} ± {v['se']:.4f} bits per byte."]
  lines += ["", "| model | datastore entries | bytes | build (s) | searcher opened (s) | "
            "queries | search (s) | queries/s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for name, m in models.items():
    s, q = m["datastore"], m["search"]
    built = f"{s['seconds']:.1f}" + (" (reused)" if s["reused"] else "")
    lines.append(f"| {name} | {s['count']:,} x {s['dim']} {s['dtype']} | {s['bytes']:,} | {built} "
                 f"| {q['open_seconds']:.1f} | {q['queries']:,} | {q['seconds']:.1f} | "
                 f"{q['queries_per_s']:.0f} |")
  return "\n".join(lines) + "\n"
