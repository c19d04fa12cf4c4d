"""The held-out report of a fine-tuned open-QA system, next to its baselines (experiments/evaluate.py).

Systems, all on the same questions and the same frozen index:
  finetuned        the fine-tuned question tower retrieves, the fine-tuned reader reads;
  dense_untuned    the question tower as it started (all-MiniLM-L6-v2 for the embedded corpus),
                   with the same fine-tuned reader: the dense retrieval baseline;
  bm25             BM25 (k1 0.9, b 0.4) over title + text retrieves, the same reader reads.
Each gets EM (regex match for CuratedTREC) and retriever recall@k; predictions are written as
JSONL (question, gold answers, answer, score, correct, evidence blocks with title and text span).
"""

from __future__ import annotations

import json
import logging
import os
import uuid

from realm_jax import io_utils
from realm_jax.eval.open_qa import evaluate_open_qa
from realm_jax.retrieval.bm25 import BM25Index

SYSTEMS = ("finetuned", "dense_untuned", "bm25")
BM25_DIR = "bm25"


def bm25_of(setup) -> BM25Index:
  """A BM25 index over the corpus rows (title + " " + body), saved in the workdir once and
  rebuilt when the corpus is another (its fingerprint is saved with it)."""
  path = os.path.join(setup.workdir, BM25_DIR)
  source = f"corpus {setup.corpus.fingerprint}"
  if io_utils.as_path(os.path.join(path, "manifest.json")).exists():
    index = BM25Index.load(path)
    if index.source == source and len(index) == len(setup.corpus):
      return index
    logging.warning("%s indexes %s (%d documents), not the %s (%d blocks): rebuilding it.", path,
                    index.source or "an unrecorded corpus", len(index), source, len(setup.corpus))
  texts = (setup.batcher.block(r)["text"] for r in range(len(setup.corpus)))
  index = BM25Index.build(texts, source=source)
  index.save(path)
  return index


def write_jsonl(path: str, rows) -> None:
  text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
  io_utils.write_text(path, text)


def check_writable(out_dir: str) -> None:
  """Makes `out_dir` (local or gs://) and writes and deletes a file in it, so that an output
  directory that cannot be written fails before the evaluation, not after it.

  Raises:
    OSError naming the directory and what to do.
  """
  directory = io_utils.as_path(out_dir)
  probe = directory / f".write-test-{uuid.uuid4().hex}"
  try:
    directory.mkdir(parents=True, exist_ok=True)
    probe.write_bytes(b"")
    probe.unlink()
  except OSError as e:
    raise OSError(
        f"{out_dir} cannot be written ({e.strerror or e}); the predictions and results.json go "
        "there. Make it writable (or move away a file that stands where one of its folders "
        "should be), or evaluate a writable copy of the work directory.") from e


def check_systems(systems, recall_only=()) -> None:
  """ValueError naming the systems (--systems / --recall_only) that are not in SYSTEMS."""
  unknown = [s for s in list(systems) + list(recall_only) if s not in SYSTEMS]
  if unknown:
    raise ValueError(f"--systems / --recall_only: unknown {unknown}; use some of {SYSTEMS}.")


def evaluate_systems(setup, questions, systems=SYSTEMS, ks=(1, 5, 20), out_dir: str | None = None,
                     params=None, progress: bool = True, recall_only=()) -> dict:
  """{system: {"em", "recall": {k: %}, "count", "seconds"}} on `questions`; predictions and a
  results.json go to `out_dir` when given (an `out_dir` that cannot be written fails first).
  `params`: the fine-tuned parameters (default: the best checkpoint of the workdir). Systems in
  `recall_only` are not read (em None): reading is what takes the time on a CPU."""
  check_systems(systems, recall_only)
  if out_dir:
    check_writable(out_dir)
  if params is None:
    params, meta = setup.best_params()
    logging.info("Fine-tuned model: %s", meta)
  untuned = {"query_tower": setup.init_params["query_tower"], "reader": params["reader"]}
  results = {}
  for name in systems:
    system = setup.system(untuned if name == "dense_untuned" else params)
    bm25 = bm25_of(setup) if name == "bm25" else None
    read = name not in recall_only
    got = evaluate_open_qa(system, questions, ks=ks, bm25=bm25, read=read, progress=progress)
    results[name] = {k: got[k] for k in ("em", "recall", "count", "seconds")}
    logging.info("%s: EM %s, recall %s (%d questions, %.0f s)", name, got["em"], got["recall"],
                 got["count"], got["seconds"])
    if out_dir and read:
      write_jsonl(os.path.join(out_dir, f"predictions-{name}.jsonl"), got["predictions"])
  if out_dir:
    io_utils.write_json(os.path.join(out_dir, "results.json"), results)
  return results


def format_table(results: dict, ks=(1, 5, 20)) -> str:
  """A markdown table: system, EM, recall@k."""
  head = "| system | questions | EM | " + " | ".join(f"R@{k}" for k in ks) + " |"
  lines = [head, "|" + "---|" * (3 + len(ks))]
  for name, r in results.items():
    recall = " | ".join(f"{r['recall'][k]:.1f}" for k in ks)
    em = "-" if r["em"] is None else f"{r['em']:.1f}"
    lines.append(f"| {name} | {r['count']} | {em} | {recall} |")
  return "\n".join(lines)
