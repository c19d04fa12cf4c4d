"""The questions whose answer is nowhere in the corpus, counted per dataset and part
(experiments/absent_answers.py): no retriever can bring them an answering block, so they train
nothing; fine-tuning drops them from training (config.data.drop_absent), while evaluation keeps
them, so that EM and recall@k stay over every held-out question and compare with other systems'.

    counts = count_absent(config, workdir)   # {dataset: {part: {"questions", "absent"}}}
    print(format_table(counts))
"""

from __future__ import annotations

import os

from realm_jax import config_checks, io_utils
from realm_jax.checkpoints import resolve
from realm_jax.data.answerable import absent_counts, corpus_finder
from realm_jax.data.qa_batches import QaBatcher
from realm_jax.retrieval.build import open_corpus
from realm_jax.systems.open_qa import split_questions
from realm_jax.text import BertTokenizer

RESULTS = "absent_answers.json"


def count_absent(config, workdir: str) -> dict[str, dict]:
  """{dataset: {"train" | "dev" | "test": {"questions", "absent"}}} of a fine-tuning config's
  questions over its corpus (built in `workdir` if it is not there: no index is needed); also
  written to <workdir>/absent_answers.json."""
  config_checks.workdir(workdir)
  parts = split_questions(config)
  vocab = resolve(config.retrieval.weights, flag="--config.retrieval.weights").vocab()
  corpus = open_corpus(config.retrieval, workdir, vocab)
  batcher = QaBatcher(corpus, BertTokenizer(vocab), question_length=config.question_length,
                      reader_length=config.reader_length,
                      reader_title=config.get("reader_title", True))
  counts = absent_counts(parts, corpus_finder(batcher))
  io_utils.write_json(os.path.join(workdir, RESULTS), counts)
  return counts


def format_table(counts: dict[str, dict]) -> str:
  """A markdown table: per dataset and part, the questions whose answer is nowhere in the corpus."""
  parts = list(dict.fromkeys(p for c in counts.values() for p in c))
  lines = ["| dataset | " + " | ".join(f"{p}: absent / questions" for p in parts) + " |",
           "|" + "---|" * (1 + len(parts))]
  cell = lambda n: (f"{n['absent']:,} / {n['questions']:,} "
                    f"({100 * n['absent'] / n['questions']:.1f}%)")
  for name, c in counts.items():
    lines.append(f"| {name} | " + " | ".join(cell(c[p]) if c.get(p, {}).get("questions") else "-"
                                              for p in parts) + " |")
  return "\n".join(lines)
