"""Open-QA fine-tuning loop, evaluation and baselines on the tiny config (40 articles, NQ-Open
questions from ../shared): the loop trains, selects and resumes; the reader waits during the
retriever-only steps; EM and recall@k of every system equal an independent computation (brute-
force dense search, BM25 search, has_answer / exact_match on the written predictions)."""

import json
import os
import shutil

import chex
import jax
import numpy as np
import pytest
from conftest import NQ_OPEN, damaged_best_copy
from test_qa_step import MODELS, make_batch, make_params

from realm_jax.checkpoints import training as checkpoints
from realm_jax.configs.finetune import get_config
from realm_jax.data.qa_batches import answers_of
from realm_jax.eval import report
from realm_jax.retrieval.bm25 import BM25Index
from realm_jax.systems import open_qa
from realm_jax.text.answers import exact_match
from realm_jax.train import finetune
from realm_jax.train import qa_step
from realm_jax.train.qa_step import TrainState, qa_train_step

NQ = NQ_OPEN


def tiny_config(**overrides):
  c = get_config("tiny")
  c.data.local_dir = NQ
  c.retriever_steps = 2
  for k, v in overrides.items():
    c[k] = v
  return c


def run_config(run, **overrides):
  """tiny_config with the shared tiny run's reader (conftest.tiny_reader)."""
  return tiny_config(reader_weights=run[1].config.reader_weights, **overrides)


# The tests that read the shared tiny run (conftest.tiny_qa_workdir, ~35 s to make) are marked slow.
@pytest.fixture(scope="module")
def run(tiny_qa_workdir):
  """The shared tiny run (conftest): 2 retriever-only + 2 joint steps, dev every 2 steps."""
  setup = open_qa.QaSetup(open_qa.load_workdir_config(tiny_qa_workdir), tiny_qa_workdir,
                          build_missing=False)
  return tiny_qa_workdir, setup


@pytest.mark.slow
def test_loop_logs_selects_and_checkpoints(run):
  workdir, setup = run
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  train = [r for r in rows if r["split"] == "train"]
  dev = [r for r in rows if r["split"] == "dev"]
  # Dev at step 0 (the starting point), every 2 steps and at the end (realm_jax/train/loop.py).
  assert [r["step"] for r in train] == [2, 4] and [r["step"] for r in dev] == [0, 2, 4]
  assert all(np.isfinite(r["loss"]) for r in train)
  # Steps 1-2 are retriever-only: no reader loss, and the reader's learning rate is still 0.
  assert train[0]["reader_loss"] == 0.0 and train[0]["reader_learning_rate"] == 0.0
  assert train[1]["reader_learning_rate"] > 0.0 and train[1]["reader_loss"] > 0.0
  # The kept model is the dev-best one (EM, then recall@5) of the evaluations that were logged.
  keys = [(r.get("em", 0.0), r["recall_5"], -r["step"]) for r in dev]
  top = max(keys)
  params, meta = setup.best_params()
  assert meta["step"] == -top[2] and (meta.get("em", 0.0), meta["recall_5"]) == top[:2]
  chex.assert_trees_all_equal_shapes(params, setup.init_params)
  # The run kept its position in the questions and its best result for resuming.
  latest = json.loads(open(os.path.join(workdir, "checkpoints", "4", "meta", "metadata")).read())
  assert latest["best"]["step"] == meta["step"] and latest["position"]["draws"] > 0


@pytest.mark.slow
def test_the_retriever_only_programs_are_dropped_when_reading_starts(run):
  """The shared run's 2 retriever-only steps compiled their own step programs, which never run
  again once the reader trains: dropped once, at step 2, before the first joint step."""
  workdir, _ = run
  lines = [line for line in open(workdir + ".log") if "retriever-only step programs dropped" in line]
  assert len(lines) == 1 and "Reading starts at step 2:" in lines[0], lines
  assert int(lines[0].split(": ")[-1].split()[0]) >= 1


@pytest.mark.slow
def test_rerun_resumes_and_has_nothing_left_to_do(run):
  workdir, setup = run
  _, meta = setup.best_params()
  trainer = finetune.QaTrainer(run_config(run), workdir)
  best = trainer.run()
  assert best["step"] == meta["step"] and best["dev_recall"] == meta["recall_5"]
  assert int(trainer.state.step) == 4 and trainer.position["draws"] > 0


@pytest.mark.slow
def test_restart_after_best_outran_its_record(run, tmp_path):
  """The run died after saving best/ but before a regular checkpoint recorded it (none here):
  the restart reads the record from best/ itself; the kept step evaluated again neither crashes
  (orbax's StepAlreadyExistsError) nor replaces the kept model, a worse step is not kept, a
  better one is."""
  import shutil
  workdir, setup = run
  where = str(tmp_path / "restart")
  shutil.copytree(workdir, where, ignore=shutil.ignore_patterns("checkpoints"))
  _, kept = setup.best_params()
  step, dev = kept["step"], {k: v for k, v in kept.items() if k != "step"}
  record = {"dev_em": kept.get("em", 0.0), "dev_recall": kept["recall_5"], "step": step}
  trainer = finetune.QaTrainer(run_config(run), where)
  try:
    trainer.restore()
    assert int(trainer.state.step) == 0  # no checkpoint: training starts again
    assert not trainer.maybe_keep_best(step, dev)  # the same result at the same step
    better = {**dev, "em": dev.get("em", 0.0) + 1.0}
    assert not trainer.maybe_keep_best(step, better)  # best/ already holds this step's model
    assert not trainer.keep_best(step, {"step": step})  # the last step kept without evaluations
    assert not trainer.maybe_keep_best(step + 1, {**dev, "em": dev.get("em", 0.0) - 1.0})
    assert trainer.best == record and trainer.setup.best_params()[1] == kept
    assert trainer.maybe_keep_best(step + 1, better)
    trainer.restore()
    assert trainer.best == {**record, "dev_em": better["em"], "step": step + 1}
    assert trainer.setup.best_params()[1] == {"step": step + 1, **better}
  finally:
    trainer.metrics.close()


@pytest.mark.slow
def test_workdir_with_other_data_is_refused(run):
  workdir, _ = run
  other = run_config(run)
  other.data.test_percent = 50.0
  with pytest.raises(ValueError, match="another config"):
    finetune.QaTrainer(other, workdir)


@pytest.mark.slow
def test_recall_k_beyond_the_corpus_is_refused_before_training(run, tmp_path):
  """config.ks asking for more blocks than the corpus has (40 here) is refused when the run
  starts, naming config.ks (it was an index error at the first dev evaluation, after training
  steps), and by evaluate_open_qa itself."""
  import shutil

  from realm_jax.eval.open_qa import evaluate_open_qa
  workdir, setup = run
  where = str(tmp_path / "ks")
  shutil.copytree(workdir, where, ignore=shutil.ignore_patterns("checkpoints", "best"))
  with pytest.raises(ValueError, match=r"config.ks=\(1, 5, 41\): recall@k needs 1 <= k <= 40"):
    finetune.QaTrainer(run_config(run, ks=(1, 5, 41)), where)
  assert not os.path.exists(os.path.join(where, "checkpoints"))
  system = setup.system(setup.init_params)
  questions = open_qa.split_questions(setup.config)["dev"][:2]
  for ks in ((1, 41), (0, 5)):
    with pytest.raises(ValueError, match=r"config.ks=.*recall@k needs 1 <= k <= 40"):
      evaluate_open_qa(system, questions, ks=ks, read=False)
  got = evaluate_open_qa(system, questions, ks=(1, 40), read=False)
  # k = the whole corpus: a question counts when any block holds an answer.
  want = 100.0 * np.mean([setup.batcher.any_answer_in(q, range(40)) for q in questions])
  assert got["recall"][40] == pytest.approx(want)


@pytest.mark.parametrize("key,value,error", [
    ("checkpoint_every", 0, r"config.checkpoint_every=0: must be at least 1"),
    ("log_every", 0, r"config.log_every=0: must be at least 1"),
    ("reader_blocks", 0, r"config.reader_blocks=0: must be at least 1"),
    ("eval_limit", -8, r"config.eval_limit=-8: must be at least 0 \(0 = every dev question\)"),
    ("data.limit", -1, r"config.data.limit=-1: must be at least 0 \(0 = every question\)"),
])
def test_bad_counts_are_refused_before_anything_runs(tmp_path, key, value, error):
  """A zero period was a ZeroDivisionError after the first training step; a negative limit
  silently left out the last questions (a Python slice). Refused before the index is built."""
  c = tiny_config()
  if key == "data.limit":
    c.data.limit = value
  else:
    c[key] = value
  with pytest.raises(ValueError, match=error):
    finetune.QaTrainer(c, str(tmp_path / "w"))
  assert not os.path.exists(tmp_path / "w")


@pytest.mark.parametrize("key,value,error", [
    ("reader_weights", "/nowhere/reader", r"config.reader_weights=/nowhere/reader is not a "
                                          "directory"),
    ("data.local_dir", "/nowhere/nq", r"folder /nowhere/nq does not exist"),
    ("retrieval.index.searcher", "faiss", r"searcher='faiss': use one of"),
])
def test_a_config_refused_for_a_typo_does_not_claim_the_workdir(tmp_path, key, value, error):
  """Weights, question files and index settings are checked before config.json is written, so
  the corrected command is not refused as 'a run made with another config'."""
  c = tiny_config()
  *sections, name = key.split(".")
  target = c
  for section in sections:
    target = target[section]
  setattr(target, name, value)
  with pytest.raises((ValueError, FileNotFoundError), match=error):
    finetune.QaTrainer(c, str(tmp_path / "w"))
  assert not os.path.exists(tmp_path / "w" / "config.json")


@pytest.mark.slow
def test_reader_waits_for_the_retriever_steps():
  """qa_optimizer: during the retriever-only steps the reader does not move at all (lr 0, no
  decay); then it does. The question tower moves from the first step."""
  c = tiny_config(num_steps=6, retriever_steps=2, warmup_steps=0)
  _, tx = qa_step.qa_optimizer(c)
  params = make_params()
  state = TrainState.create(apply_fn=None, params=params, tx=tx)
  step = jax.jit(lambda s, b, r: qa_train_step(s, b, r, models=MODELS))
  full = make_batch()
  retriever_only = {k: full[k] for k in ("question", "beam_embeddings", "beam_mask",
                                         "beam_has_answer")}
  before = jax.device_get(state.params)
  for _ in range(2):
    state, out = step(state, retriever_only, jax.random.key(0))
    assert float(out["reader_loss_sum"]) == 0.0
  chex.assert_trees_all_equal(jax.device_get(state.params["reader"]), before["reader"])
  assert not np.allclose(jax.device_get(state.params["query_tower"]["realm"]["embeddings"]
                                        ["word_embeddings"]["embedding"]),
                         before["query_tower"]["realm"]["embeddings"]["word_embeddings"]
                         ["embedding"])
  state, _ = step(state, full, jax.random.key(1))
  head, head_before = jax.device_get(state.params["reader"]["qa_outputs"]), before["reader"]["qa_outputs"]
  for (path, new), old in zip(jax.tree_util.tree_leaves_with_path(head), jax.tree.leaves(head_before)):
    if jax.tree_util.keystr(path) == "['dense_output']['bias']":  # no gradient: see frozen_span_offset
      np.testing.assert_array_equal(new, old)
    else:
      assert not np.array_equal(new, old), jax.tree_util.keystr(path)
  with pytest.raises(ValueError, match="retriever_steps"):
    qa_step.qa_optimizer(tiny_config(num_steps=4, retriever_steps=4))


@pytest.mark.slow
def test_evaluate_systems_against_independent_computation(run, tmp_path):
  workdir, setup = run
  config = setup.config
  questions = open_qa.split_questions(config)["test"][:12]
  ks = (1, 2, 5)
  results = report.evaluate_systems(setup, questions, ks=ks, out_dir=str(tmp_path),
                                    progress=False, paired_with="dense_untuned")
  assert set(results) == set(report.SYSTEMS)
  corpus, table = setup.corpus, setup.table
  texts = [setup.batcher.block(r)["text"] for r in range(len(corpus))]

  def recall(rows):
    hit = np.array([[r >= 0 and setup.batcher.has_answer(r, answers_of(q)[0], "text")
                     for r in row] for q, row in zip(questions, rows)])
    return {k: 100.0 * hit[:, :k].any(1).mean() for k in ks}

  params, _ = setup.best_params()
  for name, tower in (("finetuned", params["query_tower"]),
                      ("dense_untuned", setup.init_params["query_tower"])):
    q = np.asarray(setup.models.query_tower.apply(
        {"params": tower}, **{k: v for k, v in setup.batcher.questions(
            [x["question"] for x in questions]).items()}))
    rows = np.argsort(-(q @ table.T), axis=1, kind="stable")[:, :max(ks)]  # brute force
    assert results[name]["recall"] == pytest.approx(recall(rows)), name
  _, bm_rows = BM25Index.build(texts).search([q["question"] for q in questions], max(ks))
  assert results["bm25"]["recall"] == pytest.approx(recall(bm_rows))
  for name in report.SYSTEMS:
    preds = [json.loads(line) for line in open(tmp_path / f"predictions-{name}.jsonl")]
    assert [p["question"] for p in preds] == [q["question"] for q in questions]
    em = 100.0 * np.mean([exact_match(p["answer"], q["answers"]) for p, q in zip(preds,
                                                                                   questions)])
    assert results[name]["em"] == pytest.approx(em)
    for p in preds:  # the answer is cut from the evidence block it came from
      ev = [e for e in p["evidence"] if e["block_id"] == p["block_id"]]
      assert ev and p["answer"] == ev[0]["best_span"]
      row = int(corpus.rows_of(p["block_id"]))
      assert corpus[row]["title"] == ev[0]["title"]
      field = ev[0]["span"]["field"]
      if field:
        a, b = ev[0]["span"]["start"], ev[0]["span"]["end"]
        assert corpus[row][field][a:b] in p["answer"]
    # Where the errors are: recounted from the predictions' flags; a readable answer is one in
    # a read block, and every right answer the reader could select was readable.
    e = results[name]["errors"]
    assert e["answer_in_read"] == sum(p["answer_in_read"] for p in preds)
    assert e["answer_readable"] == sum(p["answer_readable"] for p in preds) <= e["answer_in_read"]
    assert e["right_when_readable"] == sum(p["correct"] and p["answer_readable"] for p in preds)
    assert all(p["answer_in_read"] for p in preds if p["answer_readable"])
  saved = json.loads(open(tmp_path / "results.json").read())
  assert saved["bm25"]["em"] == pytest.approx(results["bm25"]["em"])
  assert "| finetuned |" in report.format_table(results, ks)
  assert "reader right when readable" in report.format_table(results, ks)
  # Each system minus dense_untuned, question by question: the differences of the figures above.
  assert "vs_dense_untuned" not in results["dense_untuned"]
  for name in ("finetuned", "bm25"):
    d = results[name]["vs_dense_untuned"]
    assert d["em"][0] == pytest.approx(results[name]["em"] - results["dense_untuned"]["em"])
    for k in ks:
      diff, low, high = d["recall"][k]
      assert diff == pytest.approx(results[name]["recall"][k]
                                   - results["dense_untuned"]["recall"][k])
      assert low <= diff + 1e-9 and diff <= high + 1e-9
    assert saved[name]["vs_dense_untuned"]["em"] == pytest.approx(list(d["em"]))
  assert "| bm25 | dense_untuned |" in report.format_table(results, ks)


@pytest.mark.slow
def test_another_runs_model_is_a_system_over_this_index(run, tmp_path):
  """evaluate.py --runs: another work directory's kept model answers beside this run's systems.
  Here that run kept a question tower of its own (this run's, perturbed) and the reader as it
  started: its recall is that of a brute-force search with that tower, its answers those of a
  system built here from its parameters; the run's own work directory given again answers as
  `finetuned`, a paired difference of exactly 0."""
  workdir, setup = run
  other = tmp_path / "other"
  other.mkdir()
  shutil.copy(os.path.join(workdir, "config.json"), other / "config.json")
  with pytest.raises(FileNotFoundError, match="best"):  # no kept model yet
    finetune.check_comparable_run(setup.config, str(other), "--runs=other")
  params, _ = setup.best_params()
  rng = np.random.default_rng(0)
  tower = jax.tree_util.tree_map(
      lambda x: np.asarray(x) + rng.normal(0, 1, x.shape).astype(x.dtype) * (np.std(x) + 0.01),
      params["query_tower"])
  kept = {"query_tower": tower, "reader": setup.init_params["reader"]}
  manager = checkpoints.checkpoint_manager(str(other / open_qa.BEST), keep=1, asynchronous=False,
                                           data=False)
  checkpoints.save(manager, 3, kept, {"step": 3}, force=True)
  finetune.check_comparable_run(setup.config, str(other), "--runs=other")
  questions = open_qa.split_questions(setup.config)["test"][:12]
  texts = [q["question"] for q in questions]
  ks = (1, 2, 5)
  out = tmp_path / "eval"
  results = report.evaluate_systems(
      setup, questions, systems=("finetuned",), ks=ks, out_dir=str(out), progress=False,
      runs={"other": str(other), "again": workdir}, paired_with="finetuned")
  read = lambda name: [json.loads(line) for line in open(out / f"predictions-{name}.jsonl")]
  assert [p["retrieved"] for p in read("other")] != [p["retrieved"] for p in read("finetuned")]
  q = np.asarray(setup.models.query_tower.apply({"params": tower}, **setup.batcher.questions(texts)))
  rows = np.argsort(-(q @ setup.table.T), axis=1, kind="stable")[:, :max(ks)]  # brute force
  hit = np.array([[setup.batcher.has_answer(r, answers_of(x)[0], "text") for r in row]
                  for x, row in zip(questions, rows)])
  assert results["other"]["recall"] == pytest.approx(
      {k: 100.0 * hit[:, :k].any(1).mean() for k in ks})
  direct = setup.system(kept).answer(texts)
  assert [p["answer"] for p in read("other")] == [a["answer"] for a in direct]
  assert read("again") == read("finetuned")
  assert results["again"]["vs_finetuned"]["em"] == (0.0, 0.0, 0.0)
  # A run with another reader layout cannot be read over this one's batches: refused, named.
  config = json.loads(open(other / "config.json").read())
  config["reader_length"] += 32
  (other / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="--runs=other.*reader_length"):
    finetune.check_comparable_run(setup.config, str(other), "--runs=other")
  with pytest.raises(FileNotFoundError, match="not a fine-tuning work directory"):
    finetune.check_comparable_run(setup.config, str(tmp_path / "nothing"), "--runs=x")


@pytest.mark.slow
def test_curated_trec_style_questions_are_matched_not_compared(run, tmp_path):
  """Regex answers: recall counts a block whose text a pattern matches anywhere; EM asks the
  pattern to match the predicted answer from its start (DrQA), checked on the written predictions."""
  import re
  workdir, setup = run
  titles = [setup.corpus[r]["title"] for r in range(4)]
  questions = [{"question": f"what is {t}", "answers": [re.escape(t.split()[0]) + r"\w*"],
                "answer_type": "regex"} for t in titles]
  results = report.evaluate_systems(setup, questions, systems=("finetuned",), ks=(1, 5),
                                    out_dir=str(tmp_path), progress=False)
  preds = [json.loads(line) for line in open(tmp_path / "predictions-finetuned.jsonl")]
  em = 100.0 * np.mean([re.match(q["answers"][0], p["answer"], re.I) is not None
                        for p, q in zip(preds, questions)])
  assert results["finetuned"]["em"] == pytest.approx(em)
  hits = [[re.search(q["answers"][0], setup.batcher.block(int(setup.corpus.rows_of(b)))["text"],
                     re.I) is not None for b in p["retrieved"][:5]] for p, q in zip(preds, questions)]
  assert results["finetuned"]["recall"][5] == pytest.approx(100.0 * np.mean([any(h) for h in hits]))
  assert results["finetuned"]["recall"][5] > 0  # "what is <title>" finds its own article


def test_a_workdir_keeps_its_reader_layout(tmp_path):
  """reader_title and reader_length change every reader input and positive: a run made without
  the reader_title setting (titles read) resumes with the default and is refused with titles
  off, as is another reader_length, score scale, question length or number of gold spans."""
  from realm_jax.train.loop import check_workdir_config
  config = get_config("wiki_vital")
  check_workdir_config(config, str(tmp_path), finetune.FIXED_SETTINGS)
  saved = json.loads((tmp_path / "config.json").read_text())
  del saved["reader_title"]
  (tmp_path / "config.json").write_text(json.dumps(saved))
  check_workdir_config(config, str(tmp_path), finetune.FIXED_SETTINGS)
  for key, value in (("reader_title", False), ("reader_length", 320), ("score_scale", 1.0),
                     ("question_length", 16), ("max_answer_spans", 2)):
    (tmp_path / "config.json").write_text(json.dumps(saved))
    other = get_config("wiki_vital")
    other[key] = value
    with pytest.raises(ValueError, match=rf"another config \({key} differ"):
      check_workdir_config(other, str(tmp_path), finetune.FIXED_SETTINGS)


def test_evaluating_with_another_config_names_each_setting_that_differs(tmp_path):
  """evaluate.py --flagfile=<the MiniLM run's flags> on a run fine-tuned from a DPR export: the
  index was embedded by the DPR tower, so this is refused before anything loads, naming the
  nested setting, both values, and the way out (the work directory's own config.json)."""
  config = get_config("wiki_vital")
  config.retrieval.weights = "work/dpr_wiki_vital/export"
  (tmp_path / "config.json").write_text(config.to_json())
  finetune.check_evaluated_config(config, str(tmp_path))  # the same settings: fine
  finetune.check_evaluated_config(config, str(tmp_path / "not_a_run"))  # check_best's to say
  with pytest.raises(ValueError) as e:
    finetune.check_evaluated_config(get_config("wiki_vital"), str(tmp_path))
  assert ("--config.retrieval.weights='minilm' here, 'work/dpr_wiki_vital/export' there"
          in str(e.value)) and "leave out --config and --flagfile" in str(e.value)


@pytest.mark.slow
def test_a_damaged_best_model_stops_the_resume_saying_what_to_do(run, tmp_path):
  """A data file of best/'s only model deleted: resuming reads it (not only its record), and,
  with no older model to fall back to, stops with one ValueError naming best/ and what to do,
  instead of keeping a model that cannot be loaded or an orbax traceback; nothing is moved."""
  workdir, _ = run
  where, step = damaged_best_copy(workdir, tmp_path)
  trainer = finetune.QaTrainer(run_config(run), str(where))
  try:
    with pytest.raises(ValueError, match=rf"No checkpoint in {where}/{open_qa.BEST} can be read "
                       rf"\(step {step.name}: .+\)\. Nothing was changed\. Move {where}/"
                       rf"{open_qa.BEST} away to go on fine-tuning without it"):
      trainer.restore()
  finally:
    trainer.metrics.close()
  assert step.is_dir() and not (where / f"{open_qa.BEST}-damaged").exists()
