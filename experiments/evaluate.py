"""Evaluates a fine-tuned open-QA system on its held-out questions, next to its baselines.

  python experiments/evaluate.py --flagfile=experiments/flags/finetune_wiki_vital.flags
  python experiments/evaluate.py --flagfile=... --split=dev --systems=finetuned --limit=200
  python experiments/evaluate.py --flagfile=... --recall_only=dense_untuned   # not read: faster
  python experiments/evaluate.py --flagfile=... --retrievers=ict=work/ict/export,dpr=work/dpr/export
      # more retrievers, each with its own index of the corpus, read by the same reader
  python experiments/evaluate.py --flagfile=experiments/flags/finetune_mixture.flags \
      --runs=nq_only=work/qa_wiki_vital --paired_with=nq_only
      # another run's fine-tuned model over the same index (other questions), paired
  python experiments/evaluate.py --workdir=W --dataset=curated_trec:test --dataset_dir=DIR
      # another dataset's questions (CuratedTREC answers are regexes: matched, not compared)

Reads the best checkpoint of --workdir (experiments/finetune.py), answers the --split part of the
config's questions with each system (realm_jax/eval/report.py: fine-tuned, untuned dense retriever +
same reader, BM25 + same reader, each of --retrievers + same reader, each of --runs' models) and writes <workdir>/eval/<split>/predictions-<system>.jsonl and
results.json, then prints EM and recall@k as a markdown table. A mixture's questions are evaluated
per dataset: a table and a folder <workdir>/eval/<split>/<dataset>/ each.
"""

import os

from absl import flags, logging

from realm_jax import cli
from realm_jax.checkpoints import resolve
from realm_jax.data.mixture import first_of_each
from realm_jax.data.qa import load_questions
from realm_jax.eval import report
from realm_jax.systems import open_qa
from realm_jax.train import finetune

_CONFIG = cli.define_config("config", None, "Config file (realm_jax/configs/finetune.py:<variant>); default: the workdir's config.json.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Work directory of a fine-tuning run.")
_SPLIT = flags.DEFINE_enum("split", "test", ["train", "dev", "test"], "Which part of the questions.")
_SYSTEMS = flags.DEFINE_list("systems", list(report.SYSTEMS), "Systems to evaluate.")
_RECALL_ONLY = flags.DEFINE_list("recall_only", [], "Systems evaluated for retrieval only (not read): faster.")
_RETRIEVERS = flags.DEFINE_list("retrievers", [], "More systems: NAME=WEIGHTS, another retriever (an ICT or DPR export, any weights build_index.py takes) with an index of the same corpus (built once in <workdir>/retrievers/NAME), read by the same fine-tuned reader.")
_RUNS = flags.DEFINE_list("runs", [], "More systems: NAME=WORKDIR, another fine-tuning run's best model (its question tower and its reader) over this run's index: same retrieval and reader settings, other questions or training (e.g. nq_only=work/qa_wiki_vital beside a mixture run).")
_PAIRED_WITH = flags.DEFINE_string("paired_with", "", "One of the systems: every other one's difference from it in EM and recall@k, question by question, with 95% paired bootstrap intervals (a second table; vs_NAME in results.json).")
_LIMIT = flags.DEFINE_integer("limit", 0, "Only the first N questions of each dataset (0 = all).")
_DATASET = flags.DEFINE_string("dataset", "", "Instead of the config's split: all questions of NAME:SPLIT, e.g. curated_trec:test, web_questions:test, nq_open:dev.")
_DATASET_DIR = flags.DEFINE_string("dataset_dir", "", "Local folder holding --dataset's file (\"\" = download with TFDS).")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  workdir = _WORKDIR.value
  if _LIMIT.value < 0:  # a negative slice would silently drop the last questions
    raise ValueError(f"--limit={_LIMIT.value}: pass a number of questions >= 1, or 0 for all.")
  retrievers = report.parse_retrievers(_RETRIEVERS.value)
  runs = report.parse_runs(_RUNS.value, retrievers)
  extra = [*retrievers, *runs]
  report.check_systems(_SYSTEMS.value, [r for r in _RECALL_ONLY.value if r not in extra])
  report.check_paired_with(_PAIRED_WITH.value, [*_SYSTEMS.value, *extra])
  for name, weights in retrievers.items():  # a missing directory fails before anything loads
    resolve(weights, flag=f"--retrievers={name}")
  config = open_qa.apply_init(_CONFIG.value or open_qa.load_workdir_config(workdir))
  if _CONFIG.value:  # the run's own settings, or a clear error naming those that differ
    finetune.check_evaluated_config(config, workdir)
  # Refused before the questions, the index and the models are loaded: a work directory without
  # a fine-tuned model (first: check_writable would create a misspelt --workdir), and an eval/
  # that cannot be written.
  open_qa.check_index(workdir)
  open_qa.check_best(workdir)
  for name, other in runs.items():
    finetune.check_comparable_run(config, other, f"--runs={name}")
  name, _, split = _DATASET.value.partition(":")
  if _DATASET.value and not split:
    raise ValueError(f"--dataset={_DATASET.value!r}: use NAME:SPLIT, e.g. curated_trec:test.")
  part = f"{name}-{split}" if _DATASET.value else _SPLIT.value
  out_dir = os.path.join(workdir, "eval", part)
  report.check_writable(out_dir)
  if _DATASET.value:
    questions = load_questions(name, split, local_dir=_DATASET_DIR.value or None)
  else:
    questions = open_qa.split_questions(config)[_SPLIT.value]
    if not questions:
      raise ValueError(f"The {part} part of config.data is empty (test_percent="
                       f"{config.data.test_percent}): evaluate --split=dev, or change the "
                       "config.")
  questions = first_of_each(questions, _LIMIT.value)
  setup = open_qa.QaSetup(config, workdir, build_missing=False)
  ks = tuple(config.ks)
  results = report.evaluate_by_dataset(setup, questions, _SYSTEMS.value, ks, out_dir,
                                       recall_only=_RECALL_ONLY.value, retrievers=retrievers,
                                       paired_with=_PAIRED_WITH.value, runs=runs)
  for name, table in results.items():
    label, where = (f"{part} {name}", os.path.join(out_dir, name)) if len(results) > 1 else (
        part, out_dir)
    count = next(iter(table.values()))["count"]
    print(f"{label}: {count} questions; predictions and results.json in {where}")
    print(report.format_table(table, ks))


if __name__ == "__main__":
  cli.run(main)
