"""The open-QA system: question tower -> index -> reader -> answer text and evidence, and what
fine-tuning, evaluation and ask share to set it up from a work directory.

    setup = QaSetup(config, workdir, build_missing=False)   # corpus, index, models, batcher
    params, meta = setup.best_params()                      # the model kept in best/
    qa = setup.system(params)                               # an OpenQa
    qa.answer(["who wrote the origin of species"])
    # [{"question": ..., "answer": "Charles Darwin", "score": 17.3, "block_id": ...,
    #   "evidence": [{"block_id", "title", "retrieval_score", "span", "context"}, ...]}]

The answer is the best span over the read blocks, scored as in fine-tuning: span score + the
block's retriever logit (score_scale * <q, z>). Its text is cut from the block's own text with the
tokenizer's character offsets, so it keeps the original spelling, accents and punctuation.
Retrieval can also come from elsewhere (`OpenQa.read` of given rows): the BM25 baseline reads
BM25's blocks with the same reader, each block scored with the same retriever logit.
EM and recall@k of a system: realm_jax/eval/open_qa.py.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np

from realm_jax.checkpoints import overlay, resolve
from realm_jax.checkpoints.export import pretraining_exports
from realm_jax.data import mixture
from realm_jax.data.qa_batches import QaBatcher, ReaderLayout
from realm_jax.io_utils import as_path, read_json
from realm_jax.models import RealmReader
from realm_jax.models.open_qa import QaModels, qa_params, qa_predict_step
from realm_jax.retrieval import build
from realm_jax.retrieval.index_store import latest_index_dir
from realm_jax.retrieval.towers import load_towers
from realm_jax.checkpoints import training as checkpoints

BEST = "best"  # the work directory's folder of the kept (best dev EM) fine-tuned model
CONTEXT_CHARS = 120


# ------------------------------------------------------------------------------------ questions
def split_questions(config) -> dict[str, list[dict]]:
  """{"train", "dev", "test"} questions of config.data, one dataset or a mixture, each question
  with its "dataset" (realm_jax/data/mixture.py): a dataset's splits pooled, then split by a hash
  of the normalised question (test first, then dev out of the rest)."""
  return mixture.split_questions(config.data)


# --------------------------------------------------------------------------------------- models
def apply_init(config):
  """Sets config.retrieval.weights and config.reader_weights from config.init, a pre-training work
  directory (its `export/retriever` and `export/encoder`), in place; returns config. Refuses a
  directory without both exports, and weights given beside it that are not its own."""
  init = config.get("init", "")
  if not init:
    return config
  exports = pretraining_exports(init)
  for name, path in exports.items():
    if not as_path(os.path.join(path, "config.json")).exists():
      raise FileNotFoundError(
          f"--config.init={init} has no exported {name} ({path}/config.json): pre-training writes "
          "export/retriever and export/encoder when it ends. Finish it, or start it again with "
          f"its own --config and --workdir={init} to write a missing export.")
  given = {"retriever": ("--config.retrieval.weights", config.retrieval.weights),
           "encoder": ("--config.reader_weights", config.reader_weights)}
  for name, (flag, value) in given.items():
    if value not in ("minilm", exports[name]):
      raise ValueError(f"{flag}={value} and --config.init={init} (whose {name} is "
                       f"{exports[name]}) both name weights: pass one of them.")
  config.retrieval.weights, config.reader_weights = exports["retriever"], exports["encoder"]
  return config


def load_reader(config) -> tuple[RealmReader, dict, str]:
  """(reader module, its parameters, vocab file): the BERT from config.reader_weights, a new span
  scorer (unless the weights are a REALM reader, which brings its own)."""
  weights = resolve(config.reader_weights, flag="--config.reader_weights")
  found = weights.check_kind(
      ("reader", "encoder", "embedder", "bert"),
      "a REALM reader, a REALM knowledge-augmented encoder (e.g. a pre-training export) or a BERT")
  model_config = weights.config.replace(span_hidden_size=config.span_hidden_size,
                                        max_span_width=config.max_span_width)
  if config.reader_layers:
    if config.reader_layers > model_config.num_hidden_layers:
      raise ValueError(f"--config.reader_layers={config.reader_layers} is more than the "
                       f"{model_config.num_hidden_layers} layers of {weights.name}.")
    model_config = model_config.replace(num_hidden_layers=config.reader_layers)
  kind = "reader" if found == "reader" else "bert"
  params, _ = weights.load(kind)
  loaded = params if kind == "reader" else {"realm": params}
  reader = RealmReader(model_config)
  ids = np.zeros((1, 1, 16), np.int32)
  init = jax.jit(lambda r: reader.init(r, ids, ids, ids, ids, np.zeros((1, 1), np.float32)))
  params = overlay(init(jax.random.key(config.seed))["params"], loaded,
                   f"reader weights {weights.name}")
  return reader, params, weights.vocab()


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
  or updated if the corpus changed (else, with build_missing=False, a FileNotFoundError that says
  how to build it). `towers`:
  already loaded `build.towers_of(config.retrieval, "--config.retrieval")`."""
  if not build_missing:
    check_index(workdir)
  towers = towers or build.towers_of(config.retrieval, "--config.retrieval")
  if build_missing:  # also brings an index whose corpus changed up to date (only new blocks)
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
    """`towers` / `reader`: already loaded `build.towers_of(config.retrieval, ...)` /
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

  def retriever_system(self, name: str, weights: str, reader_params: dict) -> OpenQa:
    """The system whose question tower and index come from other retriever weights (an ICT or
    DPR export, or anything build_index.py takes as --config.weights), over this corpus, read by
    `reader_params`. Its index is built once, in <workdir>/retrievers/<name>, from the corpus of
    this work directory. Pooling follows the weights (a scorer without a [CLS] projection is
    mean-pooled); a normalised tower's scores get config.score_scale, another's 1."""
    config = ml_collections.ConfigDict(self.config.retrieval.to_dict())
    config.update(weights=weights, pooling="auto", normalize="auto", num_layers=0)
    towers = load_towers(weights, dtype=config.dtype, flag=f"--retrievers={name}")
    query = towers["query"]
    if query.module is None:
      raise ValueError(f"--retrievers={name}={weights}: the weights give no question tower.")
    if (open(query.tokenizer.vocab_file, encoding="utf-8").read()
        != open(self.tokenizer.vocab_file, encoding="utf-8").read()):
      raise ValueError(f"--retrievers={name}={weights}: its vocabulary {query.tokenizer.vocab_file} "
                       f"differs from the reader's {self.tokenizer.vocab_file}; the reader reads "
                       "the blocks as its own word pieces: use a retriever of the same vocabulary.")
    _, index, _ = build.build_index(config, os.path.join(self.workdir, "retrievers", name), towers,
                                    corpus_root=self.workdir)
    scale = float(self.config.score_scale) if query.module.normalize else 1.0
    models = QaModels(query.module, self.models.reader, scale)
    return OpenQa(self.batcher, models, {"query_tower": query.params, "reader": reader_params},
                  index, table_by_row(self.corpus, index), reader_blocks=self.config.reader_blocks,
                  batch_size=self.config.eval_batch_size)

  def best_params(self, workdir: str | None = None) -> tuple[dict, dict]:
    """(parameters, meta) of the best checkpoint in `workdir/best` (default: this setup's);
    another run's must have this setup's shapes (finetune.check_comparable_run says so first).
    FileNotFoundError if none, ValueError if it is damaged (an older one that reads is used
    instead, with a warning; nothing is moved: this only reads)."""
    workdir = workdir or self.workdir
    manager = checkpoints.checkpoint_manager(os.path.join(workdir, BEST), keep=1,
                                             asynchronous=False, data=False)
    got = checkpoints.restore_latest(manager, self.init_params, set_aside=False, hint=(
        f"Restore {manager.directory} from a backup, or fine-tune again with another --workdir."))
    if got is None:
      raise FileNotFoundError(
          f"{workdir}/{BEST} holds no fine-tuned model: run experiments/finetune.py "
          f"--workdir={workdir} first.")
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


# --------------------------------------------------------------------------------------- answer
class OpenQa:
  """A trained open-QA system (see the module docstring).

  Args:
    batcher: builds question and reader inputs from the corpus.
    models: question tower, reader and score scale.
    params: {"query_tower", "reader"}.
    index: `DocIndex` over the frozen document embeddings.
    table: [N, D] the same embeddings by corpus row (the read blocks' retriever logits).
    reader_blocks: blocks read per question.
    batch_size: questions per device call (a fixed shape: one compile).
  """

  def __init__(self, batcher: QaBatcher, models: QaModels, params: dict, index, table: np.ndarray,
               reader_blocks: int = 5, batch_size: int = 16):
    self.batcher, self.models, self.index, self.table = batcher, models, index, table
    self.corpus = batcher.corpus
    self.params = params
    self.reader_blocks, self.batch_size = reader_blocks, batch_size
    self._embed, self._predict = _compiled(models)
    self._offset_cache: dict[int, tuple] = {}

  # ------------------------------------------------------------------------------ retrieve
  def embed(self, texts: Sequence[str]) -> np.ndarray:
    """[B, D] question embeddings of the current question tower."""
    return np.asarray(self._embed(self.params["query_tower"], self.batcher.questions(texts)))

  def retrieve(self, texts: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
    """(retriever logits [B, k], corpus rows [B, k]) of the top k blocks, best first."""
    scores, ids = self.index.search(self.embed(texts), k)
    return self.models.score_scale * scores, self.corpus.rows_of(ids)

  # ---------------------------------------------------------------------------------- read
  def read(self, texts: Sequence[str], rows: np.ndarray) -> list[dict]:
    """The best answer of each question from its blocks rows [B, >= R] (first R read); a
    ValueError instead when a score is not finite (damaged index embeddings or weights)."""
    rows = np.asarray(rows)[:, :self.reader_blocks]
    out = []
    for lo in range(0, len(texts), self.batch_size):
      out += self._read_batch(list(texts[lo:lo + self.batch_size]), rows[lo:lo + self.batch_size])
    return out

  def _read_batch(self, texts: list[str], rows: np.ndarray) -> list[dict]:
    n, bs = len(texts), self.batch_size
    q_ids = [self.batcher.question_ids(t) for t in texts]
    if n < bs:  # pad to the fixed batch: one compiled program for any number of questions
      q_ids = q_ids + [q_ids[0]] * (bs - n)
      rows = np.concatenate([rows, np.full((bs - n, rows.shape[1]), -1, rows.dtype)])
    reader, layouts = self.batcher.reader_inputs(q_ids, rows)
    masks = {k: reader.pop(k) for k in ("block_mask", "word_start", "word_end")}
    batch = {"question": self.batcher._questions(q_ids), "reader": reader, **masks,
             "beam_mask": (rows >= 0).astype(np.int32),
             "beam_embeddings": self.table[np.maximum(rows, 0)].astype(np.float32)}
    got = jax.device_get(self._predict(self.params, batch))
    self._check_finite(texts, got)
    starts, ends = _span_table(reader["input_ids"].shape[-1], self.batcher.max_span_width)
    preds = []
    for i in range(n):
      best = int(got["best"][i])
      j, s = divmod(best, len(starts))
      evidence = []
      for jj, row in enumerate(rows[i]):
        if row < 0:
          continue
        blk = self.batcher.block(row)
        ev = {"block_id": int(self.corpus.block_ids[row]), "title": blk["title"],
              "retrieval_score": float(got["retriever_logits"][i, jj])}
        k = int(got["block_best"][i, jj])
        text, where, (a, b) = self._span_text(row, layouts[i][jj], int(starts[k]), int(ends[k]))
        ev.update(best_span=text, best_span_score=float(got["block_score"][i, jj]),
                  span={"field": where, "start": a, "end": b},
                  context=_context(blk[where] if where else "", a, b))
        evidence.append(ev)
      answer = ""
      if rows[i, j] >= 0 and layouts[i][j] is not None:
        answer = self._span_text(rows[i, j], layouts[i][j], int(starts[s]), int(ends[s]))[0]
      preds.append({"question": texts[i], "answer": answer, "score": float(got["best_score"][i]),
                    "block_id": int(self.corpus.block_ids[rows[i, j]]) if rows[i, j] >= 0 else -1,
                    "block_rank": j, "evidence": evidence})
    return preds

  def _check_finite(self, texts: list[str], got: dict) -> None:
    """ValueError unless every score of the questions `texts` is finite. A NaN or infinite score
    comes from damaged index embeddings or weights, and the span it picks means nothing."""
    n = len(texts)
    retrieval = np.isfinite(got["retriever_logits"][:n]).all(axis=1)
    reading = np.isfinite(got["block_score"][:n]).all(axis=1) & np.isfinite(got["best_score"][:n])
    if (retrieval & reading).all():
      return
    i = int(np.argmin(retrieval & reading))
    if not retrieval[i]:
      index = f"index {self.index.directory}" if self.index.directory else "index"
      raise ValueError(
          f"No answer to {texts[i]!r}: the retrieval scores of its blocks are not finite (NaN or "
          f"infinite). The {index} holds damaged embeddings, or the question tower's weights are "
          "damaged: rebuild the index (experiments/build_index.py); if that does not help, "
          "restore a good checkpoint or fine-tune again.")
    raise ValueError(f"No answer to {texts[i]!r}: the reader's span scores are not finite (NaN or "
                     "infinite), so the reader's weights are damaged: restore a good checkpoint "
                     "or fine-tune again.")

  def _span_text(self, row: int, lay: ReaderLayout, start: int, end: int):
    """(text, "title" | "body", (char start, char end)) of reader positions [start, end]."""
    blk = self.batcher.block(row)
    title_off, body_off = self._offsets(row)
    parts = []
    for field, offsets, first, count in (("title", title_off, lay.title_start, lay.n_title),
                                         ("body", body_off, lay.body_start, lay.n_body)):
      lo, hi = max(start, first), min(end, first + count - 1)
      if lo <= hi and hi - first < len(offsets):
        a, b = offsets[lo - first][0], offsets[hi - first][1]
        parts.append((field, a, b))
    if not parts:
      return "", None, (0, 0)
    text = " ".join(blk[f][a:b] for f, a, b in parts)
    field, a, b = parts[-1] if len(parts) == 1 else parts[0]
    return text, field, (int(a), int(b))

  def _offsets(self, row: int):
    """Character offsets of the title's and the body's word pieces (cached per block)."""
    if row not in self._offset_cache:
      blk = self.batcher.block(row)
      (t_ids, t_off), (b_ids, b_off) = self.batcher.tokenizer.encode_batch_with_offsets(
          [blk["title"], blk["body"]])
      if list(t_ids) != blk["title_ids"] or list(b_ids) != blk["body_ids"]:
        logging.warning("Block row %d: re-tokenised text differs from the stored word pieces; "
                        "answer text may be cut imprecisely.", row)
      if len(self._offset_cache) > 65_536:
        self._offset_cache.clear()
      self._offset_cache[row] = (t_off, b_off)
    return self._offset_cache[row]

  def answer(self, texts: Sequence[str]) -> list[dict]:
    """Retrieve, then read: the best answer of each question with its evidence."""
    return self.read(texts, self.retrieve(texts, self.reader_blocks)[1])


@functools.lru_cache(maxsize=8)
def _compiled(models: QaModels):
  """(embed, predict) jitted once per set of models: systems that differ only in their
  parameters (evaluation of a baseline, each dev evaluation) share the compiled programs."""
  embed = jax.jit(lambda p, q: models.query_tower.apply(
      {"params": p}, q["input_ids"], q["attention_mask"], q["token_type_ids"]))
  return embed, jax.jit(functools.partial(qa_predict_step, models=models))


@functools.lru_cache(maxsize=64)
def _span_table(length: int, max_width: int):
  from realm_jax.models.reader import span_candidates
  return span_candidates(length, max_width)


def _context(text: str, a: int, b: int) -> str:
  lo, hi = max(0, a - CONTEXT_CHARS), min(len(text), b + CONTEXT_CHARS)
  return ("..." if lo > 0 else "") + text[lo:hi] + ("..." if hi < len(text) else "")
