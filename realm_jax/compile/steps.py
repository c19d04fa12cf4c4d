"""Each trainer's jitted programs with abstract arguments: the real step functions of the
trainers, their state from `jax.eval_shape` (no parameter is ever allocated) and batches of the
shapes their input pipelines give. What experiments/compile_for.py compiles for a TPU slice.

    programs = PROGRAMS["retro"](config, mesh)   # {"retro": Program, "baseline": Program}
    aot.lower(programs["retro"], mesh)            # jitted with shardings by role, lowered

A Program's arguments carry a role each, which a shardings function (aot.logical: the training
loop's layout) maps to a sharding: "state" (a TrainState: parameters and optimizer state), "batch" (split along
its first axis), "replicated" (the step's random key), "rows" (an index's rows, split along its
first axis). The mesh matters only to programs that name its axes (the index search).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import ml_collections
import numpy as np

from realm_jax import config_checks

ROLES = ("state", "batch", "replicated", "rows")


@dataclasses.dataclass(frozen=True)
class Program:
  """One jitted program of a trainer.

  fn: the function the trainer jits, taking `args` positionally.
  args: pytrees of jax.ShapeDtypeStruct (no shardings yet), one per argument.
  roles: each argument's role (ROLES); out_roles: each output's (one role: all of them).
  donate: the arguments the trainer donates.
  params, trained: the parameters in the state, and those the optimizer updates.
  estimate: estimate(devices, platform) -> the project's own memory estimate per device on
    `platform` ("cpu", "tpu"; train/memory.py), bytes by part, when there is one.
  calls: how many times a training step calls it.
  """
  fn: Callable
  args: tuple
  roles: tuple[str, ...]
  out_roles: tuple[str, ...]
  donate: tuple[int, ...] = ()
  params: int = 0
  trained: int = 0
  estimate: Callable[[int, str], dict] | None = None
  calls: int = 1


def stacked(example, batch_size: int):
  """ShapeDtypeStructs of a batch of `batch_size` examples shaped like `example` (a pytree)."""
  return jax.tree.map(
      lambda v: jax.ShapeDtypeStruct((batch_size, *np.shape(v)), np.asarray(v).dtype), example)


def count(tree, keep: Callable | None = None) -> int:
  """Elements of a pytree's leaves (those whose key path `keep` accepts)."""
  return sum(math.prod(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(tree)
             if keep is None or keep(path))


def abstract_rng(config):
  """The shape of the run's dropout key (its generator: config.rng_impl)."""
  from realm_jax.train.loop import dropout_key
  return jax.eval_shape(lambda: dropout_key(config))


# ------------------------------------------------------------------------------------- RETRO
@dataclasses.dataclass(frozen=True)
class DatabaseShape:
  """What a RETRO model takes from its chunk database, without building one: the tokenizer the
  database would be built with, and its chunking (train.lm_step.model_config reads these)."""
  tokenizer: Any
  chunk_length: int
  seq_chunks: int


def retro_database_shape(config) -> DatabaseShape:
  """The tokenizer config.db builds its database with (as chunk_db.build_database chooses it:
  config.db.tokenizer_file, else the key weights' WordPiece vocabulary) and its chunking."""
  from realm_jax.checkpoints.weights import resolve
  from realm_jax.text.lm_tokenizer import load_lm_tokenizer
  db = config.db
  vocab = "" if db.tokenizer_file else resolve(db.key_weights,
                                               flag="--config.db.key_weights").vocab()
  tokenizer = load_lm_tokenizer(db.tokenizer_file, vocab, "--config.db.tokenizer_file")
  return DatabaseShape(tokenizer, db.chunk_length, db.seq_chunks)


def retro_model_config(config, retrieval: bool = True):
  """The decoder's RetroConfig a RETRO run of `config` builds (lm_step.model_config), before its
  database exists: what memory estimates count."""
  from realm_jax.train import lm_step
  return lm_step.model_config(config, retro_database_shape(config), retrieval)


def retro_batch(config, batch_size: int) -> dict:
  """A global batch as retro_batches gives it, from the pipeline's own decoding of a record."""
  from realm_jax.data.chunks import record_layout
  from realm_jax.data.retro_batches import DecodeSequence
  db = config.db
  layout = record_layout(db.chunk_length, db.seq_chunks, db.num_neighbours)
  values = sum(math.prod(shape) for _, shape in layout["fields"])
  example = DecodeSequence(layout, config.model.num_neighbours, np.ones(1, np.float32))(
      bytes(4 * values))
  return stacked(example, batch_size)


def retro_programs(config) -> dict[str, Program]:
  """The training step of each of config.models ("retro", "baseline"): the RETRO decoder (a
  RETROfit's pre-trained decoder by its settings alone, config.init), AdamW as the trainer builds
  it, the batch of config.batch_size sequences with their neighbours."""
  from realm_jax.checkpoints import decoder
  from realm_jax.models.retro import RetroModel
  from realm_jax.train import lm_step, memory
  from realm_jax.train.realm_step import TrainState
  db = retro_database_shape(config)
  batch = retro_batch(config, config.batch_size)
  out = {}
  for name in config.models:
    retrieval = name == "retro"
    model_config = lm_step.model_config(config, db, retrieval)
    module = RetroModel(model_config)
    params = jax.eval_shape(
        functools.partial(lm_step.init_params, module, db.seq_chunks, retrieval),
        jax.random.key(0))
    _, tx = lm_step.optimizer(config, params)
    state = jax.eval_shape(lambda p: TrainState.create(apply_fn=None, params=p, tx=tx), params)
    step = functools.partial(lm_step.train_step, module=module, retrieval=retrieval,
                             freeze_decoder=config.freeze_decoder,
                             dropout=config.model.dropout > 0)
    trained = count(params, lambda path: not (
        config.freeze_decoder and decoder.is_decoder_param(path)))
    estimate = lambda devices, platform, m=model_config: memory.retro_estimate(
        config, devices, m, platform=platform)["parts"]
    out[name] = Program(step, (state, batch, abstract_rng(config)),
                        ("state", "batch", "replicated"), ("state", "replicated"), donate=(0,),
                        params=count(params),
                        trained=trained, estimate=estimate)
  return out


# ------------------------------------------------------------------------- REALM pre-training
def pretrain_batch(config, batch_size: int) -> dict:
  """A global step batch as the trainer gives it: the pipeline's masked queries laid out by the
  real CandidateBuilder (its shapes do not depend on what was retrieved: none here)."""
  from realm_jax.train.candidates import CandidateBuilder
  lq, m, k = config.query_length, config.max_masked, config.num_candidates
  ids = np.zeros((1, lq), np.int32)
  queries = {"input_ids": ids, "attention_mask": ids.copy(), "token_type_ids": ids,
             "mlm_positions": np.zeros((1, m), np.int32), "mlm_targets": np.zeros((1, m), np.int32),
             "mlm_weights": np.zeros((1, m), np.float32)}
  queries["attention_mask"][0, 0] = 1
  builder = CandidateBuilder(None, 0, 0, k, config.doc_length, config.joint_length,
                             null_document=config.null_document)
  example = builder.build(queries, np.full((1, k - 1), -1))
  return stacked(jax.tree.map(lambda x: x[0], example), batch_size)


def search_program(index_config, mesh, rows: int, dim: int, batch_size: int,
                   k: int) -> Program | None:
  """One call of a trainer's index search (`index_config`: a config's `index` section, "exact"
  or "approx" on the devices; None for a host searcher such as ScaNN): the global batch's
  `batch_size` query embeddings against `rows` rows of `dim` sharded over the mesh's "data"
  axis, one block excluded per query, top `k` (retrieval/exact.py, with ExactSearcher's
  defaults)."""
  from realm_jax.retrieval import exact
  from realm_jax.retrieval.index import index_options
  options = index_options(index_config)
  if options["searcher"] not in ("exact", "approx"):
    return None
  shards = mesh.shape["data"]
  qbs = exact.QUERY_BATCH_SIZE
  shard_rows, block_rows = exact.shard_layout(
      rows, shards, max(8, exact.MAX_SCORE_BYTES // (4 * qbs)))
  search = exact.sharded_search(
      rows, mesh, block_rows,
      recall_target=exact.RECALL_TARGET if options["searcher"] == "approx" else None)
  held = exact.BITS.get(np.dtype(options["dtype"]), np.dtype(options["dtype"]))
  q = exact.query_batch(batch_size, qbs)
  args = (jax.ShapeDtypeStruct((shards * shard_rows, dim), held),
          jax.ShapeDtypeStruct((q, dim), np.float32), jax.ShapeDtypeStruct((q, 1), np.int32))
  return Program(lambda emb, queries, exclude: search(emb, queries, exclude, k), args,
                 ("rows", "replicated", "replicated"), ("replicated",),
                 calls=-(-batch_size // q))


def pretrain_programs(config, mesh, index_rows: int = 0) -> dict[str, Program]:
  """REALM pre-training's device programs: `train_step` (re-embeds the query and its K
  candidates with both towers, the knowledge-augmented encoder, marginal MLM loss, AdamW),
  `embed_queries` (the query tower over the batch) and `search` (one call of the index search
  over `index_rows` rows, default: the corpus's when known before it is built, Wikipedia's
  13.35M blocks). The models have config.model's sizes (init=hf weights not made yet: the
  paper's BERT-base) or the weights'; the query tower's [MASK] id (config.query_hides_mask) is
  left at -1, on which no shape or cost depends."""
  from realm_jax.train import loop, memory, optimizer
  from realm_jax.train.init import make_models, param_shapes
  from realm_jax.train.realm_step import TrainState, train_step
  mc = memory.model_config(config)
  models = make_models(config, mc)
  params = param_shapes(models, mc)
  _, tx = optimizer.from_config(config)
  state = jax.eval_shape(lambda p: TrainState.create(apply_fn=None, params=p, tx=tx), params)
  devices = mesh.devices.size
  pieces = loop.microbatch_pieces(config, "microbatch", devices)
  step = functools.partial(train_step, models=models, dropout=config.dropout, pieces=pieces)
  batch = pretrain_batch(config, config.batch_size)
  frozen = config.get("retriever_learning_rate", -1.0) == 0
  rows = index_rows or memory.index_rows_for(config)
  estimate = lambda d, platform: memory.estimate(config, d, rows, mc, platform=platform)["parts"]
  embed = lambda p, q: models.retriever.apply(
      {"params": p}, q["input_ids"], q["attention_mask"], q["token_type_ids"],
      method="embed_queries")
  dim = jax.eval_shape(embed, params["retriever"], batch["query"]).shape[-1]
  search = search_program(config.index, mesh, rows, dim, config.batch_size,
                          config.num_candidates - 1)  # (the query's own block excluded)
  return {
      "train_step": Program(step, (state, batch, abstract_rng(config)),
                            ("state", "batch", "replicated"), ("state", "replicated"),
                            donate=(0,), params=count(params),
                            trained=count(params, lambda path: not (
                                frozen and path[0].key == "retriever")),
                            estimate=estimate),
      "embed_queries": Program(embed, (params["retriever"], batch["query"]),
                               ("state", "batch"), ("replicated",),
                               params=count(params["retriever"])),
      **({"search": search} if search else {}),
  }


# ------------------------------------------------------------------------ open-QA fine-tuning
class _OneBlock:
  """A corpus of one block whose body fills any reader input: what the fine-tuning batcher
  needs to lay out a batch of the longest shapes it gives."""

  def __init__(self, tokenizer, length: int):
    word = tokenizer.encode("block")
    self.block = {"title": "title", "body": " ".join(["block"] * length),
                  "title_token_ids": tokenizer.encode("title"), "token_ids": word * length}

  def __len__(self) -> int:
    return 1

  def __getitem__(self, row: int) -> dict:
    return self.block


def finetune_batch(config, tokenizer, dim: int, batch_size: int) -> dict:
  """A global step batch as the fine-tuning trainer gives it, at the longest shapes its batcher
  makes (a question of config.question_length word pieces, blocks filling
  config.reader_length): the real QaBatcher's `train_batch` over a corpus of one long block."""
  from realm_jax.data.qa_batches import QaBatcher
  batcher = QaBatcher(_OneBlock(tokenizer, config.reader_length), tokenizer,
                      question_length=config.question_length,
                      reader_length=config.reader_length,
                      max_answer_spans=config.max_answer_spans,
                      max_span_width=config.max_span_width,
                      reader_title=config.get("reader_title", True))
  question = {"question": " ".join(["question"] * config.question_length), "answers": ["block"]}
  example = batcher.train_batch([question], np.zeros((1, config.beam), np.int64),
                                np.zeros((1, dim), np.float32), config.reader_blocks)
  return stacked(jax.tree.map(lambda x: x[0], example), batch_size)


def finetune_programs(config, mesh, index_rows: int = 0) -> dict[str, Program]:
  """Open-QA fine-tuning's device programs: `train_step` (the question tower over the batch's
  questions, the retriever's marginal loss over the beam's frozen embeddings, the reader over
  the beam's first reader_blocks blocks, AdamW on the question tower and the reader) and
  `embed_questions` (the question tower, which retrieves each step's beams) and, when the index's
  size is known (`index_rows`, or Wikipedia's 13.35M blocks for a tfds_wikipedia corpus),
  `search` (one call of the search for the beams over the frozen index). The models are the
  config's weights (read, as the trainer reads them; config.init's exports when given)."""
  from realm_jax.models.open_qa import QaModels, qa_params
  from realm_jax.retrieval import build
  from realm_jax.systems.open_qa import apply_init, load_reader
  from realm_jax.train import loop, memory
  from realm_jax.train.qa_step import TrainState, qa_optimizer, qa_train_step
  config = apply_init(ml_collections.ConfigDict(config.to_dict()))
  query = build.towers_of(config.retrieval, "--config.retrieval")["query"]
  if query.module is None:
    raise ValueError("--config.retrieval.weights: the weights give no trainable question tower.")
  reader, reader_params, _ = load_reader(config)
  params = jax.eval_shape(qa_params, {"embedder": query.params}, reader_params)
  _, tx = qa_optimizer(config)
  state = jax.eval_shape(lambda p: TrainState.create(apply_fn=None, params=p, tx=tx), params)
  models = QaModels(query.module, reader, float(config.score_scale))
  embed = lambda p, q: query.module.apply({"params": p}, q["input_ids"], q["attention_mask"],
                                          q["token_type_ids"])
  ids = jax.ShapeDtypeStruct((1, config.question_length), np.int32)
  dim = jax.eval_shape(embed, params["query_tower"], dict.fromkeys(
      ("input_ids", "attention_mask", "token_type_ids"), ids)).shape[-1]
  batch = finetune_batch(config, query.tokenizer, dim, config.batch_size)
  pieces = loop.microbatch_pieces(config, "reader_microbatch", mesh.devices.size)
  step = functools.partial(qa_train_step, models=models, dropout=config.dropout, pieces=pieces)
  try:
    rows = index_rows or memory.index_rows_for(config.retrieval)
  except ValueError:  # a corpus not built yet: its size is not known
    rows = 0
  search = (search_program(config.retrieval.index, mesh, rows, dim, config.batch_size,
                           config.beam) if rows else None)
  return {
      "train_step": Program(step, (state, batch, abstract_rng(config)),
                            ("state", "batch", "replicated"), ("state", "replicated"),
                            donate=(0,), params=count(params), trained=count(params)),
      "embed_questions": Program(embed, (params["query_tower"], batch["question"]),
                                 ("state", "batch"), ("replicated",),
                                 params=count(params["query_tower"])),
      **({"search": search} if search else {}),
  }


# ------------------------------------------------------------------------------ ICT and DPR
def retriever_programs(config, kind: str) -> dict[str, Program]:
  """ICT's or DPR's `train_step` (train/retriever_step.py, `kind` "ict" or "dpr"): both towers
  over the batch, the in-batch softmax over the global batch (every query against every
  document, or passage, of every device), AdamW. The towers have the shapes of config.init's
  weights (`random`: config.model's, no weights read); the batch, the pairs the trainer's
  pipeline gives at the config's lengths."""
  from realm_jax.train import optimizer, retriever_step, two_towers
  from realm_jax.train.realm_step import TrainState
  model, _, _ = two_towers.build_retriever(config)
  keys = ("input_ids", "attention_mask", "token_type_ids")
  query = dict.fromkeys(keys, jax.ShapeDtypeStruct((1, 8), np.int32))
  candidates = dict.fromkeys(keys, jax.ShapeDtypeStruct((1, 1, 8), np.int32))
  params = jax.eval_shape(lambda r, q, c: model.init(r, q, c)["params"], jax.random.key(0),
                          query, candidates)
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float32), params)
  _, tx = optimizer.from_config(config)
  state = jax.eval_shape(lambda p: TrainState.create(apply_fn=None, params=p, tx=tx), params)
  inputs = lambda length: stacked(dict.fromkeys(keys, np.zeros(length, np.int32)),
                                  config.batch_size)
  scale = float(config.get("score_scale", 1.0))
  if kind == "ict":
    batch = {"query": inputs(config.query_length), "document": inputs(config.doc_length)}
    step = functools.partial(retriever_step.ict_step, model=model, dropout=config.dropout,
                             score_scale=scale)
  else:
    passage = retriever_step.passage_length(config)
    batch = {"question": inputs(config.question_length), "positive": inputs(passage),
             "hard_negative": inputs(passage)}
    step = functools.partial(retriever_step.dpr_step, model=model, score_scale=scale,
                             dropout=config.dropout)
  return {"train_step": Program(step, (state, batch, abstract_rng(config)),
                                ("state", "batch", "replicated"), ("state", "replicated"),
                                donate=(0,), params=count(params), trained=count(params))}


def trainer_of(config, flag: str = "--config") -> str:
  """The trainer whose programs a config's run compiles: "retro", "pretrain", "finetune", "ict"
  or "dpr" (config_checks.config_kind)."""
  kind = config_checks.config_kind(config)
  if kind is None:
    raise ValueError(f"{flag}: compile_for compiles the steps of RETRO "
                     "(realm_jax/configs/retro.py), pre-training (pretrain.py), fine-tuning "
                     "(finetune.py), ICT (ict.py) and DPR (dpr.py) configs; give one of "
                     "those.")
  return kind


# The trainers compile_for knows: their programs for a config on a mesh, and the settings their
# model FLOPs are counted without: layer recomputation and dropout (`counted_config`).
PROGRAMS = {"retro": lambda config, mesh, index_rows=0: retro_programs(config),
            "pretrain": pretrain_programs, "finetune": finetune_programs,
            "ict": lambda config, mesh, index_rows=0: retriever_programs(config, "ict"),
            "dpr": lambda config, mesh, index_rows=0: retriever_programs(config, "dpr")}
UNCOUNTED = {"retro": {"model.remat": False, "model.dropout": 0.0},
             "pretrain": {"remat": False, "dropout": False},
             "finetune": {"dropout": False}, "ict": {"dropout": False}, "dpr": {"dropout": False}}


def counted_config(config, trainer: str):
  """A copy of `config` whose step does what the model's arithmetic needs and nothing else,
  countable on the CPU: it recomputes no layer, draws no dropout bits (on one device their
  generator runs in a loop, whose body XLA's count sees once; the masks themselves cost next to
  nothing) and attends densely (a fused TPU attention kernel is not countable; the full [L, L]
  scores are counted, as MFU conventionally does, though a causal kernel skips half)."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.update_from_flattened_dict(UNCOUNTED[trainer])
  if "attention" in config.get("model", {}):
    config.model.attention = "dense"
  return config
