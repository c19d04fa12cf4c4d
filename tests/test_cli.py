"""Every entry point answers a user's mistake with one `error:` line naming the flag or file, exit
status 2 and no traceback (realm_jax/cli.py), before any expensive work.

The cases run once per session, as a user runs them: the first case of each script as its own
`python experiments/<job>.py ...`, the others in children forked from one process that already
imported what the scripts import (tests/cli_forks.py: otherwise starting Python and JAX ~130 times
is most of this file's time). Each test then checks one case's answer.
"""

import concurrent.futures
import json
import os
import sys

import pytest
import forked_runs
from cli_forks import run_forked
from conftest import NQ_OPEN, ROOT, one_device_env

CONFIGS = {"pretrain": "realm_jax/configs/pretrain.py:tiny", "ict": "realm_jax/configs/ict.py:tiny",
           "build_index": "realm_jax/configs/build_index.py:tiny",
           "finetune": "realm_jax/configs/finetune.py:tiny",
           "search_demo": "realm_jax/configs/build_index.py:tiny",
           "retro_train": "realm_jax/configs/retro.py:tiny", "dpr": "realm_jax/configs/dpr.py:tiny"}
MISSING = "/nonexistent/weights"


def _cases(files):
  """(id, script, args, words the error line must contain); {W} is a fresh work directory."""
  cases = []
  for job, config in CONFIGS.items():
    base = [f"--config={config}", "--workdir={W}"]
    if job in ("finetune", "dpr"):
      base.append(f"--config.data.local_dir={NQ_OPEN}")
    weights = {"pretrain": ["--config.init=hf", f"--config.retriever_weights={MISSING}",
                            f"--config.encoder_weights={MISSING}"],
               "ict": ["--config.init=bert", f"--config.bert_weights={MISSING}"],
               "build_index": [f"--config.weights={MISSING}"],
               "search_demo": [f"--config.weights={MISSING}"],
               "finetune": [f"--config.reader_weights={MISSING}"],
               "retro_train": [f"--config.db.key_weights={MISSING}"],
               "dpr": ["--config.init=bert", f"--config.bert_weights={MISSING}"]}[job]
    jsonl = {"finetune": "--config.retrieval.corpus", "retro_train": "--config.db",
             "dpr": "--config.retrieval.corpus"}.get(
        job, "--config.corpus")
    cases += [
        (f"{job}-misspelt-key", job, [*base, "--config.batch_sise=3"], ["--config.batch_sise", "batch_size"]),
        (f"{job}-missing-flagfile", job, ["--flagfile=no/such.flags"], ["--flagfile=no/such.flags"]),
        (f"{job}-workdir-is-a-file", job, [f"--config={config}", f"--workdir={files['file']}"]
         + base[2:], ["--workdir", files["file"]]),
        (f"{job}-unknown-variant", job, [f"--config={config}y", "--workdir={W}"], ["--config", "tinyy"]),
        (f"{job}-missing-weights", job, [*base, *weights], [MISSING]),
        (f"{job}-bad-jsonl-line", job, [*base, f"{jsonl}.source=jsonl",
                                        f"{jsonl}.paths=('{files['bad_jsonl']}',)"],
         [f"{files['bad_jsonl']}:2"]),
        (f"{job}-stray-argument", job, [*base, "extra"], ["extra"]),
    ]
    if job != "search_demo":
      cases += [
          (f"{job}-batch-0", job, [*base, "--config.batch_size=0"], ["--config.batch_size=0", "at least"]),
          (f"{job}-batch-negative", job, [*base, "--config.batch_size=-1"],
           ["--config.batch_size=-1", "at least"]),
      ]
    if job in ("pretrain", "ict", "finetune", "retro_train", "dpr"):
      cases += [
          (f"{job}-steps-0", job, [*base, "--config.num_steps=0"], ["--config.num_steps=0", "at least 1"]),
          (f"{job}-steps-negative", job, [*base, "--config.num_steps=-5"], ["--config.num_steps=-5"]),
          (f"{job}-no-workdir", job, [f"--config={config}"], ["--workdir"]),
          (f"{job}-mesh-larger-than-devices", job, [*base, "--config.mesh=data=2,fsdp=8"],
           ["--config.mesh=data=2,fsdp=8", "16 devices"]),
          (f"{job}-unknown-logical-axis", job, [*base, "--config.sharding_rules=layers=fsdp"],
           ["--config.sharding_rules=layers=fsdp", "'layers' is not a logical axis"]),
      ]
  cases += [
      ("pretrain-k-0", "pretrain", ["--config=" + CONFIGS["pretrain"], "--workdir={W}",
                                    "--config.num_candidates=0"], ["--config.num_candidates=0"]),
      ("finetune-beam-0", "finetune", ["--config=" + CONFIGS["finetune"], "--workdir={W}",
                                       "--config.beam=0"], ["--config.beam=0"]),
      ("finetune-beam-above-corpus", "finetune", ["--config=" + CONFIGS["finetune"], "--workdir={W}",
                                                  f"--config.data.local_dir={NQ_OPEN}",
                                                  "--config.beam=100000"],
       ["--config.beam=100000", "blocks of the corpus"]),
      ("build_index-bad-questions-line", "build_index",
       ["--config=" + CONFIGS["build_index"], "--workdir={W}",
        f"--config.eval.questions={files['bad_jsonl']}"], [f"{files['bad_jsonl']}:2"]),
      ("search_demo-k-0", "search_demo", ["--workdir={W}", "--k=0"], ["--k"]),
      ("pretrain-bad-number", "pretrain", ["--config=" + CONFIGS["pretrain"], "--workdir={W}",
                                           "--config.num_steps=abc"], ["--config.num_steps=abc"]),
      ("pretrain-bad-refresh", "pretrain", ["--config=" + CONFIGS["pretrain"], "--workdir={W}",
                                            "--config.index.refresh=sometimes"],
       ["--config.index.refresh", "sometimes"]),
      ("build_index-bad-searcher", "build_index", ["--config=" + CONFIGS["build_index"],
                                                   "--workdir={W}", "--config.index.searcher=faiss"],
       ["--config.index.searcher", "faiss"]),
      ("finetune-bad-retrieval-batch", "finetune", ["--config=" + CONFIGS["finetune"],
                                                    "--workdir={W}", f"--config.data.local_dir={NQ_OPEN}",
                                                    "--config.retrieval.batch_size=0"],
       ["--config.retrieval.batch_size=0"]),
      ("evaluate-negative-limit", "evaluate", ["--workdir={W}", "--limit=-1"], ["--limit=-1"]),
      ("evaluate-unknown-system", "evaluate", ["--workdir={W}", "--systems=finetuned,gpt"],
       ["--systems", "gpt"]),
      ("evaluate-missing-workdir", "evaluate", ["--workdir={W}"], ["{W}"]),
      ("evaluate-paired-with-a-system-not-evaluated", "evaluate",
       ["--workdir={W}", "--systems=finetuned,bm25", "--paired_with=dense_untuned"],
       ["--paired_with=dense_untuned", "finetuned, bm25"]),
      ("ask-missing-workdir", "ask", ["--workdir={W}", "--question=who"], ["{W}"]),
      ("memory_estimate-unknown-variant", "memory_estimate",
       ["--config=realm_jax/configs/pretrain.py:nope"], ["nope"]),
      ("memory_estimate-no-devices", "memory_estimate",
       ["--config=realm_jax/configs/pretrain.py:demo"], ["--devices"]),
      ("memory_estimate-unknown-platform", "memory_estimate",
       ["--config=realm_jax/configs/pretrain.py:paper_v4_64", "--platform=metal"],
       ["--platform=metal", "cpu|gpu|tpu"]),
      ("retro_train-k-above-db", "retro_train",
       ["--config=" + CONFIGS["retro_train"], "--workdir={W}", "--config.model.num_neighbours=3"],
       ["--config.model.num_neighbours=3", "--config.db.num_neighbours=2"]),
      ("retro_train-frozen-random-decoder", "retro_train",
       ["--config=" + CONFIGS["retro_train"], "--workdir={W}", "--config.freeze_decoder=True"],
       ["--config.freeze_decoder=True", "--config.init"]),
      ("retro_train-more-key-layers-than-the-weights", "retro_train",
       ["--config=" + CONFIGS["retro_train"], "--workdir={W}", "--config.db.key_layers=7"],
       ["--config.db.key_layers=7", "6 transformer layers"]),
      ("retro_train-negative-key-layers", "retro_train",
       ["--config=" + CONFIGS["retro_train"], "--workdir={W}", "--config.db.key_layers=-1"],
       ["--config.db.key_layers=-1"]),
      ("retro_train-own-document-share-above-1", "retro_train",
       ["--config=" + CONFIGS["retro_train"], "--workdir={W}",
        "--config.db.own_document_share=1.5"], ["--config.db.own_document_share=1.5", "0"]),
      ("retro_train-flash-attention-on-cpu", "retro_train",
       ["--config=" + CONFIGS["retro_train"], "--workdir={W}", "--config.model.attention=flash"],
       ["--config.model.attention=flash", "TPU", "compile_for.py"]),
      ("retro_train-cca-memory-of-gpt2", "retro_train",
       ["--config=" + CONFIGS["retro_train"], "--workdir={W}", "--config.model.cca_memory=decoder",
        "--config.model.family=gpt2"],
       ["--config.model.cca_memory=decoder", "gpt2", "--config.model.family", "encoder"]),
      ("retro_train-unknown-attention", "retro_train",
       ["--config=" + CONFIGS["retro_train"], "--workdir={W}", "--config.model.attention=splash"],
       ["--config.model.attention", "splash", "flash"]),
      ("retro_train-unknown-model", "retro_train",
       ["--config=" + CONFIGS["retro_train"], "--workdir={W}", "--config.models=('gpt',)"],
       ["--config.models=('gpt',)", "baseline"]),
      ("retro_sample-no-model", "retro_sample", ["--prompt=The Nile"], ["--workdir", "--model"]),
      ("dpr-bad-pooling", "dpr", ["--config=" + CONFIGS["dpr"], "--workdir={W}",
                                  "--config.pooling=cls"], ["--config.pooling='cls'", "mean"]),
      ("dpr-bm25-depth-1", "dpr", ["--config=" + CONFIGS["dpr"], "--workdir={W}",
                                   "--config.bm25_depth=1"], ["--config.bm25_depth=1"]),
      ("evaluate-retriever-without-weights", "evaluate", ["--workdir={W}", "--retrievers=dpr"],
       ["--retrievers='dpr'", "NAME=WEIGHTS"]),
      ("evaluate-retriever-named-like-a-system", "evaluate",
       ["--workdir={W}", f"--retrievers=bm25={MISSING}"], ["--retrievers", "'bm25'"]),
      ("evaluate-run-without-workdir", "evaluate", ["--workdir={W}", "--runs=nq_only"],
       ["--runs='nq_only'", "NAME=WORKDIR"]),
      ("evaluate-run-named-like-a-system", "evaluate",
       ["--workdir={W}", f"--runs=finetuned={MISSING}"], ["--runs", "'finetuned'"]),
      ("evaluate-missing-retriever", "evaluate", ["--workdir={W}", f"--retrievers=dpr={MISSING}"],
       ["--retrievers=dpr", MISSING]),
      ("retro_eval-empty-workdir", "retro_eval", ["--workdir={W}"],
       ["--workdir={W}", "no trained model", "retro_train.py"]),
      ("pretrain-bad-masking", "pretrain", ["--config=" + CONFIGS["pretrain"], "--workdir={W}",
                                            "--config.masking=words"],
       ["--config.masking='words'", "random_tokens"]),
      ("pretrain-unknown-rng-impl", "pretrain", ["--config=" + CONFIGS["pretrain"],
                                                 "--workdir={W}", "--config.rng_impl=philox"],
       ["--config.rng_impl='philox'", "rbg"]),
      ("retro_train-unknown-rng-impl", "retro_train",
       ["--config=" + CONFIGS["retro_train"], "--workdir={W}", "--config.rng_impl=philox"],
       ["--config.rng_impl='philox'", "rbg"]),
      ("ablations-unknown-variant", "ablations",
       ["--config=realm_jax/configs/ablations.py:tiny", "--workdir={W}",
        "--config.variants=('default','no_bert')"], ["--config.variants", "no_bert"]),
      ("ablations-no-default", "ablations",
       ["--config=realm_jax/configs/ablations.py:tiny", "--workdir={W}",
        "--config.variants=('random_tokens',)"], ["--config.variants", "'default'"]),
      ("finetune-init-without-export", "finetune",
       ["--config=" + CONFIGS["finetune"], "--workdir={W}", f"--config.data.local_dir={NQ_OPEN}",
        f"--config.init={MISSING}"], ["--config.init", MISSING, "export"]),
      ("finetune-more-retriever-layers-than-weights", "finetune",
       ["--config=" + CONFIGS["finetune"], "--workdir={W}", f"--config.data.local_dir={NQ_OPEN}",
        "--config.retrieval.num_layers=7"],
       ["--config.retrieval.num_layers=7", "has 6 transformer layers"]),
      *_newer_cases(files),
  ]
  return cases


def _newer_cases(files):
  """Cases of the entry points added with RETRO, kNN-LM and DPR, and of the tools beside them."""
  export, db = files["export"], "--db=/nonexistent/db"
  sample = ["--model=" + export, db]
  memory = "memory_estimate"
  return [
      ("retro_eval-export-given-twice", "retro_eval",
       [db, f"--models={export},{export}/", "--out={W}"], ["--models", export, "twice"]),
      ("retro_eval-out-is-a-file", "retro_eval",
       [db, f"--models={export}", f"--out={files['file']}"], ["--out", files["file"], "written"]),
      ("retro_eval-out-under-a-file", "retro_eval",
       [db, f"--models={export}", f"--out={files['file']}/eval"],
       [f"{files['file']}/eval", "written"]),
      ("retro_sample-empty-prompt", "retro_sample", [*sample, "--prompt="], ["--prompt=''"]),
      ("retro_sample-blank-prompt", "retro_sample", [*sample, "--prompt=  "],
       ["--prompt=", "text"]),
      ("retro_sample-top-k-above-vocabulary", "retro_sample",
       [*sample, "--prompt=The Nile", "--top_k=100000"], ["--top_k=100000", "100 tokens"]),
      ("retro_sample-temperature-nan", "retro_sample",
       [*sample, "--prompt=The Nile", "--temperature=nan"], ["--temperature=nan"]),
      ("retro_sample-temperature-negative", "retro_sample",
       [*sample, "--prompt=The Nile", "--temperature=-1"], ["--temperature=-1"]),
      ("knnlm_eval-same-names", "knnlm_eval",
       [db, "--models=a/retro/export,b/retro/export", "--out={W}"], ["--models", "same name"]),
      ("knnlm_eval-bad-lambdas", "knnlm_eval", ["--workdir={W}", "--lambdas=0.1,x"],
       ["--lambdas=0.1,x"]),
      ("knnlm_eval-no-workdir", "knnlm_eval", [], ["--workdir", "--db", "--models", "--out"]),
      (f"{memory}-negative-devices", memory,
       ["--config=realm_jax/configs/pretrain.py:demo", "--devices=-4"], ["--devices=-4"]),
      (f"{memory}-negative-capacity", memory,
       ["--config=realm_jax/configs/pretrain.py:demo", "--devices=4", "--capacity_gib=-16"],
       ["--capacity_gib=-16"]),
      (f"{memory}-nan-capacity", memory,
       ["--config=realm_jax/configs/pretrain.py:demo", "--devices=4", "--capacity_gib=nan"],
       ["--capacity_gib=nan"]),
      (f"{memory}-negative-index-rows", memory,
       ["--config=realm_jax/configs/pretrain.py:tiny", "--devices=4", "--index_rows=-5"],
       ["--index_rows=-5"]),
      *[(f"{memory}-{job}-config", memory, [f"--config={CONFIGS[job]}", "--devices=4"],
         [f"--config={CONFIGS[job]}", "configs/pretrain.py", "configs/retro.py"])
        for job in ("dpr", "finetune", "ict")],
      ("plot_metrics-empty-metrics", "plot_metrics", [f"--workdir={files['empty_run']}"],
       [f"{files['empty_run']}/metrics.jsonl", "no metrics"]),
      ("plot_metrics-unknown-metrics", "plot_metrics", [f"--workdir={files['unknown_run']}"],
       [f"{files['unknown_run']}/metrics.jsonl", "none of the metrics"]),
      ("plot_metrics-missing-workdir", "plot_metrics", ["--workdir={W}"], ["{W}/metrics.jsonl"]),
      ("refresh_index-workdir-is-a-file", "refresh_index",
       ["--config=" + CONFIGS["pretrain"], f"--workdir={files['file']}"],
       ["--workdir", files["file"]]),
      ("refresh_index-negative-poll", "refresh_index",
       ["--config=" + CONFIGS["pretrain"], "--workdir={W}", "--poll_seconds=-1"],
       ["--poll_seconds=-1"]),
      ("ablations-table-only-without-a-run", "ablations",
       ["--config=realm_jax/configs/ablations.py:tiny", "--workdir={W}", "--table_only"],
       ["--workdir={W}", "--table_only"]),
      ("finetune-mixture-negative-weight", "finetune",
       ["--config=realm_jax/configs/finetune.py:mixture", "--workdir={W}",
        "--config.data.mixture.trivia_qa.weight=-1"],
       ["--config.data.mixture.trivia_qa.weight=-1.0", "share"]),
      ("absent_answers-workdir-is-a-file", "absent_answers",
       ["--config=" + CONFIGS["finetune"], f"--workdir={files['file']}"],
       ["--workdir", files["file"]]),
      ("absent_answers-missing-questions", "absent_answers",
       ["--config=" + CONFIGS["finetune"], "--workdir={W}", "--config.data.local_dir=/nowhere/nq"],
       ["/nowhere/nq", "does not exist"]),
      # The TPU compile entry point: each refused before anything is compiled.
      ("compile_for-topology-not-a-slice", "compile_for",
       ["--topology=v5e-300", "--config=" + CONFIGS["retro_train"]], ["powers of two"]),
      ("compile_for-batch-over-more-parts", "compile_for",
       ["--topology=v5e-16", "--config=" + CONFIGS["retro_train"]],
       ["--config.batch_size=8 is not divisible by the 16 parts"]),
      ("compile_for-mesh-not-the-devices", "compile_for",
       ["--topology=v5e-8", "--mesh=data=3", "--config=" + CONFIGS["retro_train"]],
       ["multiply to 3 devices"]),
      ("compile_for-mesh-over-more-devices", "compile_for",
       ["--topology=v5e-8", "--mesh=data=4,fsdp=4", "--config=" + CONFIGS["retro_train"]],
       ["multiply to 16 devices, but there are 8"]),
      ("compile_for-unknown-logical-axis", "compile_for",
       ["--topology=v5e-8", "--config=" + CONFIGS["retro_train"],
        "--config.sharding_rules=layers=fsdp"], ["'layers' is not a logical axis"]),
      ("compile_for-config-of-no-step", "compile_for",
       ["--topology=v5e-8", "--config=" + CONFIGS["build_index"]], ["RETRO", "DPR"]),
      # A fine-tuning config whose weights are not there: refused before the models are built.
      ("compile_for-finetune-without-weights", "compile_for",
       ["--topology=v5e-8", "--config=realm_jax/configs/finetune.py:paper"],
       ["--config.retrieval.weights"]),
  ]


def _command(case, tmp):
  """(script, args with {W} replaced, its work directory) of a case."""
  name, script, args, _ = case
  workdir = os.path.join(tmp, name)
  return script, [a.replace("{W}", workdir) for a in args], workdir


def _env():
  return dict(one_device_env(), JAX_PLATFORMS="cpu")


def _run(script, args):
  return forked_runs.run([sys.executable, os.path.join("experiments", f"{script}.py"), *args],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
  tmp = str(tmp_path_factory.mktemp("cli"))
  files = {"file": os.path.join(tmp, "a_file"), "bad_jsonl": os.path.join(tmp, "bad.jsonl")}
  with open(files["file"], "w") as f:
    f.write("not a directory\n")
  with open(files["bad_jsonl"], "w") as f:
    f.write('{"title": "A", "text": "Some text.", "question": "q", "answer": ["a"]}\n'
            '{"title": "B", "text": oops}\n')
  # A RETRO export's retro.json (what is read before the weights), runs' metrics.jsonl.
  files["export"] = os.path.join(tmp, "a", "retro", "export")
  os.makedirs(files["export"])
  with open(os.path.join(files["export"], "retro.json"), "w") as f:
    json.dump({"model": {"vocab_size": 100, "cca_layers": []}}, f)
  for name, text in (("empty_run", ""), ("unknown_run", '{"step": 1, "split": "train", "x": 2}\n')):
    files[name] = os.path.join(tmp, name)
    os.makedirs(files[name])
    with open(os.path.join(files[name], "metrics.jsonl"), "w") as f:
      f.write(text)
  cases = _cases(files)
  commands = [_command(c, tmp) for c in cases]
  scripts = [script for script, _, _ in commands]
  own = [i for i, script in enumerate(scripts) if scripts.index(script) == i]
  forked = [i for i in range(len(cases)) if i not in own]
  results = {}
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    runs = pool.map(lambda i: _run(*commands[i][:2]), own)
    results.update(zip(forked, run_forked([commands[i][:2] for i in forked], _env())))
    results.update(zip(own, runs))
  return {case[0]: (case, results[i], commands[i][2]) for i, case in enumerate(cases)}


def _ids():
  fake = {"file": "F", "bad_jsonl": "B", "export": "E", "empty_run": "R0", "unknown_run": "R1"}
  return [c[0] for c in _cases(fake)]


def test_at_least_the_issue_cases():
  assert len(_ids()) >= 31 and len(set(_ids())) == len(_ids())


@pytest.mark.parametrize("name", _ids())
# Slow: the `answers` fixture runs every case (87 s on 2 cores shared with a busy job; 60 s there
# before the 25 cases of the newer entry points).
@pytest.mark.slow
def test_user_mistake_is_one_error_line(answers, name):
  (_, _, _, words), got, workdir = answers[name]
  stderr = got.stderr
  assert got.returncode == 2, f"exit {got.returncode}\n{stderr[-3000:]}"
  assert "Traceback" not in stderr, stderr[-3000:]
  errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1, stderr[-3000:]
  for word in words:
    assert word.replace("{W}", workdir) in errors[0], errors[0]


def test_a_table_asked_of_a_missing_run_makes_no_directory(answers):
  """`ablations.py --table_only` on a work directory that does not exist is refused and leaves
  nothing: it once created the directory and wrote an empty table there."""
  _, got, workdir = answers["ablations-table-only-without-a-run"]
  assert got.returncode == 2 and not os.path.exists(workdir)


def test_an_error_after_a_progress_bar_starts_a_line_of_its_own(capsys):
  """A progress bar leaves stderr mid-line (it redraws after a carriage return): the `error:`
  written after it started no line, and `grep ^error:` did not find it."""
  from tqdm.auto import tqdm
  from realm_jax import cli
  bar = tqdm(total=10, desc="evaluating")
  bar.update(3)
  with pytest.raises(SystemExit) as e:
    cli.fail("--out=x: cannot be written.")
  bar.close()
  err = capsys.readouterr().err
  assert e.value.code == 2
  assert [line for line in err.splitlines() if line.startswith("error:")] == [
      "error: --out=x: cannot be written."], err
  with pytest.raises(SystemExit):  # without a bar: the one line alone, as before
    cli.fail("two\nlines")
  assert capsys.readouterr().err == "error: two lines\n"
