"""DPR retriever training (Karpukhin et al. 2020): `train_and_evaluate(config, workdir)`.

    open-QA training questions -> BM25 over the corpus -> (question, positive, hard negative)
      (realm_jax/data/dpr.py: the positive holds an answer in what the passage tower reads of it;
      mined once, kept in <workdir>/examples.json) -> batches in which no question's answer is in
      another's passages
      -> jitted step: question tower [B, D], passage tower on the B positives and B hard negatives
         [2B, D] -> logits [B, 2B] over the GLOBAL batch (each question against every passage of
         every device: in-batch negatives gathered across devices) -> softmax cross-entropy with
         the question's own positive as label, AdamW
      -> metrics, TensorBoard, dev in-batch evaluation, orbax checkpoints (state + data iterator)
      -> `workdir/export/`: a HF REALM scorer directory that build_index.py (--config.weights),
         fine-tuning (--config.retrieval.weights), evaluate.py (--retrievers) and ask.py read.

The questions are fine-tuning's (config.data, split by the same hash): DPR trains on the training
part only, so fine-tuning's dev and held-out test questions stay unseen. Started again on the
same workdir, a run resumes from its newest checkpoint by itself.
"""

from __future__ import annotations

import functools
import logging
import os

import jax

from realm_jax import config_checks
from realm_jax.data.blocks import BLOCKINGS
from realm_jax.data.dpr import PassageAnswers, dpr_batches, mine_examples
from realm_jax.data.sources import SOURCES
from realm_jax.io_utils import as_path, read_json, write_json
from realm_jax.models.config import COMPUTE_DTYPES
from realm_jax.retrieval.bm25 import corpus_bm25
from realm_jax.retrieval.build import open_corpus
from realm_jax.systems.open_qa import split_questions
from realm_jax.text import BertTokenizer
from realm_jax.text.tokenizer import TRUNCATIONS
from realm_jax.train import loop, optimizer
from realm_jax.train.retriever_step import dpr_eval_step, dpr_step, passage_length
from realm_jax.train.two_towers import INITS, RetrieverTrainer, build_retriever, init_params

EXAMPLES = "examples.json"
# How the examples in examples.json were mined: a file mined otherwise is not used.
MINING = "positive: an answer in the passage tower's text; hard negative: none in the whole block"
# Settings a resumed run must keep: the shapes of parameters and what the examples are made of.
FIXED_SETTINGS = ("init", "model", "num_layers", "pooling", "retrieval", "data", "bm25_depth",
                  "question_length", "passage_length")


def mined_examples(config, workdir: str, corpus, answers: PassageAnswers) -> dict:
  """{"train": [...], "dev": [...], "counts": {...}}: the examples of fine-tuning's training and
  dev questions, mined once and kept in <workdir>/examples.json (a resumed run reads them).
  ValueError for a workdir whose examples were mined by an earlier definition of a positive: its
  checkpoints were trained on those."""
  path = os.path.join(workdir, EXAMPLES)
  if as_path(path).exists():
    saved = read_json(path)
    if saved.get("corpus") == corpus.fingerprint:
      if saved.get("mining") != MINING:
        raise ValueError(
            f"{path} holds DPR examples mined before their positives were judged on the text the "
            "passage tower reads (and batches kept apart questions whose answers are in each "
            "other's passages): its run does not resume with these. Use a new --workdir.")
      return saved
  questions = split_questions(config)
  bm25 = corpus_bm25(corpus, os.path.join(workdir, "bm25"), answers.block_text)
  out = {"corpus": corpus.fingerprint, "mining": MINING, "counts": {}}
  for split in ("train", "dev"):
    out[split], out["counts"][split] = mine_examples(questions[split], bm25, answers.in_passage,
                                                     answers.in_block, config.bm25_depth)
    logging.info("DPR %s examples: %s", split, out["counts"][split])
  if jax.process_index() == 0:
    write_json(path, out)
  return out


class DPRTrainer(RetrieverTrainer):
  """A DPR run (realm_jax/train/loop.py): `run()` trains to config.num_steps, then exports."""

  name = "DPR"
  eval_name = "dev"
  progress = {"loss": ("loss", ".3f"), "acc": ("accuracy", ".3f")}

  def __init__(self, config, workdir: str):
    super().__init__(config, workdir)
    self.export_dir = config.export_dir or os.path.join(workdir, "export")
    # Settings are checked before config.json is written (a config refused for a typo must not
    # become the workdir's) and before the corpus is built and the questions mined.
    self.model, self.model_config, self.vocab_file = build_retriever(config)
    self.score_scale = float(config.score_scale)
    as_path(workdir).mkdir(parents=True, exist_ok=True)
    loop.check_workdir_config(config, workdir, FIXED_SETTINGS)
    self.tokenizer = BertTokenizer(self.vocab_file)
    self.corpus = open_corpus(config.retrieval, config.data_dir or workdir, self.vocab_file)
    self.answers = PassageAnswers(self.corpus, self.tokenizer, passage_length(config),
                                  config.retrieval.truncate)
    self.examples = mined_examples(config, workdir, self.corpus, self.answers)
    train = self.examples["train"]
    if len(train) < self.host_batch * jax.process_count():
      raise ValueError(
          f"Only {len(train)} training questions have a BM25 positive and hard negative among "
          f"their first {config.bm25_depth} blocks ({self.examples['counts']['train']}): fewer "
          f"than --config.batch_size={config.batch_size}. Lower the batch size, raise "
          "--config.bm25_depth, or use more questions (--config.data).")
    dev = self.examples["dev"]
    if config.eval_every and (len(dev) < self.host_batch * jax.process_count() or next(
        self._batches(dev, 0, shuffle=False, num_epochs=1), None) is None):
      raise ValueError(
          f"The dev questions give {len(dev)} DPR examples ({self.examples['counts']['dev']}), "
          f"too few for one batch of {config.batch_size} in which no question's answer is in "
          "another's passages: raise --config.data.dev_percent, lower --config.batch_size, or set "
          "--config.eval_every=0.")
    self.schedule, tx = optimizer.from_config(config)
    self.data_iterator = self._batches(train, config.seed, shuffle=True)
    self.eval_fn = self.jit_eval(functools.partial(dpr_eval_step, model=self.model,
                                                   score_scale=self.score_scale))
    self.start(init_params(config, self.model, self.model_config, jax.random.key(config.seed)),
               tx, functools.partial(dpr_step, model=self.model, score_scale=self.score_scale,
                                     dropout=config.dropout))

  def _batches(self, examples, seed: int, shuffle: bool, num_epochs=None):
    c = self.config
    return dpr_batches(examples, self.corpus, self.tokenizer, batch_size=self.host_batch,
                       seed=seed, question_length=c.question_length,
                       passage_length=passage_length(c), truncate=c.retrieval.truncate,
                       shuffle=shuffle, shard_index=jax.process_index(),
                       shard_count=jax.process_count(), num_epochs=num_epochs,
                       answers=self.answers)

  def next_batch(self) -> dict:
    return self.put(next(self.data_iterator))

  def evaluate(self) -> dict[str, float]:
    """Mean in-batch metrics (no dropout) over the first config.eval_batches batches of the dev
    questions' examples, in their order: the same pairs at every evaluation."""
    return self.mean_in_batch_metrics(
        self.put(b) for b in self._batches(self.examples["dev"], 0, shuffle=False, num_epochs=1))


def check_run_settings(config, workdir: str) -> None:
  """Refuses settings no run can use, naming the flag, before weights, corpus or compiling."""
  config_checks.workdir(workdir)
  config_checks.at_least(config, {
      **loop.LOOP_MINIMUMS, "batch_size": 2, "learning_rate": 0, "eval_batches": 1,
      "num_layers": 0, "bm25_depth": 2, "question_length": 3, "passage_length": 0,
      "score_scale": 0, "retrieval.max_length": 4, "retrieval.corpus.block_length": 4,
      "retrieval.corpus.max_docs": 0})
  config_checks.one_of(config, {
      "init": INITS, "dtype": COMPUTE_DTYPES, "pooling": ("auto", "mean", "projected_cls"),
      "retrieval.truncate": TRUNCATIONS, "retrieval.corpus.source": SOURCES,
      "retrieval.corpus.blocking": BLOCKINGS})
  if config.passage_length and config.passage_length < 4:
    raise ValueError(f"--config.passage_length={config.passage_length}: give at least 4 word "
                     "pieces, or 0 for config.retrieval.max_length.")


def train_and_evaluate(config, workdir: str) -> dict[str, float]:
  """DPR to config.num_steps (resuming from `workdir`), then the export; returns the last dev
  metrics."""
  check_run_settings(config, workdir)
  return loop.train(DPRTrainer, config, workdir)
