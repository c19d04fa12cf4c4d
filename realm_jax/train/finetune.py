"""Open-QA fine-tuning, end to end: `finetune(config, workdir)`.

    questions of one dataset or a weighted mixture (hash split: train / dev / test; draws by
    weight, realm_jax/data/mixture.py)
      -> question tower embeds B questions -> frozen index: a beam of Z blocks each
      -> has-answer masks from the answer strings, reader inputs + gold spans of the first R
      -> jitted step (batch sharded over every device): retriever marginal NLL + reader loss
      -> metrics, TensorBoard, dev EM every N steps (the best parameters kept), checkpoints.

The document tower and the index stay frozen (REFERENCE section 3); the question tower, the reader
BERT and its span scorer train. Questions without an answer string anywhere in their beam give
zero loss and zero gradient: with `skip_unanswerable` they are passed over (and counted), so every
step's B questions can teach something.

`workdir` gets: `corpus/`, `embeddings/`, `index/` (built here unless already there), `config.json`,
`checkpoints/` (latest state + data position, for resuming), `best/` (the parameters with the best
dev EM), `tb/`, `metrics.jsonl`. Started again on the same workdir, a run resumes by itself.
Single host: the batch is sharded over this host's devices.
"""

from __future__ import annotations

import functools
import json
import logging
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from realm_jax import config_checks
from realm_jax.data.answerable import corpus_finder
from realm_jax.data.corpus import CorpusConfig
from realm_jax.data.mixture import MixtureOrder, by_dataset, first_of_each, mixture_weights
from realm_jax.eval.open_qa import check_ks, evaluate_open_qa, per_dataset
from realm_jax.host_memory import release_freed_memory
from realm_jax.io_utils import as_path, read_json
from realm_jax.retrieval import build
from realm_jax.retrieval.index import index_options
from realm_jax.checkpoints import training as checkpoints
from realm_jax.systems.open_qa import (BEST, QaSetup, apply_init, check_best, load_reader,
                                       split_questions)
from realm_jax.train import loop
from realm_jax.train.qa_step import qa_optimizer, qa_train_step, summarize_qa

# Settings a resumed run must keep: the shapes of parameters, the questions and their splits,
# what the reader and retriever read and how their scores are scaled.
FIXED_SETTINGS = ("retrieval", "reader_weights", "reader_layers", "span_hidden_size", "max_span_width",
          "data", "reader_title", "reader_length", "score_scale", "question_length",
          "max_answer_spans")
NO_BEST = {"dev_em": -1.0, "dev_recall": -1.0, "step": -1}


def check_evaluated_config(config, workdir: str) -> None:
  """Refuses a config given on the command line to evaluate a work directory whose run
  was fine-tuned with other `FIXED_SETTINGS` (another retriever's index, reader, questions):
  names each setting that differs, both values, and what to do."""
  path = os.path.join(workdir, "config.json")
  if not as_path(path).exists():
    return  # not a fine-tuning work directory: check_best says so
  # A setting the run predates: its loop.ADDED_SETTINGS value, or (nested) left out.
  diff = _fixed_diff(config, path)
  if diff:
    settings = "; ".join(f"--config.{k}={now!r} here, {was!r} there" for k, was, now in diff)
    raise ValueError(
        f"{workdir} was fine-tuned with another config ({settings}): leave out --config and "
        f"--flagfile to use {path}, or pass the settings it was made with.")


def check_comparable_run(config, other: str, flag: str) -> None:
  """Refuses another fine-tuning work directory (`other`, given as `flag`) whose best model cannot
  be read as a system beside this run's: it must have a model and the same `FIXED_SETTINGS` but
  its questions (the same index, reader shapes and layout). Names each setting that differs."""
  path = os.path.join(other, "config.json")
  if not as_path(path).exists():
    raise FileNotFoundError(f"{flag}: {path} does not exist: {other} is not a fine-tuning work "
                            "directory. Give one that experiments/finetune.py made.")
  diff = _fixed_diff(config, path, FIXED_SETTINGS_BUT_DATA)
  if diff:
    settings = "; ".join(f"{k}={was!r} there, {now!r} here" for k, was, now in diff)
    raise ValueError(f"{flag}: {other} was fine-tuned with another index or model ({settings}): "
                     "only runs that differ in their questions (config.data) and training "
                     "are compared over one index.")
  check_best(other)


FIXED_SETTINGS_BUT_DATA = tuple(s for s in FIXED_SETTINGS if s != "data")


def _fixed_diff(config, path: str, fixed=FIXED_SETTINGS) -> list[tuple]:
  """[(setting, value in the config.json at `path`, value in `config`)] of the `fixed` settings
  that differ; a setting the saved run predates counts as its loop.ADDED_SETTINGS value."""
  old = _leaves({**loop.ADDED_SETTINGS, **read_json(path)})
  new = _leaves(json.loads(config.to_json()))
  return [(k, was, new.get(k)) for k, was in old.items()
          if k.split(".")[0] in fixed and was != new.get(k)]


def _leaves(config: dict, prefix: str = "") -> dict:
  """{"retrieval.index.dtype": value, ...}: a config as JSON, one entry per setting."""
  out = {}
  for k, v in config.items():
    out.update(_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


def dev_key(dev: dict) -> tuple[float, float]:
  """What selects the best model: dev EM, then recall@5 (0 where absent)."""
  return dev.get("em", 0.0), dev.get("recall_5", 0.0)


def best_record(manager: ocp.CheckpointManager, params) -> dict | None:
  """{"dev_em", "dev_recall", "step"} of the model a best/ manager holds, from the meta saved with
  it; None when it holds none.

  Its parameters are read too (into the template `params`, then dropped), so that a damaged model
  shows now, not when it is asked: it is passed over for an older one and set aside, or, when it
  is the only one, a ValueError saying what to do (see checkpoints.restore_latest).
  """
  got = checkpoints.restore_latest(manager, params, hint=(
      f"Move {manager.directory} away to go on fine-tuning without it (the next dev evaluation is "
      "then kept as the best), or restore it from a backup."))
  if got is None:
    return None
  meta = got[1]
  em, recall = dev_key(meta)
  return {"dev_em": em, "dev_recall": recall, "step": int(meta["step"])}


# ---------------------------------------------------------------------------------------- train
def check_counts(config) -> None:
  """ValueError naming the first count of `config` out of range (a zero period divided by zero
  after the first step; a negative limit dropped the last questions)."""
  positive = ("num_steps", "batch_size", "beam", "reader_blocks", "log_every", "checkpoint_every",
              "keep_checkpoints", "max_bad_steps", "eval_batch_size")
  zero_means = {"eval_every": "no dev evaluation", "eval_limit": "every dev question",
                "data.limit": "every question", "profile_start": "from the first step",
                "profile_steps": "no profile"}
  for key in positive:
    if config[key] < 1:
      raise ValueError(f"--config.{key}={config[key]}: must be at least 1.")
  for key, meaning in zero_means.items():
    value = config.data.limit if key == "data.limit" else config[key]
    if value < 0:
      raise ValueError(f"--config.{key}={value}: must be at least 0 (0 = {meaning}).")


class QaTrainer(loop.TrainLoop):
  """A fine-tuning run (realm_jax/train/loop.py): `run()` trains to config.num_steps, evaluating
  on dev and keeping the best parameters in best/."""

  name = "fine-tuning"
  eval_name = "dev"
  progress = {"loss": ("loss", ".3f"), "in_read": ("answer_in_read", ".2f"),
              "em_proxy": ("reader_em_proxy", ".2f")}

  def __init__(self, config, workdir: str):
    check_counts(config)
    super().__init__(config, workdir)
    pieces = loop.microbatch_pieces(config, "reader_microbatch", self.batch_shards)
    if config.reader_blocks > config.beam:
      raise ValueError(f"--config.reader_blocks={config.reader_blocks} is more than "
                       f"--config.beam={config.beam}: the read blocks are the beam's first ones.")
    # The questions, the weights, the corpus files and the index settings are checked before
    # config.json is written: a config refused for a typo must not become the workdir's.
    self.splits = split_questions(config)
    index_options(config.retrieval.index)
    towers = build.towers_of(config.retrieval, "--config.retrieval")
    reader = load_reader(config)
    _ = CorpusConfig.from_config(config.retrieval.corpus,
                                 towers["document"].tokenizer.vocab_file).fingerprint
    as_path(workdir).mkdir(parents=True, exist_ok=True)
    loop.check_workdir_config(config, workdir, FIXED_SETTINGS)
    self.setup = QaSetup(config, workdir, towers=towers, reader=reader)
    # Also checked before the embedding when the index is built here (open_index).
    build.check_corpus_size(self.setup.corpus, {"--config.beam": config.beam})
    check_ks(config.ks, len(self.setup.corpus))  # now, not at the first dev evaluation
    logging.info("Questions: %s", {k: len(v) for k, v in self.splits.items()})
    self.schedules, tx = qa_optimizer(config)
    tower = self.setup.models.query_tower
    self._embed = self.jit_eval(lambda p, q: tower.apply(
        {"params": p}, q["input_ids"], q["attention_mask"], q["token_type_ids"]))
    self.best_manager = checkpoints.checkpoint_manager(os.path.join(workdir, BEST), keep=1,
                                                       asynchronous=False, data=False)
    if config.data.get("drop_absent", False):
      self.splits["train"] = self._without_absent(self.splits["train"])
    self.order = MixtureOrder([q["dataset"] for q in self.splits["train"]],
                              mixture_weights(config.data), config.seed)
    self.position = {"draws": 0}      # training questions drawn (self.order)
    self.best = dict(NO_BEST)         # the record of the model in best/
    self.seen = 0                     # training questions examined (kept or passed over)
    self._window = [0, 0]             # questions trained, examined since the last log
    self.start(self.setup.init_params, tx,
               functools.partial(qa_train_step, models=self.setup.models, dropout=config.dropout,
                                 pieces=pieces))

  # --------------------------------------------------------------------------------- data
  def _without_absent(self, train: list[dict]) -> list[dict]:
    """The training questions whose answer is somewhere in the corpus: the others never have an
    answer in their beam and train nothing. How many of each dataset go is logged."""
    absent = corpus_finder(self.setup.batcher).absent(train)
    for name, rows in by_dataset(train).items():
      gone = sum(absent[i] for i in rows)
      logging.info("%s: %d of %d training questions have their answer nowhere in the corpus: "
                   "not trained on.", name, gone, len(rows))
    kept = [q for q, a in zip(train, absent) if not a]
    if not kept:
      raise ValueError("No training question has its answer anywhere in the corpus: check "
                       "config.retrieval.corpus and config.data.")
    return kept

  def _beams(self, questions: list[dict]) -> np.ndarray:
    """[n, Z] corpus rows of the beams of n <= B questions (padded to B: one compiled program)."""
    b = self.config.batch_size
    texts = [q["question"] for q in questions]
    inputs = self.setup.batcher.questions(texts + [texts[0]] * (b - len(texts)))
    emb = np.asarray(self._embed(self.state.params["query_tower"], inputs))[:len(texts)]
    _, ids = self.setup.index.search(emb, self.config.beam)
    return self.setup.corpus.rows_of(ids)

  def next_batch(self) -> dict:
    """The next B training questions (with an answer in their beam when skip_unanswerable),
    retrieved with the current question tower, as global arrays."""
    c, train = self.config, self.splits["train"]
    picked, beams, examined, since_kept = [], [], 0, 0
    while len(picked) < c.batch_size:
      draws = self.position["draws"]
      chunk = [self.order[draws + j] for j in range(c.batch_size - len(picked))]
      rows = self._beams([train[i] for i in chunk])
      for i, r in zip(chunk, rows):
        self.position["draws"] += 1
        examined += 1
        if not c.skip_unanswerable or self.setup.batcher.any_answer_in(train[i], r):
          picked.append(train[i])
          beams.append(r)
          since_kept = 0
        else:
          since_kept += 1
      if since_kept > len(train):
        raise ValueError(
            f"No training question has an answer in its beam of {c.beam} blocks: the corpus does "
            "not hold the answers (check config.retrieval.corpus and config.data), or raise "
            "config.beam.")
    self.seen += examined
    self._window = [self._window[0] + len(picked), self._window[1] + examined]
    read = 0 if self.retriever_only else c.reader_blocks
    if read and c.retriever_steps and int(self.state.step) == c.retriever_steps:
      self._drop_retriever_only_programs()
    return self.put(self.setup.batcher.train_batch(picked, np.stack(beams), self.setup.table,
                                                   read))

  def _drop_retriever_only_programs(self) -> None:
    """Reading starts: the retriever-only steps' compiled programs (one per question length)
    never run again, and on the CPU they hold ~0.4 GiB (the mixture's three: docs/notes.md,
    2026-12-01) that the reader's programs would be added to. Every compiled program goes (the
    dev evaluation's compile again once)."""
    dropped = getattr(self.step_fn, "_cache_size", lambda: "the")()  # jax's, not public
    jax.clear_caches()
    release_freed_memory()
    logging.info("Reading starts at step %d: %s retriever-only step programs dropped.",
                 int(self.state.step), dropped)

  @property
  def retriever_only(self) -> bool:
    """The first config.retriever_steps steps train the question tower alone."""
    return int(self.state.step) < self.config.retriever_steps

  # ----------------------------------------------------------------------------- evaluate
  def evaluate(self) -> dict:
    """EM (once the reader trains) and recall@k of the first config.eval_limit dev questions of
    each dataset, over all of them and (a mixture) per dataset: "<dataset>/em", ...; the best
    model is chosen on all of them."""
    questions = first_of_each(self.splits["dev"], self.config.eval_limit)
    result = evaluate_open_qa(self.setup.system(self.state.params), questions,
                              ks=tuple(self.config.ks), read=not self.retriever_only)
    out = {"seconds": result["seconds"]}
    parts = {"": {"em": result["em"], "recall": result["recall"]}}
    if len(by_dataset(questions)) > 1:
      parts.update({f"{name}/": r for name, r in per_dataset(result, questions).items()})
    for prefix, r in parts.items():
      if r["em"] is not None:
        out[f"{prefix}em"] = r["em"]
      out.update({f"{prefix}recall_{k}": v for k, v in r["recall"].items()})
    return out

  # ----------------------------------------------------------------------------- the loop
  def summarize(self, sums: dict) -> dict[str, float]:
    return summarize_qa(sums)

  def train_metrics(self, step: int) -> dict[str, float]:
    trained, examined = self._window
    self._window = [0, 0]
    return {"learning_rate": float(self.schedules["query_tower"](step)),
            "reader_learning_rate": float(self.schedules["reader"](step)),
            "answerable_share": trained / max(examined, 1)}

  def evaluated(self, step: int, metrics: dict) -> None:
    self.maybe_keep_best(step, metrics)

  def checkpoint_meta(self, step: int) -> dict:
    return {"step": step, "position": self.position, "best": self.best, "seen": self.seen}

  def resumed(self, meta: dict | None) -> None:
    """The data position of the checkpoint; the best record from best/ itself.

    best/ is written at once, the checkpoint that records it later and asynchronously: a run that
    died in between restarts from an older record, and would re-save a step best/ holds. An
    empty best/ gives no record: the next evaluation is kept.
    """
    if meta is not None:
      self.position = meta["position"]
      if "draws" not in self.position:  # a checkpoint of before the mixtures: epoch and cursor
        self.position = {"draws": self.position["epoch"] * len(self.splits["train"])
                                  + self.position["cursor"]}
      self.seen = meta.get("seen", 0)
    self.best = best_record(self.best_manager, self.state.params) or dict(NO_BEST)

  def keep_best(self, step: int, meta: dict) -> bool:
    """Saves the parameters to best/ as `step` (synchronously; the older model goes once it is
    written); False, writing nothing, when best/ already holds `step`: a step run again after a
    restart. Orbax cannot overwrite a step, and deleting it first could lose the kept model."""
    if step in self.best_manager.all_steps():
      logging.info("%s/%s already holds step %d: kept as it is.", self.workdir, BEST, step)
      return False
    checkpoints.save(self.best_manager, step, self.state.params, meta, force=True)
    return True

  def maybe_keep_best(self, step: int, dev: dict) -> bool:
    """Keeps the parameters in best/ if `dev` beats the record; True when they were kept."""
    key = dev_key(dev)
    if key <= (self.best["dev_em"], self.best["dev_recall"]):
      return False
    if not self.keep_best(step, {"step": step, **dev}):
      return False
    self.best = {"dev_em": key[0], "dev_recall": key[1], "step": step}
    logging.info("New best dev EM %.2f (recall@5 %.2f) at step %d, kept in %s/%s", key[0],
                 key[1], step, self.workdir, BEST)
    return True

  def finish(self, last_eval: dict, trained: bool) -> dict:
    if trained and not self.config.eval_every:  # nothing selected a model: keep the last one
      self.keep_best(self.config.num_steps, {"step": self.config.num_steps})
    return self.best


def finetune(config, workdir: str) -> dict:
  """Fine-tunes to config.num_steps (resuming from `workdir`); returns the best dev result."""
  config_checks.workdir(workdir)
  apply_init(config)
  build.check_settings(config.retrieval, "--config.retrieval")
  return loop.train(QaTrainer, config, workdir)
