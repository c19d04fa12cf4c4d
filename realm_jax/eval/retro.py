"""Held-out evaluation of RETRO (experiments/retro_eval.py, and the end of retro_train.py): bits
per byte and perplexity over whole held-out documents, for the RETRO decoder with its retrieved
neighbours, the same decoder with the neighbours removed (its CCA layers skipped), and the
baseline decoder; standard errors over documents; the tokens split by how much of what they
predict the neighbours they read already contain (8-gram overlap, as the paper's Figure 6).

Bits per byte = summed next-token loss (nats) / ln 2 / the UTF-8 bytes of the documents' text as
stored (cased, whitespace kept). Every text token of a held-out document is scored exactly once
(not the end-of-text that starts it, not padding), reading only its own document: the database's
held-out stream is cut into sequences whose targets tile it, and the model keeps documents apart. A
token's byte weight is its document's bytes / its document's scored tokens, so any subset of
tokens (an overlap bucket) has a bits-per-byte of its own that adds up to the whole.

Standard errors treat documents as the sampled unit: a ratio estimator's delta-method error, and
for the differences between two systems the paired error over the same documents.
"""

from __future__ import annotations

import json
import logging
import math
import os

import jax
import numpy as np
from tqdm.auto import tqdm

from realm_jax import io_utils
from realm_jax.checkpoints import retro_export
from realm_jax.data.retro_batches import retro_batches
from realm_jax.eval.stats import ratio_se
from realm_jax.io_utils import atomic_write, write_json
from realm_jax.models.retro import RetroModel, token_nll

LN2 = math.log(2.0)
NGRAM = 8
# Overlap buckets: the share of an attending chunk's targets inside an 8-gram of its neighbours.
BUCKETS = ((0.0, 0.0, "0%"), (0.0, 0.25, "(0, 25%]"), (0.25, 0.5, "(25, 50%]"),
           (0.5, 0.75, "(50, 75%]"), (0.75, 1.0, "(75, 100%]"))
NO_NEIGHBOURS = "first m-1 tokens"


def ngram_overlap(targets: np.ndarray, neighbours: np.ndarray, pad_id: int,
                  n: int = NGRAM) -> float:
  """The share of `targets` [T] inside an n-gram (of consecutive targets) that also occurs in one
  of `neighbours` [K, R] (padding left out); 0 when T < n."""
  grams = set()
  for row in neighbours:
    row = row[row != pad_id]
    grams.update(tuple(row[i:i + n]) for i in range(len(row) - n + 1))
  covered = np.zeros(len(targets), bool)
  for i in range(len(targets) - n + 1):
    if tuple(targets[i:i + n]) in grams:
      covered[i:i + n] = True
  return float(covered.mean()) if len(targets) else 0.0


def overlap_buckets(targets: np.ndarray, neighbours: np.ndarray, chunk_length: int,
                    pad_id: int) -> np.ndarray:
  """Bucket of each target of one sequence [L] with its neighbours [C, K, R]: -1 for the first
  m - 1 tokens (they read no neighbours), else the bucket (index into BUCKETS) of the overlap of
  its attending chunk's targets with the neighbours that chunk reads."""
  m, length = chunk_length, len(targets)
  out = np.full(length, -1, np.int32)
  for v in range(len(neighbours)):
    lo, hi = v * m + m - 1, min(length, (v + 1) * m + m - 1)
    if lo >= length:
      break
    r = ngram_overlap(targets[lo:hi], neighbours[v], pad_id)
    out[lo:hi] = next(i for i, (a, b, _) in enumerate(BUCKETS)
                      if (r == 0 if b == 0 else a < r <= b))
  return out


def export_names(paths: list[str], flag: str = "--models") -> dict[str, str]:
  """{name: export directory} of `paths`, each named by the directory above its export/ ("retro",
  "baseline"); where two would share a name, all are named by as many of the directories above
  as make the names unique ("seed0/retro", "seed1/retro"), and the log says so.

  Raises:
    ValueError naming `flag` when a directory is given twice.
  """
  parts = [[p for p in os.path.normpath(path).split(os.sep) if p] or [path] for path in paths]
  parts = [p[:-1] if len(p) > 1 and p[-1] == "export" else p for p in parts]
  for depth in range(1, max(map(len, parts)) + 1):
    names = ["/".join(p[-depth:]) for p in parts]
    if len(set(names)) == len(names):
      if depth > 1:
        logging.info("%s: exports of the same name, named by their paths: %s.", flag,
                     ", ".join(names))
      return dict(zip(names, paths))
  twice = next(p for i, p in enumerate(paths) if parts[i] in parts[:i])
  raise ValueError(f"{flag}={','.join(paths)}: {twice} is given twice; give each export once.")


def check_out_dir(out_dir: str) -> None:
  """OSError naming `out_dir` when eval.json, eval.md and bpb.png could not be written there
  (before the evaluation, not after it)."""
  io_utils.check_writable(out_dir, "eval.json, eval.md and bpb.png go there: make it writable, "
                          "or write them elsewhere (experiments/retro_eval.py --out).")


def _per_token_nll(config, params, db, retrieval: bool, batch_size: int, neighbours=None):
  """Yields (batch, nll [B, L]) over every held-out sequence. `neighbours` [S, n, k, 2m]: read
  these instead of the records' own (the held-out-in-database condition); the batch's
  `neighbours` are then replaced too."""
  module = RetroModel(config)
  fn = jax.jit(lambda p, t, n, s, y: token_nll(module.apply({"params": p}, t, n, segments=s), y))
  done = 0
  for batch in retro_batches(db, "heldout", batch_size=batch_size, seed=0, shuffle=False,
                             num_epochs=1, num_neighbours=config.num_neighbours or 1):
    if neighbours is not None:  # the last batch is padded with copies of the last sequence
      rows = np.minimum(np.arange(done, done + len(batch["inputs"])), len(neighbours) - 1)
      batch = {**batch, "neighbours": neighbours[rows, :, :config.num_neighbours]}
    done += len(batch["inputs"])
    nb = batch["neighbours"] if retrieval else None
    yield batch, np.asarray(fn(params, batch["inputs"], nb, batch["segments"], batch["targets"]))


def other_neighbours(db, k: int) -> np.ndarray:
  """The control for what a RETRO model reads: [S, n, k, 2m] neighbours where every held-out chunk
  that has neighbours reads those of another chunk, half the held-out stream away (so of another
  document), and a chunk without any keeps none. Same amount and kind of retrieved text, unrelated
  content: a model that gains as much from these as from its own neighbours does not use what
  they say."""
  own = np.concatenate([b["neighbours"] for b in retro_batches(
      db, "heldout", batch_size=64, seed=0, shuffle=False, num_epochs=1, num_neighbours=k)])
  own = own[:db.num_sequences("heldout")]
  flat = own.reshape(-1, *own.shape[2:])                                   # [S * n, k, 2m]
  real = np.flatnonzero((flat != db.tokenizer.pad_id).any(axis=(1, 2)))
  out = flat.copy()
  out[real] = flat[np.roll(real, len(real) // 2)]
  return out.reshape(own.shape)


def evaluate_exports(exports: dict[str, str], db, out_dir: str, batch_size: int = 8,
                     heldout_in_database: bool = False, other: bool = False) -> dict:
  """Bits per byte of each exported model over the database's held-out documents (a "retro"
  model also without its neighbours); writes eval.json, eval.md and bpb.png to `out_dir` (one
  that cannot be written fails first).

  heldout_in_database: a retrieval model is also scored (as `<name>_heldout_in_db`) with the
  neighbours of the paper's Wikitext-103 condition, searched among the held-out chunks too
  (`RetroDb.heldout_in_database_neighbours`): a chunk may read the rest of its own document, so
  that figure measures copying, not held-out modelling.
  other: a retrieval model is also scored (as `<name>_other_neighbours`) with every chunk reading
  another document's neighbours (`other_neighbours`): what its neighbours' content is worth."""
  check_out_dir(out_dir)
  leaky = None
  if heldout_in_database and any(retro_export.load_config(p).retrieval
                                 for p in exports.values()):
    values, _ = db.heldout_in_database_neighbours()
    m = db.chunk_length
    leaky = values.reshape(db.num_sequences("heldout"), db.seq_chunks, -1, 2 * m)
  docs = db.documents("heldout")
  doc_bytes = np.array([d["bytes"] for d in docs], np.float64)
  doc_tokens = np.array([d["tokens"] for d in docs], np.float64)
  systems, buckets_of = {}, {}   # (batch, k) -> overlap bucket of each target [B, L]
  for name, path in exports.items():
    config, params, meta = retro_export.load(path, flag="--models")
    db.check_export(config, meta)
    params = jax.device_put(params)
    # (label, with neighbours, the neighbours read instead of the records' own, where they are
    # from: the overlap buckets are computed once per batch and source)
    variants = [(name, True, None, "own")]
    if config.retrieval:
      variants.append((f"{name}_no_neighbours", False, None, "own"))
      if leaky is not None:
        variants.append((f"{name}_heldout_in_db", True, leaky, "heldout_in_db"))
      if other:
        variants.append((f"{name}_other_neighbours", True,
                         other_neighbours(db, config.num_neighbours),
                         f"other:{config.num_neighbours}"))
    for label, retrieval, neighbours, source in variants:
      nll_doc = np.zeros(len(docs))
      nll_bucket = np.zeros(len(BUCKETS) + 1)
      bytes_bucket = np.zeros(len(BUCKETS) + 1)
      tokens_bucket = np.zeros(len(BUCKETS) + 1)
      batches = tqdm(_per_token_nll(config, params, db, retrieval, batch_size, neighbours),
                     desc=f"evaluating {label}", unit="batch")
      for j, (batch, nll) in enumerate(batches):
        docs_t = batch["target_docs"]
        scored = docs_t >= 0
        np.add.at(nll_doc, docs_t[scored], nll[scored])
        # The same sequences in every pass; buckets by the neighbours read.
        key = (j, batch["neighbours"].shape[2], source)
        if key not in buckets_of:
          buckets_of[key] = np.stack([overlap_buckets(t, n, db.chunk_length, db.tokenizer.pad_id)
                                      for t, n in zip(batch["targets"], batch["neighbours"])])
        idx = buckets_of[key][scored] + 1
        np.add.at(nll_bucket, idx, nll[scored])
        np.add.at(bytes_bucket, idx, batch["target_bytes"][scored])
        np.add.at(tokens_bucket, idx, 1)
      systems[label] = {"nll_doc": nll_doc, "nll_bucket": nll_bucket,
                        "bytes_bucket": bytes_bucket, "tokens_bucket": tokens_bucket}
  report = _report(systems, doc_bytes, doc_tokens)
  _write(report, out_dir)
  return report


def _report(systems: dict, doc_bytes: np.ndarray, doc_tokens: np.ndarray) -> dict:
  models, diffs = {}, {}
  for label, s in systems.items():
    bpb, se = ratio_se(s["nll_doc"] / LN2, doc_bytes)
    nats = s["nll_doc"].sum() / doc_tokens.sum()
    models[label] = {"bits_per_byte": bpb, "se": se, "perplexity": math.exp(nats),
                     "nats_per_token": nats}
  labels = list(systems)
  for a in labels:
    for b in labels:
      if a < b or a == b:
        continue
      d, se = ratio_se((systems[a]["nll_doc"] - systems[b]["nll_doc"]) / LN2, doc_bytes)
      diffs[f"{a} - {b}"] = {"bits_per_byte": d, "se": se,
                             "ci95": [d - 1.96 * se, d + 1.96 * se]}
  names = (NO_NEIGHBOURS, *(b[2] for b in BUCKETS))
  # Each system's tokens are bucketed by the neighbours it read: systems that read other
  # neighbours (another document's, or with the held-out text in the database) have buckets of
  # their own, so every row keeps each system's tokens and bytes.
  overlap = []
  for i, name in enumerate(names):
    row = {"overlap": name, "tokens": {}, "bytes": {}, "bits_per_byte": {}}
    for label, s in systems.items():
      row["tokens"][label] = int(s["tokens_bucket"][i])
      row["bytes"][label] = float(s["bytes_bucket"][i])
      row["bits_per_byte"][label] = (float(s["nll_bucket"][i] / LN2 / s["bytes_bucket"][i])
                                     if s["bytes_bucket"][i] else None)
    overlap.append(row)
  return {"documents": len(doc_bytes), "tokens": int(doc_tokens.sum()),
          "bytes": int(doc_bytes.sum()), "models": models, "differences": diffs,
          "overlap": overlap}


def markdown(report: dict) -> str:
  lines = [f"Held-out: {report['documents']:,} documents, {report['tokens']:,} tokens, "
           f"{report['bytes']:,} bytes.", "",
           "| model | bits per byte | ± s.e. | perplexity (per token) |",
           "| --- | --- | --- | --- |"]
  for label, m in report["models"].items():
    lines.append(f"| {label} | {m['bits_per_byte']:.4f} | {m['se']:.4f} | {m['perplexity']:.1f} |")
  lines += ["", "| difference (paired over documents) | bits per byte | ± s.e. | 95% interval |",
            "| --- | --- | --- | --- |"]
  for label, d in report["differences"].items():
    lo, hi = d["bits_per_byte"] - 1.96 * d["se"], d["bits_per_byte"] + 1.96 * d["se"]
    lines.append(f"| {label} | {d['bits_per_byte']:+.5f} | {d['se']:.5f} | "
                 f"[{lo:+.5f}, {hi:+.5f}] |")
  groups = _bucketings(report)
  head, rule = ["overlap"], ["---"]
  for labels in groups:
    head += ["tokens", *labels]
    rule += ["---"] * (1 + len(labels))
  lines += ["", "Bits per byte by the 8-gram overlap of the predicted tokens with the neighbours "
            "they read (each tokens column counts the tokens of the systems after it, bucketed "
            "by the neighbours they read):", "", "| " + " | ".join(head) + " |",
            "| " + " | ".join(rule) + " |"]
  for row in report["overlap"]:
    cells = [row["overlap"]]
    for labels in groups:
      bpb = row["bits_per_byte"]
      cells += [f"{row['tokens'][labels[0]]:,}",
                *("-" if bpb[l] is None else f"{bpb[l]:.4f}" for l in labels)]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def _bucketings(report: dict) -> list[list[str]]:
  """The systems grouped by their overlap buckets (the same tokens in every row), in order."""
  groups: dict[tuple, list[str]] = {}
  for label in report["models"]:
    counts = tuple(row["tokens"][label] for row in report["overlap"])
    groups.setdefault(counts, []).append(label)
  return list(groups.values())


def plot(report: dict, path: str) -> str:
  """Bits per byte of each model (error bars: 1 s.e.) and by neighbour overlap, as a PNG."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  labels = list(report["models"])
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  values = [report["models"][l]["bits_per_byte"] for l in labels]
  ax1.bar(labels, values, yerr=[report["models"][l]["se"] for l in labels], capsize=4,
          color=["C0", "C1", "C2", "C3"][:len(labels)])
  ax1.set_ylim(min(values) * 0.95, max(values) * 1.03)
  ax1.set_ylabel("held-out bits per byte")
  ax1.set_title("held-out documents")
  for label in labels:
    rows = [r for r in report["overlap"] if r["tokens"][label]]
    ax2.plot([r["overlap"] for r in rows], [r["bits_per_byte"][label] for r in rows], marker="o",
             label=label)
  ax2.set_xlabel("8-gram overlap of the predicted chunk with its neighbours")
  ax2.set_ylabel("bits per byte")
  ax2.tick_params(axis="x", labelrotation=20)
  ax2.legend()
  io_utils.save_figure(fig, path, dpi=100)
  return path


def _write(report: dict, out_dir: str) -> None:
  write_json(os.path.join(out_dir, "eval.json"), report)
  atomic_write(os.path.join(out_dir, "eval.md"),
               lambda p: open(p, "w", encoding="utf-8").write(markdown(report)))
  try:
    plot(report, os.path.join(out_dir, "bpb.png"))
  except ImportError:  # matplotlib comes with the demo extra
    logging.info("matplotlib is not installed: no bpb.png (pip install 'realm-jax[demo]').")
  logging.info("Held-out evaluation: %s", json.dumps(
      {k: round(v["bits_per_byte"], 4) for k, v in report["models"].items()}))
