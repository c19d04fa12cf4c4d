"""BM25 recall@k on NQ-Open dev over the embedded corpus (10,033 Wikipedia vital-article summaries).

  python benchmarks/bm25_recall.py                       # ../shared/data/nq_open, k1=0.9, b=0.4
  python benchmarks/bm25_recall.py --questions_dir=DIR --k1=1.2 --b=0.75

Each article (title + " " + text) is one document. A question is a hit at k when one of its
normalised answers occurs, as whole words, in the normalised title + text of one of its k first
articles (`text.answers.has_answer`). Prints recall@1/5/20 and the time of each stage.
"""

import argparse
import os
import time

import numpy as np

from realm_jax.data.qa import load_questions
from realm_jax.data.wiki_vital import load_articles
from realm_jax.retrieval.bm25 import BM25Index
from realm_jax.retrieval.recall import recall_at_k
from realm_jax.text.answers import has_answer, normalize_answer

KS = (1, 5, 20)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  parser.add_argument("--questions_dir", default=os.path.join(root, "..", "shared", "data",
                                                              "nq_open"))
  parser.add_argument("--split", default="dev")
  parser.add_argument("--k1", type=float, default=0.9)
  parser.add_argument("--b", type=float, default=0.4)
  args = parser.parse_args()

  start = time.perf_counter()
  docs = [a["title"] + " " + a["text"] for a in load_articles()]
  questions = load_questions("nq_open", args.split, local_dir=args.questions_dir)
  t_load = time.perf_counter()
  index = BM25Index.build(docs, k1=args.k1, b=args.b)
  t_build = time.perf_counter()
  _, rows = index.search([q["question"] for q in questions], max(KS))  # [Q, 20]
  t_search = time.perf_counter()
  normalized = {}
  hits = np.zeros(rows.shape, bool)
  for i, (q, row) in enumerate(zip(questions, rows)):
    for j, r in enumerate(row):
      if r >= 0:
        if r not in normalized:
          normalized[r] = normalize_answer(docs[r])
        hits[i, j] = has_answer("", q["answers"], normalized_text=normalized[r])
  t_hits = time.perf_counter()

  recall = recall_at_k(hits, KS)
  print(f"BM25 (k1={args.k1}, b={args.b}) over {len(docs)} articles ({len(index.vocab)} terms), "
        f"NQ-Open {args.split} ({len(questions)} questions): "
        + " ".join(f"R@{k}={v:.1f}" for k, v in recall.items()))
  print(f"time: load {t_load - start:.1f} s, build {t_build - t_load:.1f} s, search "
        f"{t_search - t_build:.1f} s ({len(questions) / (t_search - t_build):.0f} queries/s), "
        f"answer check {t_hits - t_search:.1f} s, total {t_hits - start:.1f} s")


if __name__ == "__main__":
  main()
