"""ICT warm start (Inverse Cloze Task, ORQA): `train_and_evaluate(config, workdir)`.

    corpus blocks -> (sentence, block without that sentence) pairs, sampled afresh each epoch
      -> jitted step: query tower on sentences [B, D], document tower on blocks [B, D]
         -> logits [B, B] over the GLOBAL batch (each query against every block of every device)
         -> softmax cross-entropy with the diagonal as labels, AdamW
      -> metrics, TensorBoard, held-out evaluation, orbax checkpoints (state + data iterator)
      -> `workdir/export/`: a HF REALM scorer directory (config.json, model.safetensors with
         `embedder` and `query_embedder`, vocab.txt) that build_index.py and pre-training
         (`init='hf'`, `retriever_weights=<export>`) read.

The query is a random sentence of a block; 90% of the time (`remove_prob`) it is cut out of the
block, so the retriever must learn more than word overlap. Blocks of one sentence are skipped.
Started again on the same workdir, a run resumes from its newest checkpoint by itself.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import grain
import jax
import numpy as np

from realm_jax import config_checks
from realm_jax.data.blocks import BLOCKINGS
from realm_jax.data.corpus import Corpus, CorpusConfig
from realm_jax.data.pretrain import default_read_options, is_heldout
from realm_jax.data.sources import SOURCES
from realm_jax.io_utils import as_path
from realm_jax.models.config import COMPUTE_DTYPES
from realm_jax.retrieval.build import open_corpus
from realm_jax.text import BertTokenizer, join_bert
from realm_jax.train import loop, optimizer
from realm_jax.train.retriever_step import ict_eval_step, ict_step
# The towers, their starting weights, the in-batch loss and the export (shared with DPR; the
# export stays importable from here too).
from realm_jax.train.two_towers import (INITS, RetrieverTrainer, build_retriever,  # noqa: F401
                                        export_retriever, init_params)

SPLITS = ("train", "heldout")
# Settings a resumed run must keep: the shapes of parameters and what the examples are made of.
FIXED_SETTINGS = ("init", "model", "num_layers", "pooling", "corpus", "query_length",
                  "heldout_percent")

# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def block_sentences(block: dict) -> list[np.ndarray]:
  """The non-empty sentences of a corpus block, as word-piece id arrays, in order."""
  ids = np.asarray(block["token_ids"], np.int32)
  bounds = [int(s) for s in block["sentence_starts"]] + [len(ids)]
  return [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


@dataclasses.dataclass(frozen=True)
class ICTExamples:
  """grain random map: corpus row -> ICT pair, or None (block of one sentence, or other split).

  The pair: `query` = `[CLS] sentence [SEP]` ([Lq]), `document` = `[CLS] title [SEP] body [SEP]`
  ([Ld], `[CLS] [SEP] body [SEP]` without a title, as the index embeds it) whose body lacks that
  sentence with probability `remove_prob`; both as {input_ids, attention_mask, token_type_ids}
  int32. The sentence and the removal are drawn from `rng`, grain's per-element generator, so a
  seed fixes every example.
  """
  corpus: Corpus
  split: str
  heldout_percent: float
  query_length: int
  doc_length: int
  remove_prob: float
  cls_id: int
  sep_id: int
  pad_id: int

  def __call__(self, row: int, rng: np.random.Generator) -> dict | None:
    if is_heldout(int(self.corpus.block_ids[row]), self.heldout_percent) != (
        self.split == "heldout"):
      return None
    block = self.corpus[row]
    sentences = block_sentences(block)
    if len(sentences) < 2:
      return None
    pick = int(rng.integers(len(sentences)))
    removed = bool(rng.random() < self.remove_prob)
    query = [int(t) for t in sentences[pick][:self.query_length - 2]]
    body = [int(t) for i, s in enumerate(sentences) if not (removed and i == pick) for t in s]
    # The layout the index and pre-training give the document tower (Corpus.model_inputs,
    # CandidateBuilder): `[CLS] [SEP] body [SEP]` without a title, the body cut first, the title
    # only when it alone overflows.
    title = [int(t) for t in block["title_token_ids"]][:self.doc_length - 3]
    return {"query": join_bert(query, None, self.query_length, self.cls_id, self.sep_id,
                               self.pad_id),
            "document": join_bert(title, body, self.doc_length, self.cls_id, self.sep_id,
                                  self.pad_id, truncate="b"),
            "block_row": np.int64(row),
            "removed": np.int32(removed)}


def check_settings(*, seed: int, query_length: int, doc_length: int, remove_prob: float,
                   heldout_percent: float) -> None:
  """Raises ValueError naming the setting that `ict_batches` cannot use."""
  if not 0 <= remove_prob <= 1 or query_length < 3 or doc_length < 4:
    raise ValueError(f"remove_prob={remove_prob} (0..1), query_length={query_length} (>= 3) or "
                     f"doc_length={doc_length} (>= 4) is out of range.")
  if not 0 <= heldout_percent <= 100:
    raise ValueError(f"heldout_percent={heldout_percent} must be between 0 and 100.")
  if not 0 <= seed < 2**32:
    raise ValueError(f"seed={seed} must be in [0, 2**32).")


def ict_batches(corpus: Corpus, split: str, *, batch_size: int, seed: int, query_length: int,
                doc_length: int, remove_prob: float, tokenizer: BertTokenizer,
                heldout_percent: float = 0, shard_index: int = 0, shard_count: int = 1,
                num_epochs: int | None = None, read_options=None):
  """A checkpointable iterator of ICT batches of one split (this host's shard of the rows).

  Args:
    corpus: blocks with `title_token_ids`, `token_ids`, `sentence_starts` (realm_jax Corpus).
    split: "train" or "heldout" (a block is held out when its id hashes into `heldout_percent`
      percent, as in pre-training).
    batch_size: pairs per batch (per host); the last partial batch is dropped.
    seed: shuffling (new order each epoch), sentence choice and removal; same seed, same batches.
    query_length, doc_length: word pieces of `[CLS] sentence [SEP]` / `[CLS] title [SEP] body [SEP]`.
    remove_prob: probability that the query sentence is cut out of its block (ORQA: 0.9).
    shard_index, shard_count: this host takes rows shard_index, shard_index + shard_count, ...
    num_epochs: None repeats forever.
    read_options: grain.ReadOptions (default: 2 threads, 8 batches prefetched).
  Returns:
    grain DatasetIterator of {"query": {input_ids, attention_mask, token_type_ids} [B, Lq],
    "document": the same [B, Ld], "block_row" [B] int64, "removed" [B] int32}.
    `get_state()` is JSON-serialisable; `set_state` on a fresh iterator resumes exactly.
  Raises:
    ValueError for settings out of range, when no row of the shard is in `split`, or when its
    first rows in `split` hold no block of two or more sentences (either would never yield a
    batch).
  """
  if split not in SPLITS:
    raise ValueError(f"split={split!r}: use one of {SPLITS}.")
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index={shard_index} must be in [0, shard_count={shard_count}).")
  check_settings(seed=seed, query_length=query_length, doc_length=doc_length,
                 remove_prob=remove_prob, heldout_percent=heldout_percent)
  ds = grain.MapDataset.range(len(corpus))[shard_index::shard_count]
  if not 1 <= batch_size <= len(ds):
    raise ValueError(f"batch_size={batch_size} must be between 1 and the {len(ds)} blocks of shard "
                     f"{shard_index}/{shard_count} of the corpus in {corpus.data_dir}.")
  # Without one usable block in the split, an endless iterator would skip rows forever.
  probed, usable = 0, False  # blocks of the split looked at; one of two sentences among them
  for i in range(len(ds)):
    if is_heldout(int(corpus.block_ids[ds[i]]), heldout_percent) != (split == "heldout"):
      continue
    probed += 1
    usable = len(block_sentences(corpus[ds[i]])) >= 2
    if usable or probed >= 2000:
      break
  if probed == 0:
    raise ValueError(
        f"No block of shard {shard_index}/{shard_count} of the corpus in {corpus.data_dir} is in "
        f"the {split} split with heldout_percent={heldout_percent}: set config.heldout_percent "
        f"{'below 100' if split == 'train' else 'above 0 (or config.eval_every=0)'}.")
  if not usable:
    raise ValueError(
        f"None of the first {probed} {split} blocks of the corpus in {corpus.data_dir} has two "
        "sentences: ICT takes a sentence out of a block. Build the corpus with "
        "blocking='sentences' and a larger block_length.")
  examples = ICTExamples(corpus, split, heldout_percent, query_length, doc_length, remove_prob,
                         tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id)
  pick_seed = int(np.random.SeedSequence([seed, 2]).generate_state(1)[0])
  ds = ds.shuffle(seed=seed).repeat(num_epochs).random_map(examples, seed=pick_seed)
  read_options = read_options or default_read_options()
  # None (skipped blocks) drops out when the map dataset becomes an iterable one.
  return iter(ds.to_iter_dataset(read_options).batch(batch_size, drop_remainder=True))


# ---------------------------------------------------------------------------------------------
# Training loop (the loss and step: realm_jax/train/retriever_step.py)
# ---------------------------------------------------------------------------------------------


class ICTTrainer(RetrieverTrainer):
  """An ICT run (realm_jax/train/loop.py): `run()` trains to config.num_steps, then exports."""

  name = "ICT"
  progress = {"loss": ("loss", ".3f"), "acc": ("accuracy", ".3f")}

  def __init__(self, config, workdir: str):
    super().__init__(config, workdir)
    self.export_dir = config.export_dir or os.path.join(workdir, "export")
    # Settings are checked before config.json is written: a config refused for a typo must not
    # become the workdir's, refusing the corrected one. (The corpus fingerprint reads its files.)
    self.model, self.model_config, self.vocab_file = build_retriever(config)
    _ = CorpusConfig.from_config(config.corpus, self.vocab_file).fingerprint
    check_settings(seed=config.seed, query_length=config.query_length, doc_length=config.doc_length,
                   remove_prob=config.remove_prob, heldout_percent=config.heldout_percent)
    as_path(workdir).mkdir(parents=True, exist_ok=True)
    loop.check_workdir_config(config, workdir, FIXED_SETTINGS)
    self.tokenizer = BertTokenizer(self.vocab_file)
    self.corpus = open_corpus(config, config.data_dir or os.path.join(workdir, "data"),
                              self.vocab_file)
    self.schedule, tx = optimizer.from_config(config)
    self.data_iterator = self._batches("train", config.seed)
    scale = float(config.get("score_scale", 1.0))
    self.eval_fn = self.jit_eval(functools.partial(ict_eval_step, model=self.model,
                                                   score_scale=scale))
    self.start(init_params(config, self.model, self.model_config, jax.random.key(config.seed)),
               tx, functools.partial(ict_step, model=self.model, dropout=config.dropout,
                                     score_scale=scale))

  def _batches(self, split: str, seed: int, num_epochs=None):
    c = self.config
    return ict_batches(
        self.corpus, split, batch_size=self.host_batch, seed=seed, query_length=c.query_length,
        doc_length=c.doc_length, remove_prob=c.remove_prob, tokenizer=self.tokenizer,
        heldout_percent=c.heldout_percent, shard_index=jax.process_index(),
        shard_count=jax.process_count(), num_epochs=num_epochs)

  def _pairs(self, host_batch: dict) -> dict:
    """Host-local numpy pairs -> global arrays split along the batch over every device."""
    return self.put({k: host_batch[k] for k in ("query", "document")})

  def next_batch(self) -> dict:
    return self._pairs(next(self.data_iterator))

  def evaluate(self) -> dict[str, float]:
    """Mean in-batch metrics (no dropout) over the first config.eval_batches held-out batches:
    the same pairs at every evaluation (fixed seed, remove_prob as in training)."""
    got = self.mean_in_batch_metrics(
        self._pairs(b) for b in self._batches("heldout", seed=0, num_epochs=1))
    if got is None:
      raise ValueError(
          f"The held-out blocks of {self.corpus.data_dir} do not fill one batch of "
          f"{self.host_batch}: raise config.heldout_percent, lower config.batch_size, or set "
          "--config.eval_every=0.")
    return got


def train_and_evaluate(config, workdir: str) -> dict[str, float]:
  """ICT to config.num_steps (resuming from `workdir`), then the export; returns the last
  held-out metrics."""
  check_run_settings(config, workdir)
  return loop.train(ICTTrainer, config, workdir)


def check_run_settings(config, workdir: str) -> None:
  """Refuses settings no run can use, naming the flag, before weights, corpus or compiling."""
  config_checks.workdir(workdir)
  config_checks.at_least(config, {
      **loop.LOOP_MINIMUMS, "batch_size": 2, "learning_rate": 0, "eval_batches": 1,
      "num_layers": 0, "corpus.block_length": 4, "corpus.max_docs": 0})
  config_checks.one_of(config, {"init": INITS, "dtype": COMPUTE_DTYPES,
                                "pooling": ("auto", "mean", "projected_cls"),
                                "corpus.source": SOURCES, "corpus.blocking": BLOCKINGS})
  config_checks.at_least(config, {"score_scale": 0})
