"""experiments/ablations.py: the paired bootstrap and standard errors against plain loops, the
variants as config overrides, fine-tuning from a pre-training work directory, and the tiny runner
end to end (two pre-training variants, fine-tuning from the default one, the table)."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import forked_runs
from conftest import one_device_env, started_early

from realm_jax.configs import ablations as ablations_config
from realm_jax.eval import ablations, stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QA_DIR = os.path.join(ROOT, "..", "shared", "data", "nq_open")


def test_paired_bootstrap_equals_a_plain_loop_over_the_same_draws():
  rng = np.random.default_rng(5)
  n = 37
  tokens = rng.integers(1, 4, n).astype(float)
  a = np.minimum(tokens, rng.integers(0, 4, n))
  b = np.minimum(tokens, rng.integers(0, 3, n))
  diff, low, high = stats.paired_bootstrap(a, tokens, b, tokens, samples=2500, seed=3)
  draws = np.random.default_rng(3)
  want = []
  for lo in range(0, 2500, 1000):  # the same chunks of index draws
    idx = draws.integers(0, n, size=(min(1000, 2500 - lo), n))
    for row in idx:
      want.append(sum(a[i] for i in row) / sum(tokens[i] for i in row)
                  - sum(b[i] for i in row) / sum(tokens[i] for i in row))
  assert diff == pytest.approx(a.sum() / tokens.sum() - b.sum() / tokens.sum())
  assert low == pytest.approx(np.percentile(want, 2.5)) and high == pytest.approx(
      np.percentile(want, 97.5))
  assert low < diff < high
  # Identical systems differ by exactly nothing in every resample.
  assert stats.paired_bootstrap(a, tokens, a, tokens, 100) == (0.0, 0.0, 0.0)


def test_ratio_standard_error_by_hand():
  num, den = np.array([1.0, 0.0, 2.0, 1.0]), np.array([1.0, 2.0, 2.0, 1.0])
  r = 4.0 / 6.0
  want = math.sqrt(4 / 3 * sum((x - r * d) ** 2 for x, d in zip(num, den))) / 6.0
  assert stats.ratio_se(num, den) == pytest.approx((r, want))
  # With one unit per question (den 1) it is the usual binomial standard error times sqrt(E/(E-1)).
  hits = np.array([1.0, 0, 0, 1, 1, 0, 0, 0])
  assert stats.ratio_se(hits, np.ones(8))[1] == pytest.approx(
      math.sqrt(0.375 * 0.625 / 8 * 8 / 7))
  assert np.isnan(stats.ratio_se([1.0], [2.0])[1]) and np.isnan(stats.ratio_se([0.0], [0.0])[0])


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def test_each_variant_is_an_override_of_the_pretraining_config(tmp_path):
  config = ablations_config.get_config("demo")
  seen = {}
  for v in config.variants:
    c = ablations.pretrain_config(config, v, str(tmp_path))
    assert c.data_dir == str(tmp_path / "pretrain-data")  # all variants read the same data
    seen[v] = c
  default = seen["default"]
  assert (default.masking, default.null_document, default.index.refresh,
          default.retriever_learning_rate) == ("salient_spans", True, "sync", 1e-5)
  assert seen["random_tokens"].masking == "random_tokens"
  assert seen["random_spans"].masking == "random_spans"
  assert seen["stale_index"].index.refresh == "none"
  assert seen["no_null_document"].null_document is False
  assert seen["frozen_retriever"].retriever_learning_rate == 0.0
  for v, c in seen.items():  # nothing else differs
    a, b = _flat(c.to_dict()), _flat(default.to_dict())
    assert {k for k in a if a[k] != b[k]} == set(ablations_config.ABLATIONS[v]), v
  ft = ablations.finetune_config(config, "default", str(tmp_path))
  assert ft.init == str(tmp_path / "pretrain-default")
  assert ablations.finetune_config(config, "minilm", str(tmp_path)).init == ""


@pytest.mark.parametrize("field, value, match", [
    ("variants", ("random_tokens",), "must include 'default'"),
    ("variants", ("default", "no_retriever"), "unknown"),
    ("finetune_variants", ("minilm", "stale_index"), "not pre-trained here"),
    ("bootstrap_samples", 0, "bootstrap_samples"),
])
def test_bad_ablation_settings_are_refused_before_any_work(field, value, match, tmp_path):
  config = ablations_config.get_config("tiny")
  config[field] = value
  with pytest.raises(ValueError, match=match):
    ablations.run(config, str(tmp_path / "w"), pretrain=None, finetune=None)
  assert not (tmp_path / "w").exists()


def test_finetuning_init_reads_the_exports_of_a_pretraining_workdir(tmp_path):
  from realm_jax.configs import finetune
  from realm_jax.systems.open_qa import apply_init
  workdir = tmp_path / "pre"
  config = finetune.get_config("tiny")
  config.init = str(workdir)
  with pytest.raises(FileNotFoundError, match="has no exported retriever.*Finish it"):
    apply_init(config)
  for part in ("retriever", "encoder"):
    (workdir / "export" / part).mkdir(parents=True)
    (workdir / "export" / part / "config.json").write_text("{}")
  config.reader_weights = "/somewhere/else"
  with pytest.raises(ValueError, match="reader_weights=/somewhere/else and --config.init"):
    apply_init(config)
  config.reader_weights = "minilm"
  apply_init(config)
  assert config.retrieval.weights == str(workdir / "export" / "retriever")
  assert config.reader_weights == str(workdir / "export" / "encoder")
  apply_init(config)  # a config that went through it once (a resumed run's) is unchanged
  assert config.reader_weights == str(workdir / "export" / "encoder")


def _start_tiny(tmp_path_factory):
  """The tiny runner (~3 minutes on 2 cores), started with the session."""
  workdir = str(tmp_path_factory.mktemp("ablations"))
  proc = forked_runs.Popen(
      [sys.executable, "experiments/ablations.py", "--config=realm_jax/configs/ablations.py:tiny",
       f"--workdir={workdir}", f"--config.finetune.data.local_dir={QA_DIR}"],
      cwd=ROOT, env=one_device_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

  def finish():
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    return workdir, out
  return [proc], finish


EARLY = {"tiny_run": _start_tiny}


@pytest.fixture(scope="module")
def tiny_run(request):
  pytest.importorskip("tensorflow_datasets")
  if not os.path.isdir(QA_DIR):
    pytest.skip(f"needs {QA_DIR}")
  return started_early(request, _start_tiny)


@pytest.mark.slow
def test_tiny_runner_writes_the_table_from_what_the_runs_wrote(tiny_run):
  workdir, out = tiny_run
  with open(os.path.join(workdir, "ablations.json")) as f:
    table = json.load(f)
  assert list(table["pretrain"]) == ["default", "random_tokens"]
  with open(os.path.join(workdir, "pretrain-random_tokens", "config.json")) as f:
    assert json.load(f)["masking"] == "random_tokens"  # the override reached the run
  for v, row in table["pretrain"].items():  # recomputed from the per-sentence file
    with open(os.path.join(workdir, f"pretrain-{v}", "eval", "heldout-00000006.json")) as f:
      h = json.load(f)
    assert row["step"] == 6
    assert row["accuracy"] == pytest.approx(sum(h["correct"]) / sum(h["tokens"]))
    assert row["utility"] == pytest.approx(sum(h["utility"]) / sum(h["tokens"]))
  diff, low, high = table["pretrain"]["random_tokens"]["accuracy_vs_default"]
  assert diff == pytest.approx(table["pretrain"]["random_tokens"]["accuracy"]
                               - table["pretrain"]["default"]["accuracy"])
  assert low <= diff <= high
  ft = table["finetune"]["default"]
  with open(os.path.join(workdir, "finetune-default", "config.json")) as f:
    saved = json.load(f)
  assert saved["reader_weights"] == os.path.join(workdir, "pretrain-default", "export", "encoder")
  assert saved["retrieval"]["weights"] == os.path.join(workdir, "pretrain-default", "export",
                                                       "retriever")
  with open(os.path.join(workdir, "finetune-default", "eval", "test", "results.json")) as f:
    results = json.load(f)["finetuned"]
  assert ft["questions"] == results["count"] and ft["em"] == pytest.approx(results["em"])
  assert ft["recall_5"] == pytest.approx(results["recall"]["5"])
  assert set(table["seconds"]) == {"pretrain-default", "pretrain-random_tokens",
                                   "finetune-default", "evaluate-default"}
  with open(os.path.join(workdir, "ablations.md")) as f:
    md = f.read()
  assert "| random_tokens | 6 |" in md and "| default | " in md and md in out


def test_the_small_pretraining_config_is_the_demo_over_the_whole_corpus_for_longer():
  from realm_jax.configs import pretrain
  small, demo = _flat(pretrain.get_config("small").to_dict()), _flat(
      pretrain.get_config("demo").to_dict())
  assert {k for k in small if small[k] != demo[k]} == {
      "variant", "corpus.max_docs", "heldout_percent", "num_steps", "warmup_steps",
      "index.refresh_every", "eval_every", "checkpoint_every"}
  assert small["corpus.max_docs"] == 0 and small["num_steps"] == 5 * demo["num_steps"]


def test_the_small_ablations_pretrain_the_small_config_and_finetune_it_and_minilm(tmp_path):
  """ablations.py:small: the default pre-training of configs/pretrain.py:small, fine-tuned as
  wiki_vital; the MiniLM row is the same fine-tuning as the demo ablations' (so its work
  directory can be shared)."""
  from realm_jax.configs import ablations as ablations_config
  from realm_jax.configs import finetune, pretrain
  from realm_jax.eval import ablations
  config = ablations_config.get_config("small")
  ablations.check_config(config)
  assert config.variants == ("default",)
  assert config.finetune_variants == ("minilm", "default")
  assert _flat(ablations.pretrain_config(config, "default", str(tmp_path)).to_dict()) == _flat(
      {**pretrain.get_config("small").to_dict(), "data_dir": str(tmp_path / "pretrain-data")})
  demo = ablations_config.get_config("demo")
  minilm = ablations.finetune_config(config, "minilm", str(tmp_path)).to_dict()
  assert minilm == ablations.finetune_config(demo, "minilm", str(tmp_path)).to_dict()
  assert minilm == finetune.get_config("wiki_vital").to_dict()
  assert ablations.finetune_config(config, "default", str(tmp_path)).init == str(
      tmp_path / "pretrain-default")


@pytest.mark.slow
def test_the_table_leaves_out_what_has_not_run(tiny_run, tmp_path):
  """--table_only (and the runner after each stage) writes the finished stages only."""
  import shutil
  workdir = str(tmp_path / "copy")
  shutil.copytree(tiny_run[0], workdir)
  config = ablations_config.get_config("tiny")
  config.variants = ("default", "random_tokens", "stale_index")
  config.finetune_variants = ("minilm", "default")
  table = ablations.write_table(config, workdir)
  assert list(table["pretrain"]) == ["default", "random_tokens"]
  assert list(table["finetune"]) == ["default"] and "em_vs_minilm" not in table["finetune"]["default"]
  shutil.rmtree(os.path.join(workdir, "pretrain-default", "export"))  # as if still running
  table = ablations.write_table(config, workdir)
  assert list(table["pretrain"]) == ["random_tokens"]
  assert "accuracy_vs_default" not in table["pretrain"]["random_tokens"]
  with open(os.path.join(workdir, "ablations.md")) as f:
    assert "| random_tokens | 6 |" in f.read()
