"""DPR: the in-batch loss over the global batch (8 devices = 1 device = numpy), the mined examples
(a positive holds an answer in what the passage tower reads, a hard negative nowhere, both the
best-ranked of their kind in BM25's list; an answer past the tower's cut makes no positive), batches
in which no question's positive or answer is among another's passages, and a tiny run end to end
whose export loads as mean-pooled towers, builds an index, serves evaluate.py's --retrievers
(recall = a brute-force recomputation) and restores."""

import functools
import json
import os
import shutil
import sys

import jax
import numpy as np
import pytest
import forked_runs
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import NQ_OPEN, ROOT, one_device_env, random_inputs
from realm_jax.models import RealmRetriever, tiny_config
from realm_jax.text.answers import normalize_answer
from realm_jax.train import dpr, retriever_step
from realm_jax.train.optimizer import bert_adamw
from realm_jax.train.realm_step import TrainState

KEYS = ("input_ids", "attention_mask", "token_type_ids")
SCALE = 20.0


def _inputs(rng, b, length, vocab):
  return {k: v.astype(np.int32) for k, v in zip(KEYS, random_inputs(rng, (b,), length, vocab))}


def _model_and_batch(b=16):
  config = tiny_config(num_hidden_layers=1)
  model = RealmRetriever(config, share_embedders=False, pooling="mean", normalize=True)
  rng = np.random.default_rng(0)
  batch = {"question": _inputs(rng, b, 8, config.vocab_size),
           "positive": _inputs(rng, b, 12, config.vocab_size),
           "hard_negative": _inputs(rng, b, 12, config.vocab_size)}
  params = jax.jit(model.init)(jax.random.key(0), batch["question"],
                               {k: v[:, None] for k, v in batch["positive"].items()})["params"]
  params = jax.tree.map(lambda p: np.asarray(p) + rng.normal(0, 0.2, p.shape).astype(np.float32),
                        params)
  return model, batch, params


def _numpy_loss(q, p):
  """Mean softmax cross-entropy of SCALE * q p^T [B, 2B], question i's label passage i."""
  logits = SCALE * q.astype(np.float64) @ p.astype(np.float64).T
  m = logits.max(-1, keepdims=True)
  lse = m[:, 0] + np.log(np.exp(logits - m).sum(-1))
  return float(np.mean(lse - logits[np.arange(len(q)), np.arange(len(q))]))


def test_in_batch_loss_on_8_devices_equals_one_device_and_numpy():
  model, batch, params = _model_and_batch()
  # The reference: embeddings one example at a time, the [B, 2B] softmax in numpy.
  embed = jax.jit(lambda p, x, method: model.apply({"params": p}, *(x[k] for k in KEYS),
                                                   method=method), static_argnums=2)
  one = lambda d, i: {k: v[i:i + 1] for k, v in d.items()}
  q = np.concatenate([embed(params, one(batch["question"], i), "embed_queries")
                      for i in range(16)])
  p = np.concatenate([embed(params, one(batch[s], i), "embed_documents")
                      for s in ("positive", "hard_negative") for i in range(16)])
  want = _numpy_loss(q, p)
  got = {}
  for n in (8, 1):
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    loss = jax.jit(lambda prm, b: retriever_step.dpr_loss(prm, b, model, SCALE),
                   in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))))
    got[n] = jax.device_get(loss(params, batch))
  assert got[8][0] == pytest.approx(want, rel=1e-4) and got[1][0] == pytest.approx(want, rel=1e-4)
  for key in ("loss", "accuracy", "mean_rank", "recall_at_5"):
    assert got[8][1][key] == pytest.approx(got[1][1][key], rel=1e-5, abs=1e-6), key
  # A loss of only the own device's passages would differ: the negatives are the global batch's.
  local = np.mean([_numpy_loss(q[i:i + 2], np.concatenate([p[i:i + 2], p[16 + i:18 + i]]))
                   for i in range(0, 16, 2)])
  assert abs(local - want) > 1e-3


@pytest.mark.slow
def test_sharded_step_equals_one_device():
  model, batch, params = _model_and_batch()
  tx = bert_adamw(1e-4, 10, 0)
  out = {}
  for n in (8, 1):
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    replicated, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    step = jax.jit(functools.partial(retriever_step.dpr_step, model=model, score_scale=SCALE,
                                     dropout=False),
                   in_shardings=(replicated, data, replicated),
                   out_shardings=(replicated, replicated), donate_argnums=0)
    state = jax.jit(lambda p: TrainState.create(apply_fn=None, params=p, tx=tx),
                    out_shardings=replicated)(params)
    losses = []
    for _ in range(2):
      state, metrics = step(state, batch, jax.random.key(0))
      losses.append(float(metrics["loss"]))
    out[n] = losses, jax.device_get(state.params)
  np.testing.assert_allclose(out[8][0], out[1][0], rtol=1e-5)
  assert out[8][0][1] < out[8][0][0]  # the step trains
  for a, b in zip(jax.tree.leaves(out[8][1]), jax.tree.leaves(out[1][1])):
    np.testing.assert_allclose(a, b, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# Mined examples, on the first 40 articles of the embedded corpus and NQ-Open's questions
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _normalized(text: str) -> str:  # (the blocks are looked at again and again)
  return normalize_answer(text)


def _contains(text: str, answers) -> bool:
  """An answer as whole normalised words in the text (the test's own check)."""
  hay = f" {_normalized(text)} "
  return any(_normalized(a) and f" {_normalized(a)} " in hay for a in answers)


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
  from realm_jax.checkpoints.weights import MINILM, resolve
  from realm_jax.configs.dpr import get_config
  from realm_jax.retrieval.build import open_corpus
  try:
    vocab = resolve(MINILM, flag="--config.init").vocab()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  root = str(tmp_path_factory.mktemp("dpr_corpus"))
  return root, open_corpus(get_config("tiny").retrieval, root, vocab)


def test_positives_hold_an_answer_and_hard_negatives_never_do(tiny_corpus):
  _, tiny_corpus = tiny_corpus
  from realm_jax.data.dpr import mine_examples
  from realm_jax.data.qa import load_qa_jsonl
  from realm_jax.retrieval.bm25 import BM25Index
  texts = [tiny_corpus[r]["title"] + " " + tiny_corpus[r]["body"] for r in range(len(tiny_corpus))]
  bm25 = BM25Index.build(texts)
  questions = load_qa_jsonl(os.path.join(NQ_OPEN, "NQ-open.dev.jsonl"))
  from realm_jax.text.answers import has_answer
  normalized = [normalize_answer(t) for t in texts]
  holds = lambda r, answers, kind: has_answer(texts[r], answers, normalized[r])
  examples, counts = mine_examples(questions, bm25, holds, holds, depth=20)
  assert len(examples) >= 30 and counts["examples"] == len(examples)
  assert counts["questions"] == len(questions) == (
      counts["examples"] + counts["no_positive"] + counts["no_negative"])
  assert counts["past_the_cut"] == 0  # the passage is the whole block here
  _, ranked = bm25.search([e["question"] for e in examples], 20)
  for e, rows in zip(examples, ranked):
    answers = e["answers"]
    assert _contains(texts[e["positive"]], answers), e
    assert not _contains(texts[e["hard_negative"]], answers), e
    rows = [int(r) for r in rows if r >= 0]
    # The best-ranked of each kind in BM25's list.
    assert e["positive"] == next(r for r in rows if _contains(texts[r], answers))
    assert e["hard_negative"] == next(r for r in rows if not _contains(texts[r], answers))
  # Every question with an answer somewhere in BM25's first 20 blocks became an example or
  # was counted as lacking a negative.
  _, all_ranked = bm25.search([q["question"] for q in questions], 20)
  with_answer = sum(any(_contains(texts[r], q["answer"]) for r in rows if r >= 0)
                    for q, rows in zip(questions, all_ranked))
  assert with_answer == counts["examples"] + counts["no_negative"]


def test_an_answer_past_the_towers_cut_makes_no_positive(tiny_corpus):
  """PassageAnswers judges positives on the title and body as far as the passage input of
  `passage_length` word pieces keeps them: an answer after the cut is in the block, not in the
  passage; mining passes such a block over for a positive and never takes it as a negative."""
  from realm_jax.checkpoints.weights import MINILM, resolve
  from realm_jax.data.dpr import PassageAnswers, mine_examples
  from realm_jax.text import BertTokenizer
  _, corpus = tiny_corpus
  tok = BertTokenizer(resolve(MINILM, flag="--config.init").vocab())
  answers = PassageAnswers(corpus, tok, passage_length=32, truncate="longest")
  # A long block, and a word of its body that first occurs well after the cut.
  row = next(r for r in range(len(corpus)) if len(corpus[r]["token_ids"]) > 200)
  passage = answers.passage_text(row)
  block = answers.block_text(row)
  assert block.startswith(corpus[row]["title"]) and len(passage) < len(block) / 4
  # What the tower reads, as word pieces, is the passage text's.
  inputs = corpus.model_inputs([row], 32, tok, "longest")
  kept = inputs["input_ids"][0][inputs["attention_mask"][0] == 1]
  title, body = passage[:len(corpus[row]["title"])], passage[len(corpus[row]["title"]) + 1:]
  assert [int(x) for x in kept] == [tok.cls_id, *tok.encode(title), tok.sep_id, *tok.encode(body),
                                    tok.sep_id]
  seen = normalize_answer(passage).split()
  late = next(w for w in normalize_answer(block).split()[len(seen) + 5:]
              if w not in seen and len(w) > 4)
  early = normalize_answer(passage).split()[-1]
  assert answers.in_block(row, [late], "text") and not answers.in_passage(row, [late], "text")
  assert answers.in_passage(row, [early], "text")
  assert answers.in_block(row, [f"\\b{late}\\b"], "regex")
  assert not answers.in_passage(row, [f"\\b{late}\\b"], "regex")

  other = next(r for r in range(len(corpus)) if late not in normalize_answer(answers.block_text(r))
               and early not in normalize_answer(answers.block_text(r)))

  class Ranked:  # BM25 stand-in: the given rows, best first
    def __init__(self, rows):
      self.rows = rows

    def __len__(self):
      return len(corpus)

    def search(self, texts, k, batch_size=None):
      return None, np.array([self.rows] * len(texts))

  question = [{"question": "q?", "answers": [late]}]
  got, counts = mine_examples(question, Ranked([row, other]), answers.in_passage, answers.in_block)
  assert got == [] and counts["no_positive"] == 1 and counts["past_the_cut"] == 1
  got, _ = mine_examples([{"question": "q?", "answers": [early]}], Ranked([row, other]),
                         answers.in_passage, answers.in_block)
  assert [(e["positive"], e["hard_negative"]) for e in got] == [(row, other)]


# Crafted examples: rows' texts, and (question's answers, positive row, hard negative row).
ROWS = ["Paris is the capital of France", "Berlin is the capital of Germany", "Rome in Italy",
        "Madrid and Spain", "Lisbon and Portugal", "a text about nothing", "Oslo and Norway",
        "Vienna and Austria", "Bern and Switzerland", "Dublin and Ireland", "Athens and Greece",
        "Warsaw and Poland", "Prague and Czechia", "Cairo and Egypt"]
CRAFTED = [(["Paris"], 0, 5), (["Berlin"], 1, 0),   # 1's hard negative holds 0's answer
           (["France"], 0, 2),                      # 0's positive block, and 1's hard negative
           (["Rome"], 2, 3), (["Madrid"], 3, 4),    # 3's hard negative is 4's positive
           (["Lisbon"], 4, 6), (["Oslo"], 6, 7), (["Vienna"], 7, 8), (["Bern"], 8, 9),
           (["Dublin"], 9, 10), (["Athens"], 10, 11), (["Warsaw"], 11, 12), (["Prague"], 12, 13),
           (["Cairo"], 13, 5)]


def _crafted():
  from realm_jax.text.answers import has_answer
  examples = [{"question": f"q{i}?", "answers": a, "answer_type": "text", "positive": p,
               "hard_negative": n} for i, (a, p, n) in enumerate(CRAFTED)]
  return examples, lambda row, answers, kind: has_answer(ROWS[row], answers)


def _bad_pairs(batch, examples):
  """(i, j) of a batch where question i's positive block is among j's passages, or one of j's
  passages holds i's answer: i would learn to avoid a passage that answers it."""
  bad = []
  for i in batch:
    for j in batch:
      passages = (examples[j]["positive"], examples[j]["hard_negative"])
      if i != j and (examples[i]["positive"] in passages
                     or any(_contains(ROWS[r], examples[i]["answers"]) for r in passages)):
        bad.append((i, j))
  return bad


def test_no_batch_puts_a_questions_positive_or_answer_among_anothers_negatives():
  from realm_jax.data.dpr import example_batches
  examples, in_block = _crafted()
  it = iter(example_batches(examples, 4, in_block, seed=0))
  batches = [next(it) for _ in range(60)]  # ~17 epochs
  assert all(len(b) == 4 and not _bad_pairs(b, examples) for b in batches)
  counts = np.bincount(np.concatenate(batches), minlength=len(examples))
  assert counts.min() > 0.6 * counts.mean()  # clashing examples wait, and still train
  # The same shuffled order cut into consecutive batches would have broken the rule.
  order = iter(example_batches(examples, 1, lambda *a: False, seed=0))
  flat = [next(order)[0] for _ in range(240)]
  assert any(_bad_pairs(flat[k:k + 4], examples) for k in range(0, 240, 4))

  # Deterministic by seed; the state (the order's and the waiting examples') resumes exactly.
  again = iter(example_batches(examples, 4, in_block, seed=0))
  assert [next(again) for _ in range(25)] == batches[:25]
  state = json.loads(json.dumps(again.get_state()))
  resumed = iter(example_batches(examples, 4, in_block, seed=0))
  resumed.set_state(state)
  assert [next(resumed) for _ in range(35)] == batches[25:]
  other = iter(example_batches(examples, 4, in_block, seed=1))
  assert [next(other) for _ in range(25)] != batches[:25]
  # One pass in order: the batches that fill; the examples left waiting are dropped.
  once = list(example_batches(examples, 4, in_block, seed=0, shuffle=False, num_epochs=1))
  assert once and all(not _bad_pairs(b, examples) for b in once)


def test_examples_that_all_clash_are_refused():
  from realm_jax.data.dpr import example_batches
  examples, in_block = _crafted()
  same = [dict(e, positive=0) for e in examples]  # one positive block for every question
  with pytest.raises(ValueError, match="clash too often to fill a batch of 2: none of the 14 fits "
                                       "beside the 1 taken"):
    next(iter(example_batches(same, 2, in_block, seed=0)))


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_corpus):
  from realm_jax.configs.dpr import get_config
  cfg = get_config("tiny")
  cfg.data.local_dir = NQ_OPEN
  cfg.data_dir = tiny_corpus[0]  # whose corpus/ holds the corpus: built once
  workdir = str(tmp_path_factory.mktemp("dpr_run"))
  trainer = dpr.DPRTrainer(cfg, workdir)
  trainer.run()
  return cfg, workdir, trainer


@pytest.mark.slow
def test_tiny_run_logs_exports_mean_pooled_towers_and_resumes(tiny_run, tiny_corpus, tmp_path):
  from realm_jax.retrieval.towers import load_towers
  from realm_jax.text import BertTokenizer
  cfg, workdir, trainer = tiny_run
  _, tiny_corpus = tiny_corpus
  logged = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert [m["step"] for m in logged if m["split"] == "dev"] == [0, 2, 4]
  assert {"loss", "accuracy", "mean_rank", "recall_at_5", "grad_norm",
          "examples_per_s", "learning_rate"} <= set(logged[1])
  mined = json.load(open(os.path.join(workdir, dpr.EXAMPLES)))
  assert mined["corpus"] == tiny_corpus.fingerprint and len(mined["train"]) >= 8

  trained = jax.device_get(trainer.state.params)
  towers = load_towers(os.path.join(workdir, "export"))
  assert towers["query"] is not towers["document"]
  assert towers["query"].module.pooling == "mean" and towers["query"].module.normalize
  batch = next(dpr.dpr_batches(mined["train"], tiny_corpus, BertTokenizer(trainer.vocab_file),
                               batch_size=8, seed=0, question_length=32, passage_length=64))
  for which, method, part in (("query", "embed_queries", "question"),
                              ("document", "embed_documents", "positive")):
    want = jax.jit(functools.partial(trainer.model.apply, method=method))(
        {"params": trained}, *(batch[part][k] for k in KEYS))
    np.testing.assert_allclose(towers[which].embed(batch[part]), want, atol=1e-5)

  # Pre-training's init=hf reads REALM's projected [CLS]: a mean-pooled scorer is refused (its
  # towers would otherwise get a random projection without a word).
  from realm_jax.checkpoints import save_hf_checkpoint
  from realm_jax.configs.pretrain import get_config as pretrain_config
  from realm_jax.train import init as pretrain_init
  save_hf_checkpoint(tmp_path / "bert", trainer.model_config, trained["embedder"]["realm"], "bert")
  pcfg = pretrain_config("tiny")
  pcfg.init, pcfg.share_embedders = "hf", False
  pcfg.retriever_weights, pcfg.encoder_weights = os.path.join(workdir, "export"), str(
      tmp_path / "bert")
  models, model_config, _ = pretrain_init.build_models(pcfg)
  with pytest.raises(ValueError, match="mean-pooled"):
    pretrain_init.init_params(pcfg, models, model_config, jax.random.key(0))

  # Resume: the last step's state and data position; another passage layout is refused.
  again = dpr.DPRTrainer(cfg, workdir)
  again.restore()
  assert int(again.state.step) == 4
  assert again.data_iterator.get_state() == trainer.data_iterator.get_state()
  other = cfg.copy_and_resolve_references()
  other.passage_length = 48
  with pytest.raises(ValueError, match="passage_length"):
    dpr.DPRTrainer(other, workdir)


@pytest.mark.slow
def test_evaluate_reads_a_dpr_export_with_its_own_index(tiny_run, tiny_qa_workdir, tmp_path):
  """evaluate.py --retrievers=dpr=<export>: recall@k equals a brute force over the corpus with
  the export's towers, computed here; the fine-tuned reader reads its blocks."""
  from realm_jax.data.qa_batches import answers_of
  from realm_jax.retrieval.towers import load_towers
  from realm_jax.systems import open_qa
  _, dpr_work, _ = tiny_run
  export = os.path.join(dpr_work, "export")
  workdir = str(tmp_path / "qa")
  shutil.copytree(tiny_qa_workdir, workdir)
  got = forked_runs.run([sys.executable, os.path.join(ROOT, "experiments", "evaluate.py"),
                        f"--workdir={workdir}", "--systems=bm25", "--recall_only=bm25",
                        f"--retrievers=dpr={export}", "--limit=16"],
                        env=one_device_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert got.returncode == 0, got.stderr[-4000:]
  assert "| dpr | 16 |" in got.stdout, got.stdout
  results = json.load(open(os.path.join(workdir, "eval", "test", "results.json")))
  assert results["dpr"]["em"] is not None

  config = open_qa.load_workdir_config(workdir)
  questions = open_qa.split_questions(config)["test"][:16]
  setup_corpus = open_qa.QaSetup(config, workdir, build_missing=False).corpus
  towers = load_towers(export)
  texts = [setup_corpus[r]["title"] + " " + setup_corpus[r]["body"]
           for r in range(len(setup_corpus))]
  docs = setup_corpus.model_inputs(range(len(setup_corpus)), config.retrieval.max_length,
                                   towers["document"].tokenizer, config.retrieval.truncate)
  d = np.asarray(towers["document"].embed(docs))
  from realm_jax.retrieval.recall import embed_questions
  q = embed_questions(towers["query"], [x["question"] for x in questions])
  order = np.argsort(-(q @ d.T), axis=1, kind="stable")
  for k in config.ks:
    hits = [any(_contains(texts[r], answers_of(x)[0]) for r in order[i, :k])
            for i, x in enumerate(questions)]
    assert results["dpr"]["recall"][str(k)] == pytest.approx(100.0 * np.mean(hits)), k
