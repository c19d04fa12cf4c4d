"""Open-QA fine-tuning, end to end: `finetune(config, workdir)`.

    questions (hash split: train / dev / test)
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
import time

import jax
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from realm_jax import config_checks, workdir_lock
from realm_jax.checkpoints import detect_kind, from_hf_state_dict, load_minilm, read_state_dict
from realm_jax.data.corpus import CorpusConfig
from realm_jax.data.qa import load_questions, split_by_hash
from realm_jax.data.qa_batches import QaBatcher
from realm_jax.eval.open_qa import OpenQa, check_ks, evaluate_open_qa
from realm_jax.io_utils import as_path, read_json
from realm_jax.models import RealmConfig, RealmReader
from realm_jax.retrieval import build
from realm_jax.retrieval.index import index_options, latest_index_dir
from realm_jax.train import checkpoints, optimizer
from realm_jax.train.init import overlay
from realm_jax.train.metrics_writer import MetricsWriter
from realm_jax.train.pretrain import (add_step, check_workdir_config, count_bad_steps, postfix,
                                      window_metrics)
from realm_jax.train.qa_step import QaModels, TrainState, qa_params, qa_train_step, summarize_qa

# Settings a resumed run must keep: the shapes of parameters, the questions and their splits,
# what the reader and retriever read and how their scores are scaled.
_FIXED = ("retrieval", "reader_weights", "reader_layers", "span_hidden_size", "max_span_width",
          "data", "reader_title", "reader_length", "score_scale", "question_length",
          "max_answer_spans")
BEST = "best"
NO_BEST = {"dev_em": -1.0, "dev_recall": -1.0, "step": -1}


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


# ------------------------------------------------------------------------------------ questions
def split_questions(config) -> dict[str, list[dict]]:
  """{"train", "dev", "test"} questions of config.data: the splits pooled, then split by a hash of
  the normalised question (test first, then dev out of the rest)."""
  d = config.data
  questions = []
  for split in d.splits:
    questions += load_questions(d.name, split, local_dir=d.local_dir or None,
                                data_dir=d.data_dir or None)
  if d.limit:
    questions = questions[:d.limit]
  rest, test = split_by_hash(questions, d.test_percent, f"{d.seed}/test")
  train, dev = split_by_hash(rest, d.dev_percent, f"{d.seed}/dev")
  if not train or not dev:
    raise ValueError(f"--config.data gives {len(train)} training and {len(dev)} dev questions: use "
                     "more questions (config.data.splits / limit) or other percentages.")
  return {"train": train, "dev": dev, "test": test}


# --------------------------------------------------------------------------------------- models
def load_reader(config) -> tuple[RealmReader, dict, str]:
  """(reader module, its parameters, vocab file): the BERT from config.reader_weights, a new span
  scorer (unless the weights are a REALM reader, which brings its own)."""
  w = config.reader_weights
  if w == "minilm":
    model_config, bert, vocab = load_minilm()
    loaded, kind = {"realm": bert}, "bert"
  else:
    if not w or not as_path(w).is_dir():
      raise FileNotFoundError(
          f"--config.reader_weights={w!r} is not a directory: pass 'minilm' or a HF checkpoint "
          "directory (config.json + model.safetensors + vocab.txt) of a REALM reader, a REALM "
          "knowledge-augmented encoder (e.g. a pre-training export) or a BERT.")
    state = read_state_dict(w)
    kind = "reader" if detect_kind(state) == "reader" else "bert"
    model_config = RealmConfig.from_json_file(os.path.join(w, "config.json"))
    params, _ = from_hf_state_dict(state, kind, model_config, source=w)
    loaded = params if kind == "reader" else {"realm": params}
    vocab = os.path.join(w, "vocab.txt")
  model_config = model_config.replace(span_hidden_size=config.span_hidden_size,
                                      max_span_width=config.max_span_width)
  if config.reader_layers:
    if config.reader_layers > model_config.num_hidden_layers:
      raise ValueError(f"--config.reader_layers={config.reader_layers} is more than the "
                       f"{model_config.num_hidden_layers} layers of {w}.")
    model_config = model_config.replace(num_hidden_layers=config.reader_layers)
  reader = RealmReader(model_config)
  ids = np.zeros((1, 1, 16), np.int32)
  init = jax.jit(lambda r: reader.init(r, ids, ids, ids, ids, np.zeros((1, 1), np.float32)))
  params = overlay(init(jax.random.key(config.seed))["params"], loaded, f"reader weights {w}")
  return reader, params, vocab


def load_workdir_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a fine-tuning run saved in `workdir/config.json`."""
  path = os.path.join(workdir, "config.json")
  if not as_path(path).exists():
    raise FileNotFoundError(
        f"{path} does not exist: {workdir} is not a fine-tuning work directory. Run "
        f"experiments/finetune.py --workdir={workdir} first.")
  return ml_collections.ConfigDict(read_json(path))


def open_index(config, workdir: str, build_missing: bool = True, towers=None):
  """(corpus, index, towers): the index published in `workdir`, built first if it is not there
  (else, with build_missing=False, a FileNotFoundError that says how to build it). `towers`:
  already loaded `build.towers_of(config.retrieval)`."""
  if not build_missing:
    check_index(workdir)
  towers = towers or build.towers_of(config.retrieval)
  if latest_index_dir(os.path.join(workdir, "index")) is None:
    corpus, index, _ = build.build_index(config.retrieval, workdir, towers,
                                         min_blocks={"--config.beam": config.beam})
  else:
    corpus, index, _ = build.load_built_index(config.retrieval, workdir, towers)
  return corpus, index, towers


def table_by_row(corpus, index) -> np.ndarray:
  """[N, D] float32 index embeddings ordered by corpus row."""
  emb = np.asarray(index.embeddings(), np.float32)
  rows = corpus.rows_of(index.block_ids)
  if (rows < 0).any() or len(rows) != len(corpus):
    raise ValueError("The index does not hold exactly the corpus's blocks: rebuild it "
                     "(experiments/build_index.py) for this corpus.")
  table = np.empty_like(emb)
  table[rows] = emb
  return table


class QaSetup:
  """What fine-tuning, evaluation and ask share: corpus, index, models, batcher, parameters."""

  def __init__(self, config, workdir: str, build_missing: bool = True, towers=None,
               reader=None):
    """`towers` / `reader`: already loaded `build.towers_of(config.retrieval)` /
    `load_reader(config)`."""
    self.config, self.workdir = config, workdir
    self.corpus, self.index, towers = open_index(config, workdir, build_missing, towers)
    query = towers["query"]
    if query.module is None:
      raise ValueError("The retrieval weights give no trainable question tower.")
    reader, reader_params, vocab = reader or load_reader(config)
    if open(vocab, encoding="utf-8").read() != open(query.tokenizer.vocab_file,
                                                    encoding="utf-8").read():
      raise ValueError(f"The reader's vocabulary {vocab} differs from the retriever's "
                       f"{query.tokenizer.vocab_file}: both must read the same word pieces.")
    self.tokenizer = query.tokenizer
    self.models = QaModels(query.module, reader, float(config.score_scale))
    self.init_params = qa_params({"embedder": query.params}, reader_params)
    self.table = table_by_row(self.corpus, self.index)
    self.batcher = QaBatcher(self.corpus, self.tokenizer, question_length=config.question_length,
                             reader_length=config.reader_length,
                             max_answer_spans=config.max_answer_spans,
                             max_span_width=config.max_span_width,
                             reader_title=config.get("reader_title", True))

  def system(self, params) -> OpenQa:
    return OpenQa(self.batcher, self.models, params, self.index, self.table,
                  reader_blocks=self.config.reader_blocks,
                  batch_size=self.config.eval_batch_size)

  def best_params(self) -> tuple[dict, dict]:
    """(parameters, meta) of the best checkpoint in `workdir/best`; FileNotFoundError if none,
    ValueError if it is damaged (an older one that reads is used instead, with a warning; nothing
    is moved: this only reads)."""
    manager = checkpoints.checkpoint_manager(os.path.join(self.workdir, BEST), keep=1,
                                             asynchronous=False, data=False)
    got = checkpoints.restore_latest(manager, self.init_params, set_aside=False, hint=(
        f"Restore {manager.directory} from a backup, or fine-tune again with another --workdir."))
    if got is None:
      raise FileNotFoundError(
          f"{self.workdir}/{BEST} holds no fine-tuned model: run experiments/finetune.py "
          f"--workdir={self.workdir} first.")
    return got


def check_index(workdir: str) -> None:
  """FileNotFoundError (saying how to build one) unless `workdir/index` holds a published index."""
  if latest_index_dir(os.path.join(workdir, "index")) is None:
    raise FileNotFoundError(
        f"No index in {workdir}/index: build it with experiments/finetune.py --workdir={workdir} "
        "(or experiments/build_index.py with the same retrieval config).")


def check_best(workdir: str) -> None:
  """FileNotFoundError unless `workdir/best` holds a finished checkpoint."""
  path = as_path(os.path.join(workdir, BEST))
  done = path.is_dir() and any(p.is_dir() and p.name.isdigit() for p in path.iterdir())
  if not done:
    raise FileNotFoundError(
        f"{workdir}/{BEST} holds no fine-tuned model: run experiments/finetune.py "
        f"--workdir={workdir} first.")


# ---------------------------------------------------------------------------------------- train
def qa_optimizer(config) -> tuple[dict, optax.GradientTransformation]:
  """({"query_tower", "reader"} schedules, AdamW): the question tower's BERT schedule runs over
  all config.num_steps; the reader's starts after the config.retriever_steps retriever-only steps
  (its own warmup, then linear decay to the end), each part clipped on its own."""
  if not 0 <= config.retriever_steps < config.num_steps:
    raise ValueError(f"--config.retriever_steps={config.retriever_steps} must be in [0, "
                     f"--config.num_steps={config.num_steps}).")
  warmup = None if config.warmup_steps < 0 else config.warmup_steps
  schedules = {
      "query_tower": optimizer.bert_schedule(config.learning_rate, config.num_steps, warmup),
      "reader": optimizer.delayed_schedule(config.learning_rate, config.num_steps,
                                           config.retriever_steps, warmup)}
  parts = {k: optimizer.adamw_with(v, config.weight_decay, clip_norm=config.clip_norm)
           for k, v in schedules.items()}
  labels = lambda params: {k: jax.tree.map(lambda _, k=k: k, v) for k, v in params.items()}
  return schedules, optax.multi_transform(parts, labels)


def check_counts(config) -> None:
  """ValueError naming the first count of `config` out of range (a zero period divided by zero
  after the first step; a negative limit dropped the last questions)."""
  positive = ("num_steps", "batch_size", "beam", "reader_blocks", "log_every", "checkpoint_every",
              "eval_batch_size")
  zero_means = {"eval_every": "no dev evaluation", "eval_limit": "every dev question",
                "data.limit": "every question"}
  for key in positive:
    if config[key] < 1:
      raise ValueError(f"--config.{key}={config[key]}: must be at least 1.")
  for key, meaning in zero_means.items():
    value = config.data.limit if key == "data.limit" else config[key]
    if value < 0:
      raise ValueError(f"--config.{key}={value}: must be at least 0 (0 = {meaning}).")


class QaTrainer:
  """Fine-tuning run; `run()` trains to config.num_steps, evaluating and keeping the best."""

  def __init__(self, config, workdir: str):
    check_counts(config)
    if config.batch_size % jax.device_count():
      raise ValueError(f"--config.batch_size={config.batch_size} is not divisible by the "
                       f"{jax.device_count()} devices: pick a multiple.")
    if config.reader_blocks > config.beam:
      raise ValueError(f"--config.reader_blocks={config.reader_blocks} is more than "
                       f"--config.beam={config.beam}: the read blocks are the beam's first ones.")
    # The questions, the weights, the corpus files and the index settings are checked before
    # config.json is written: a config refused for a typo must not become the workdir's.
    self.splits = split_questions(config)
    index_options(config.retrieval.index)
    towers = build.towers_of(config.retrieval)
    reader = load_reader(config)
    _ = CorpusConfig.from_config(config.retrieval.corpus,
                                 towers["document"].tokenizer.vocab_file).fingerprint
    as_path(workdir).mkdir(parents=True, exist_ok=True)
    check_workdir_config(config, workdir, _FIXED)
    self.config, self.workdir = config, workdir
    self.setup = QaSetup(config, workdir, towers=towers, reader=reader)
    # Also checked before the embedding when the index is built here (open_index).
    build.check_corpus_size(self.setup.corpus, {"--config.beam": config.beam})
    check_ks(config.ks, len(self.setup.corpus))  # now, not at the first dev evaluation
    logging.info("Questions: %s", {k: len(v) for k, v in self.splits.items()})
    self.mesh = Mesh(np.array(jax.devices()), ("data",))
    self.replicated = NamedSharding(self.mesh, P())
    self.data_sharding = NamedSharding(self.mesh, P("data"))
    self.schedules, tx = qa_optimizer(config)
    self.state = jax.jit(lambda p: TrainState.create(apply_fn=None, params=p, tx=tx),
                         out_shardings=self.replicated)(self.setup.init_params)
    self.rng = jax.random.key(config.seed + 1)
    self.step_fn = jax.jit(
        functools.partial(qa_train_step, models=self.setup.models, dropout=config.dropout),
        in_shardings=(self.replicated, self.data_sharding, self.replicated),
        out_shardings=(self.replicated, self.replicated), donate_argnums=0)
    tower = self.setup.models.query_tower
    self._embed = jax.jit(lambda p, q: tower.apply(
        {"params": p}, q["input_ids"], q["attention_mask"], q["token_type_ids"]),
        in_shardings=(self.replicated, self.data_sharding), out_shardings=self.replicated)
    self.manager = checkpoints.checkpoint_manager(os.path.join(workdir, "checkpoints"), keep=1,
                                                  data=False)
    self.best_manager = checkpoints.checkpoint_manager(os.path.join(workdir, BEST), keep=1,
                                                       asynchronous=False, data=False)
    self.position = {"epoch": 0, "cursor": 0}
    self.best = dict(NO_BEST)         # the record of the model in best/
    self.seen = 0                     # training questions examined (kept or passed over)
    self._epoch_order = (-1, None)
    self.metrics = MetricsWriter(workdir)
    self.bad_steps = 0

  # --------------------------------------------------------------------------------- data
  def _order(self, epoch: int) -> np.ndarray:
    """The training questions' order in `epoch` (computed once per epoch)."""
    if self._epoch_order[0] != epoch:
      order = np.random.default_rng([self.config.seed, epoch]).permutation(
          len(self.splits["train"]))
      self._epoch_order = (epoch, order)
    return self._epoch_order[1]

  def _beams(self, questions: list[dict]) -> np.ndarray:
    """[n, Z] corpus rows of the beams of n <= B questions (padded to B: one compiled program)."""
    b = self.config.batch_size
    texts = [q["question"] for q in questions]
    inputs = self.setup.batcher.questions(texts + [texts[0]] * (b - len(texts)))
    emb = np.asarray(self._embed(self.state.params["query_tower"], inputs))[:len(texts)]
    _, ids = self.setup.index.search(emb, self.config.beam)
    return self.setup.corpus.rows_of(ids)

  def next_batch(self) -> tuple[dict, int]:
    """(host batch, questions examined): the next B training questions (with an answer in their
    beam when skip_unanswerable), retrieved with the current question tower."""
    c, train = self.config, self.splits["train"]
    picked, beams, examined, since_kept = [], [], 0, 0
    while len(picked) < c.batch_size:
      order = self._order(self.position["epoch"])
      cursor = self.position["cursor"]
      chunk = [int(i) for i in order[cursor:cursor + c.batch_size - len(picked)]]
      rows = self._beams([train[i] for i in chunk])
      for i, r in zip(chunk, rows):
        self.position["cursor"] += 1
        examined += 1
        if not c.skip_unanswerable or self.setup.batcher.any_answer_in(train[i], r):
          picked.append(train[i])
          beams.append(r)
          since_kept = 0
        else:
          since_kept += 1
      if self.position["cursor"] >= len(train):
        self.position = {"epoch": self.position["epoch"] + 1, "cursor": 0}
      if since_kept > len(train):
        raise ValueError(
            f"No training question has an answer in its beam of {c.beam} blocks: the corpus does "
            "not hold the answers (check config.retrieval.corpus and config.data), or raise "
            "config.beam.")
    read = 0 if self.retriever_only else c.reader_blocks
    batch = self.setup.batcher.train_batch(picked, np.stack(beams), self.setup.table, read)
    return batch, examined

  @property
  def retriever_only(self) -> bool:
    """The first config.retriever_steps steps train the question tower alone."""
    return int(self.state.step) < self.config.retriever_steps

  def _global(self, host_batch: dict):
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(self.data_sharding, x), host_batch)

  # ----------------------------------------------------------------------------- evaluate
  def evaluate(self, split: str = "dev", limit: int = 0) -> dict:
    questions = self.splits[split][:limit or None]
    result = evaluate_open_qa(self.setup.system(self.state.params), questions,
                              ks=tuple(self.config.ks), read=not self.retriever_only)
    out = {"seconds": result["seconds"]}
    if result["em"] is not None:
      out["em"] = result["em"]
    out.update({f"recall_{k}": v for k, v in result["recall"].items()})
    return out

  # ---------------------------------------------------------------------------------- run
  def save(self, step: int, force: bool = False):
    checkpoints.save(self.manager, step, self.state,
                     {"step": step, "position": self.position, "best": self.best,
                      "seen": self.seen}, force=force)

  def restore(self) -> None:
    """The latest checkpoint's state and data position; the best record from best/ itself.

    best/ is written at once, the checkpoint that records it later and asynchronously: a run that
    died in between restarts from an older record, and would re-save a step best/ holds. An
    empty best/ gives no record: the next evaluation is kept.
    """
    got = checkpoints.restore_latest(self.manager, self.state)
    if got is not None:
      self.state, meta = got
      self.position = meta["position"]
      self.seen = meta.get("seen", 0)
    self.best = best_record(self.best_manager, self.state.params) or dict(NO_BEST)
    self.metrics.resume_at(int(self.state.step))

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

  def run(self) -> dict:
    try:
      return self._run()
    finally:
      self.manager.wait_until_finished()
      self.metrics.close()

  def _run(self) -> dict:
    from tqdm.auto import tqdm
    c = self.config
    self.restore()
    start_step = int(self.state.step)
    if start_step >= c.num_steps:
      logging.info("Nothing to do: the run in %s is at step %d of %d.", self.workdir, start_step,
                   c.num_steps)
      return self.best
    sums, window_start, window_q, window_seen = None, time.perf_counter(), 0, 0
    bar = tqdm(total=c.num_steps, initial=start_step, desc="fine-tuning", unit="step")
    for step in range(start_step, c.num_steps):
      host_batch, examined = self.next_batch()
      self.state, out = self.step_fn(self.state, self._global(host_batch), self.rng)
      out = jax.device_get(out)
      self.bad_steps = count_bad_steps(self.bad_steps, out["skipped"], step, c.max_bad_steps,
                                       self.workdir)
      sums = add_step(sums, out)
      window_q += c.batch_size
      window_seen += examined
      self.seen += examined
      done = step + 1
      bar.update(1)
      if done % c.log_every == 0 or done == c.num_steps:
        elapsed = time.perf_counter() - window_start
        metrics = window_metrics(sums, summarize_qa)
        metrics.update(learning_rate=float(self.schedules["query_tower"](step)),
                       reader_learning_rate=float(self.schedules["reader"](step)),
                       questions_per_s=window_q / elapsed,
                       answerable_share=window_q / max(window_seen, 1))
        self.metrics.write(done, metrics, "train")
        bar.set_postfix(postfix(metrics, loss=("loss", ".3f"), in_read=("answer_in_read", ".2f"),
                                em_proxy=("reader_em_proxy", ".2f"),
                                q_s=("questions_per_s", ".1f")))
        sums, window_start, window_q, window_seen = None, time.perf_counter(), 0, 0
      if c.eval_every and (done % c.eval_every == 0 or done == c.num_steps):
        dev = self.evaluate("dev", c.eval_limit)
        self.metrics.write(done, dev, "dev")
        logging.info("step %d dev: %s", done, json.dumps({k: round(v, 3) for k, v in dev.items()}))
        self.maybe_keep_best(done, dev)
        window_start = time.perf_counter()  # the evaluation is not training time
      if done % c.checkpoint_every == 0 or done == c.num_steps:
        self.save(done, force=done == c.num_steps)
    bar.close()
    if not c.eval_every:  # nothing selected a model: the last one is the one to keep
      self.keep_best(c.num_steps, {"step": c.num_steps})
    return self.best


def finetune(config, workdir: str) -> dict:
  """Fine-tunes to config.num_steps (resuming from `workdir`); returns the best dev result."""
  config_checks.workdir(workdir)
  build.check_settings(config.retrieval, "--config.retrieval")
  with workdir_lock.hold(workdir):  # before anything is written there: one run per workdir
    return QaTrainer(config, workdir).run()
