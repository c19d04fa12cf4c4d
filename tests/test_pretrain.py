"""Pre-training end to end on the tiny config: a run killed with SIGKILL and resumed ends with
bit-identical parameters; the async refresher's interrupted writes are never loaded; bad input.

The runs start as a user starts them, on one CPU device: on the suite's 8 fake devices a tiny run
took ~34% longer (docs/notes.md, 2026-11-28). The sharded step is tested in test_train_step.py, and
a run over several devices and processes in test_multihost.py."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import forked_runs
from cli_forks import run_forked
from conftest import one_device_env, started_early

try:  # the tiny config reads the embedded corpus and the MiniLM vocabulary (the demo extra)
  from realm_jax.checkpoints.minilm import minilm_dir
  from realm_jax.data.wiki_vital import summaries_path
  summaries_path(), minilm_dir()
except Exception as e:  # noqa: BLE001
  pytest.skip(f"needs the demo extra: {e}", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "--config=realm_jax/configs/pretrain.py:tiny"


def run(workdir, data_dir, *extra, wait=True):
  cmd = [sys.executable, "experiments/pretrain.py", CONFIG, f"--workdir={workdir}",
         f"--config.data_dir={data_dir}", *extra]
  proc = forked_runs.Popen(cmd, cwd=ROOT, env=one_device_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
  if not wait:
    return proc
  out, _ = proc.communicate(timeout=600)
  return proc.returncode, out


def final_params(workdir, step):
  import orbax.checkpoint as ocp
  import jax
  state = ocp.StandardCheckpointer().restore(os.path.join(workdir, "checkpoints", str(step), "state"))
  return jax.tree_util.tree_leaves_with_path(state["params"])


def logged_steps(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line)["step"] for line in f if line.strip()]


def complete_checkpoints(workdir):
  """Steps of the finalised checkpoints (orbax renames a step's directory into place when done)."""
  root = os.path.join(workdir, "checkpoints")
  return sorted(int(d) for d in os.listdir(root) if d.isdigit()) if os.path.isdir(root) else []


def _start_uninterrupted(tmp_path_factory):
  """(the data directory, the work directory) of a tiny pre-training run (~30 s), which builds the
  data that every run here reads."""
  data_dir = str(tmp_path_factory.mktemp("data"))
  workdir = str(tmp_path_factory.mktemp("straight"))
  proc = run(workdir, data_dir, wait=False)

  def finish():
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return data_dir, workdir
  return [proc], finish


def _start_ablated(tmp_path_factory):
  """A tiny run with three ablations at once (its own data, in parallel with the first run):
  a frozen retriever, no null document and the index of the starting weights throughout."""
  data_dir = str(tmp_path_factory.mktemp("ablated_data"))
  workdir = str(tmp_path_factory.mktemp("ablated"))
  proc = run(workdir, data_dir, "--config.retriever_learning_rate=0", "--config.null_document=False",
             "--config.index.refresh=none", wait=False)

  def finish():
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return workdir
  return [proc], finish


EARLY = {"first_run": _start_uninterrupted,  # (conftest.py starts them with the session)
         "ablated": _start_ablated}


@pytest.fixture(scope="module")
def first_run(request):
  return started_early(request, _start_uninterrupted)


@pytest.fixture(scope="module")
def data_dir(first_run):
  return first_run[0]


@pytest.fixture(scope="module")
def ablated(request):
  return started_early(request, _start_ablated)


# The tests that read the tiny run are marked slow.
@pytest.fixture(scope="module")
def uninterrupted(first_run):
  return first_run[1]


@pytest.mark.slow
def test_a_second_run_on_a_held_workdir_is_refused_and_a_killed_run_resumes_bit_identically(
    tmp_path, data_dir, uninterrupted):
  """One run, two faults. A second run on its workdir (another learning rate) would interleave
  checkpoints, metrics.jsonl and config.json: it is refused with one `error:` line naming the
  first, which is stopped (SIGSTOP) once it holds the workdir, so the second certainly starts
  while the first holds it. Then the first is SIGKILLed after a random step and run again: it ends
  with the uninterrupted run's config, metrics rows, checkpoints and bit-identical parameters."""
  import socket
  workdir = tmp_path / "w"
  first = run(str(workdir), data_dir, wait=False)
  deadline = time.time() + 300
  while not (workdir / "config.json").exists():  # written once the run holds the workdir
    assert first.poll() is None, first.stdout.read()[-3000:]
    assert time.time() < deadline
    time.sleep(0.05)
  os.kill(first.pid, signal.SIGSTOP)
  try:
    code, out = run(str(workdir), data_dir, "--config.learning_rate=0.5")
  finally:
    os.kill(first.pid, signal.SIGCONT)
  errors = [line for line in out.splitlines() if line.startswith("error:")]
  assert code == 2 and len(errors) == 1 and "Traceback" not in out, out[-3000:]
  assert f"is in use by another run (process {first.pid} on {socket.gethostname()}, started " \
         in errors[0] and "experiments/pretrain.py" in errors[0], errors
  kill_after = random.Random().randint(1, 5)  # a random step of the 6
  while not any(s >= kill_after for s in logged_steps(workdir)):
    assert first.poll() is None, first.stdout.read()[-3000:]
    assert time.time() < deadline
    time.sleep(0.05)
  # Checkpoints are written every 2 steps, asynchronously: whether one is complete by now depends
  # on timing. One that is complete before the kill must be restored.
  saved = complete_checkpoints(workdir)
  first.send_signal(signal.SIGKILL)
  first.wait()
  assert max(logged_steps(workdir)) < 6, "the run finished before it was killed"
  code, out = run(str(workdir), data_dir)
  assert code == 0, out[-3000:]
  if saved:  # (a later one may have completed between the look and the kill)
    restored = [int(m) for m in re.findall(r"Restored step (\d+)", out)]
    assert restored and restored[0] >= max(saved), (saved, out[-3000:])
  assert json.loads((workdir / "config.json").read_text()) == json.loads(
      open(os.path.join(uninterrupted, "config.json")).read())
  timeless = lambda rows: [{k: v for k, v in r.items() if k != "examples_per_s"} for r in rows]
  assert timeless(read_rows(workdir)) == timeless(read_rows(uninterrupted))
  assert complete_checkpoints(workdir) == complete_checkpoints(uninterrupted)
  got, want = final_params(str(workdir), 6), final_params(uninterrupted, 6)
  assert [p for p, _ in got] == [p for p, _ in want]
  for (path, a), (_, b) in zip(got, want):
    np.testing.assert_array_equal(a, b, err_msg=f"{path} (killed after step {kill_after})")


@pytest.mark.slow
def test_every_logged_row_has_the_retrieval_diagnostics(uninterrupted):
  with open(os.path.join(uninterrupted, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  assert {r["split"] for r in rows} == {"train", "heldout"}
  for r in rows:  # fractions of examples whose masked span a retrieved block contains
    assert 0.0 <= r["span_in_candidates"] <= 1.0, r
    assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["null_accuracy"] <= 1.0, r


@pytest.mark.slow
def test_heldout_figures_per_sentence_add_up_to_the_logged_metrics(uninterrupted):
  """eval/heldout-SSSSSSSS.json: one entry per held-out sentence, the same sentences at every
  evaluation, summing to the logged held-out accuracy, null accuracy and utility."""
  with open(os.path.join(uninterrupted, "metrics.jsonl")) as f:
    logged = {r["step"]: r for r in map(json.loads, f) if r["split"] == "heldout"}
  assert sorted(logged) == [0, 3, 6]
  blocks = None
  for step, row in logged.items():
    with open(os.path.join(uninterrupted, "eval", f"heldout-{step:08d}.json")) as f:
      got = json.load(f)
    assert got["step"] == step and len(got["tokens"]) == 8  # eval_batches 1 x batch 8
    blocks = blocks or got["block_id"]
    assert got["block_id"] == blocks
    tokens = sum(got["tokens"])
    assert sum(got["correct"]) / tokens == pytest.approx(row["accuracy"], abs=1e-6)
    assert sum(got["null_correct"]) / tokens == pytest.approx(row["null_accuracy"], abs=1e-6)
    assert sum(got["utility"]) / tokens == pytest.approx(row["retrieval_utility"], abs=1e-5)
    assert np.mean(got["span_found"]) == pytest.approx(row["span_in_candidates"])


@pytest.mark.slow
def test_the_run_exports_its_retriever_and_encoder_as_loadable_hf_checkpoints(uninterrupted):
  """export/retriever and export/encoder hold the final parameters, read back by the one weights
  resolver as a REALM scorer and a knowledge-augmented encoder."""
  import jax
  from realm_jax.checkpoints import resolve
  final = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
           for path, v in final_params(uninterrupted, 6)}
  for part, kind in (("retriever", "retriever"), ("encoder", "encoder")):
    weights = resolve(os.path.join(uninterrupted, "export", part), flag="--test")
    assert weights.kind == kind and os.path.exists(weights.vocab())
    params, _ = weights.load(kind)
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
            for path, v in jax.tree_util.tree_leaves_with_path(params)}
    assert flat, part
    for key, value in flat.items():
      np.testing.assert_array_equal(value, final[f"{part}/{key}"], err_msg=key)


@pytest.mark.slow
def test_ablations_reach_the_run(ablated):
  """A frozen retriever ends where it started; without the null document it has no probability
  in any logged row; with refresh=none the one index is the starting weights' (staleness = step)."""
  first = {"/".join(map(str, p)): np.asarray(v) for p, v in final_params(ablated, 2)
           if "retriever" in str(p[0])}
  last = {"/".join(map(str, p)): np.asarray(v) for p, v in final_params(ablated, 6)
          if "retriever" in str(p[0])}
  assert first and all(np.array_equal(first[k], last[k]) for k in first)
  encoder = lambda step: [np.asarray(v) for p, v in final_params(ablated, step)
                          if "encoder" in str(p[0])]
  assert any(not np.array_equal(a, b) for a, b in zip(encoder(2), encoder(6)))
  with open(os.path.join(ablated, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  assert rows and all(r["null_doc_prob"] == 0.0 for r in rows)
  assert os.listdir(os.path.join(ablated, "index")) and sorted(
      d for d in os.listdir(os.path.join(ablated, "index")) if d.startswith("index-")) == [
          "index-00000000"]
  assert [r["index_staleness"] for r in rows if r["split"] == "train"] == [
      float(r["step"] - 1) for r in rows if r["split"] == "train"]


@pytest.mark.slow
def test_non_finite_steps_are_skipped_logged_and_stop_the_run(tmp_path, data_dir):
  """Peak rate 1e30: the first update at a non-zero rate (step 2; warmup 2) leaves huge finite
  parameters, then every loss overflows. Those steps are skipped and logged as such with no NaN
  statistics, and the second in a row stops the run with a clear error; the checkpoint of step 2
  stays."""
  workdir = str(tmp_path / "overflow")
  code, out = run(workdir, data_dir, "--config.learning_rate=1e30", "--config.max_bad_steps=2")
  assert code != 0 and "2 steps in a row had a non-finite loss (last at step 3)" in out, out[-3000:]
  assert "Step 2: non-finite loss or gradient; the update was skipped (1 in a row)" in out
  rows = [r for r in read_rows(workdir) if r["split"] == "train"]
  assert [r["step"] for r in rows] == [1, 2, 3] and [r["skipped"] for r in rows] == [0, 0, 1]
  assert "loss" in rows[1] and "loss" not in rows[2] and "grad_norm" not in rows[2]
  for r in rows:
    assert all(np.isfinite(v) for v in r.values() if isinstance(v, float)), r
  assert complete_checkpoints(workdir) == [2]


def read_rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
def test_old_indexes_go_but_not_those_the_checkpoints_name(tmp_path, data_dir, uninterrupted):
  """The tiny run refreshes at steps 0 and 3 and checkpoints at 2, 4 and 6, naming index 0 and
  index 3. Refreshed at every step with config.index.keep=1, each refresh deletes the indexes
  that are not the newest, the one in use or one a checkpoint names (1 at step 2, 3 at step 4):
  index 0 at step 2, index 2 at step 4; 4 was in use at the last refresh."""
  from realm_jax.checkpoints.training import indexes_in_use
  got = indexes_in_use(os.path.join(uninterrupted, "checkpoints"))
  assert {os.path.basename(p) for p in got} == {"index-00000000", "index-00000003"}
  workdir = str(tmp_path / "pruned")
  code, out = run(workdir, data_dir, "--config.index.refresh_every=1", "--config.index.keep=1")
  assert code == 0, out[-3000:]
  kept = sorted(p for p in os.listdir(os.path.join(workdir, "index")) if p.startswith("index-"))
  assert kept == ["index-00000001", "index-00000003", "index-00000004", "index-00000005"], out
  assert out.count("Deleted the index") == 2


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory, data_dir, uninterrupted):
  """{name: (exit status, output)} of the runs that end before training (done, or refused), in
  one process: tests/cli_forks.py forks each after the script's imports, one at a time (two of
  them share a work directory), instead of ~10 s of starting Python and JAX for each."""
  root = tmp_path_factory.mktemp("quick")
  runs = {
      "finished": (uninterrupted,),
      "other_config": (uninterrupted, "--config.max_masked=5"),
      "missing_corpus": (str(root / "w"), "--config.corpus.source=jsonl",
                         f"--config.corpus.paths=('{root / 'missing.jsonl'}',)"),
      "bad_searcher": (str(root / "w"), "--config.index.searcher=faiss"),
      "unknown_flag": (str(root / "w2"), "--config.no_such_setting=1"),
  }
  got = run_forked([("pretrain", [CONFIG, f"--workdir={workdir}", f"--config.data_dir={data_dir}",
                                  *extra]) for workdir, *extra in runs.values()],
                   one_device_env(), parallel=1)
  return {"root": root, **{name: (g.returncode, g.stdout + g.stderr) for name, g in zip(runs, got)}}


@pytest.mark.slow
def test_finished_run_does_nothing_and_other_config_is_refused(quick_runs):
  code, out = quick_runs["finished"]
  assert code == 0 and "Nothing to do" in out
  code, out = quick_runs["other_config"]
  assert code != 0 and "another config" in out and "max_masked" in out


def _documents(n):
  import itertools
  from realm_jax.data.sources import documents
  return [{"title": d["title"], "text": d["text"]}
          for d in itertools.islice(documents("wiki_vital"), n)]


def _write_jsonl(path, docs):
  with open(path, "w") as f:
    f.write("".join(json.dumps(d) + "\n" for d in docs))


def _start_on_files(tmp_path_factory):
  """A tiny run over 40 documents of a JSONL file, to step 4 (the corpus update test goes on)."""
  root = tmp_path_factory.mktemp("on_files")
  _write_jsonl(root / "docs.jsonl", _documents(40))
  proc = run(str(root / "w"), str(root / "data"), "--config.corpus.source=jsonl",
             f"--config.corpus.paths=('{root / 'docs.jsonl'}',)", "--config.num_steps=4",
             wait=False)

  def finish():
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return root
  return [proc], finish


EARLY["on_files"] = _start_on_files


@pytest.fixture(scope="module")
def on_files(request):
  return started_early(request, _start_on_files)


@pytest.mark.slow
def test_a_corpus_update_is_embedded_alone_and_the_run_goes_on(on_files):
  """Documents added (5), edited (2) and removed (2) between two parts of a run: resumed, it
  embeds only the new and edited blocks with the checkpoint's weights, keeps every other row of
  the index it resumed with, retrieves from the new blocks, and trains on as before on the
  sentences of the corpus it started with."""
  from realm_jax.configs import pretrain as pretrain_configs
  from realm_jax.data.corpus import Corpus, CorpusConfig
  from realm_jax.retrieval.index_store import index_path, latest_index_dir, read_arrays, read_manifest
  from realm_jax.train.init import build_models
  from realm_jax.train.refresh import DocumentEmbedder
  from realm_jax.train.refresher import read_retriever_params
  from realm_jax.text import BertTokenizer
  root, workdir = on_files, str(on_files / "w")
  index_root = os.path.join(workdir, "index")
  assert complete_checkpoints(workdir)[-1] == 4
  before = index_path(index_root, 3)  # the index the step-4 checkpoint trains with
  old_emb, old_ids = read_arrays(before, read_manifest(before))
  with open(os.path.join(workdir, "examples.json")) as f:
    record = json.load(f)

  docs = _documents(45)
  changed = docs[:38] + docs[40:45]  # 2 removed, 5 added
  for d in changed[:2]:
    d["text"] += " It was edited later."
  _write_jsonl(root / "docs.jsonl", changed)
  code, out = run(workdir, str(root / "data"), "--config.corpus.source=jsonl",
                  f"--config.corpus.paths=('{root / 'docs.jsonl'}',)", "--config.num_steps=6")
  assert code == 0, out[-3000:]

  config = pretrain_configs.get_config("tiny")
  config.corpus.source, config.corpus.paths = "jsonl", (str(root / "docs.jsonl"),)
  models, _, vocab = build_models(config)
  corpus = Corpus.build(os.path.join(root, "data", "corpus"),
                        CorpusConfig.from_config(config.corpus, vocab))
  kept = np.isin(corpus.block_ids, old_ids)
  new = np.flatnonzero(~kept)
  # Each edited or added document is at least one new block; nothing else is embedded.
  assert len(new) >= 7 and len(set(old_ids) - set(corpus.block_ids)) >= 4
  assert (f"Corpus update: embedded {len(new)} new blocks, reused {int(kept.sum())} "
          f"({len(old_ids) - int(kept.sum())} removed) of index-00000003") in out
  updated = index_path(index_root, 4)
  emb, ids = read_arrays(updated, read_manifest(updated))
  np.testing.assert_array_equal(ids, corpus.block_ids)
  assert read_manifest(updated)["corpus_fingerprint"] == corpus.fingerprint
  old_row = {int(b): i for i, b in enumerate(old_ids)}
  np.testing.assert_array_equal(  # reused as they were
      emb[kept], old_emb[[old_row[int(b)] for b in corpus.block_ids[kept]]])
  embedder = DocumentEmbedder(models, corpus, BertTokenizer(vocab), config.doc_length,
                              config.index.embed_batch_size)
  want = embedder(read_retriever_params(os.path.join(workdir, "checkpoints"), 4))
  np.testing.assert_allclose(emb[new], want[new], atol=1e-5)  # the checkpoint's weights

  # Trained on to step 6 over the new corpus, on the same sentences.
  assert complete_checkpoints(workdir)[-1] == 6 and logged_steps(workdir)[-1] == 6
  assert read_manifest(latest_index_dir(index_root))["corpus_fingerprint"] == corpus.fingerprint
  with open(os.path.join(workdir, "examples.json")) as f:
    assert json.load(f) == record and record["corpus_fingerprint"] != corpus.fingerprint
  assert "trains on the sentences of the corpus it started with" in out


def test_a_workdir_from_before_a_fixed_setting_existed_takes_its_old_value(tmp_path):
  """A config.json without retriever_learning_rate (a run made before it existed) was made with
  one learning rate for everything: resuming with the default is fine, with a separate retriever
  rate (another optimiser-state layout) refused."""
  from realm_jax.configs.pretrain import get_config
  from realm_jax.train.loop import check_workdir_config
  from realm_jax.train.pretrain_workdir import FIXED_SETTINGS
  config = get_config("tiny")
  check_workdir_config(config, str(tmp_path), FIXED_SETTINGS)
  saved = json.loads((tmp_path / "config.json").read_text())
  del saved["retriever_learning_rate"]
  (tmp_path / "config.json").write_text(json.dumps(saved))
  check_workdir_config(config, str(tmp_path), FIXED_SETTINGS)
  (tmp_path / "config.json").write_text(json.dumps(saved))
  config.retriever_learning_rate = 1e-4
  with pytest.raises(ValueError, match=r"another config \(retriever_learning_rate differ"):
    check_workdir_config(config, str(tmp_path), FIXED_SETTINGS)


def test_a_config_refused_for_a_typo_does_not_claim_the_workdir(quick_runs):
  """A missing corpus file or a bad index setting is refused before config.json is written, so
  the corrected command is not refused as 'a run made with another config'."""
  code, out = quick_runs["missing_corpus"]
  assert code != 0 and "missing.jsonl" in out, out[-3000:]
  code, out = quick_runs["bad_searcher"]
  assert code != 0 and "faiss" in out, out[-3000:]
  assert not (quick_runs["root"] / "w" / "config.json").exists()


def test_unknown_flag_is_refused(quick_runs):
  code, out = quick_runs["unknown_flag"]
  assert code != 0 and "no_such_setting" in out


@pytest.mark.slow
def test_interrupted_index_write_is_never_loaded(tmp_path, data_dir, uninterrupted):
  """What a refresher killed while writing leaves (a temporary directory, and an index directory
  without its arrays) is skipped: the watcher keeps the last complete index and says why not."""
  import shutil
  from realm_jax.retrieval.index_store import latest_index_dir
  root = str(tmp_path / "index")
  shutil.copytree(os.path.join(uninterrupted, "index"), root)
  complete = latest_index_dir(root)
  os.remove(os.path.join(root, "LATEST"))
  partial = os.path.join(root, ".tmp-index-00000099-abc")
  os.makedirs(partial)
  with open(os.path.join(partial, "index.safetensors"), "wb") as f:
    f.write(b"\0" * 100)
  half = os.path.join(root, "index-00000098")
  shutil.copytree(complete, half)
  os.remove(os.path.join(half, "index.safetensors"))
  assert latest_index_dir(root) == complete


def test_refresher_reads_a_checkpoint_saved_on_other_devices(tmp_path):
  """The refresher runs on other devices than the trainer (its own VM, or one GPU beside it): a
  checkpoint sharded over 2 devices reads in a process that has only one."""
  import jax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  from realm_jax.checkpoints import training as checkpoints
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  rng = np.random.default_rng(0)
  retriever = {"w": rng.standard_normal((4, 6)).astype(np.float32)}
  state = {"params": {"retriever": jax.device_put(retriever, NamedSharding(mesh, P("data"))),
                      "encoder": jax.device_put({"w": np.ones(3, np.float32)},
                                                NamedSharding(mesh, P()))},
           "step": jax.device_put(np.int32(5), NamedSharding(mesh, P()))}
  manager = checkpoints.checkpoint_manager(str(tmp_path), data=False)
  checkpoints.save(manager, 5, state, {"step": 5})
  manager.wait_until_finished()
  code = ("import json, jax; from realm_jax.train.refresher import read_retriever_params; "
          f"w = read_retriever_params({str(tmp_path)!r}, 5)['w']; "
          "print(jax.device_count(), json.dumps(w.tolist()))")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=one_device_env(),
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  devices, values = out.stdout.strip().splitlines()[-1].split(" ", 1)
  assert devices == "1"
  np.testing.assert_array_equal(np.array(json.loads(values), np.float32), retriever["w"])


def test_refresher_never_reads_a_retriever_of_other_bytes_than_were_saved(tmp_path):
  """A retriever array that reads other bytes than were saved (its CRC-32 in the meta made to
  differ, as a flipped byte on disk would) is refused by the refresher's read, naming the
  checkpoint and the array (the refresher then indexes nothing from it)."""
  import jax
  from realm_jax.checkpoints import training as checkpoints
  from realm_jax.train import refresher
  rng = np.random.default_rng(0)
  state = {"params": {"retriever": {"w": rng.standard_normal((4, 6)).astype(np.float32)},
                      "encoder": {"w": np.ones(3, np.float32)}}, "step": np.int32(5)}
  manager = checkpoints.checkpoint_manager(str(tmp_path), data=False)
  checkpoints.save(manager, 5, jax.device_put(state), {"step": 5})
  manager.wait_until_finished()
  np.testing.assert_array_equal(refresher.read_retriever_params(str(tmp_path), 5)["w"],
                                state["params"]["retriever"]["w"])
  meta_path = tmp_path / "5" / "meta" / "metadata"
  meta = json.loads(meta_path.read_text())
  crc = meta[checkpoints.CRC_KEY]["params/retriever/w"]
  meta[checkpoints.CRC_KEY]["params/retriever/w"] = f"{int(crc, 16) ^ 1:08x}"
  meta_path.write_text(json.dumps(meta))
  with pytest.raises(refresher.DamagedCheckpointError,
                     match=rf"Checkpoint 5 in {tmp_path} is damaged: 1 of its arrays read other "
                           r"bytes than were saved, by the CRC-32 recorded then \(params/"
                           r"retriever/w\)"):
    refresher.read_retriever_params(str(tmp_path), 5)


@pytest.mark.slow
def test_refresher_killed_midway_then_trainer_picks_up_complete_indexes(tmp_path, data_dir,
                                                                         uninterrupted):
  """The real thing: kill the refresher process at a random moment, check no partial index is
  visible, then let it finish and check the published index matches the checkpoint's weights."""
  import shutil
  from realm_jax.retrieval.index_store import latest_index_dir, read_manifest
  workdir = str(tmp_path / "w")
  shutil.copytree(uninterrupted, workdir)
  shutil.rmtree(os.path.join(workdir, "index"))
  cmd = [sys.executable, "experiments/refresh_index.py", CONFIG, f"--workdir={workdir}",
         f"--config.data_dir={data_dir}", "--poll_seconds=0.1", "--stop_after_idle_s=1"]
  proc = forked_runs.Popen(cmd, cwd=ROOT, env=one_device_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
  time.sleep(random.uniform(3, 8))
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  found = latest_index_dir(os.path.join(workdir, "index"))
  if found is not None:  # it got as far as publishing: then the index is whole
    assert read_manifest(found)["count"] > 0
  out = forked_runs.run(cmd, cwd=ROOT, env=one_device_env(), capture_output=True, text=True,
                        timeout=600)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  found = latest_index_dir(os.path.join(workdir, "index"))
  assert found is not None and found.endswith("index-00000006")


def test_refresher_refuses_a_workdir_no_trainer_runs_in(tmp_path, monkeypatch):
  """experiments/refresh_index.py on a new or misspelt --workdir built data/ there, then waited
  silently forever: refused, naming the flag, once no trainer wrote its config.json in the grace
  time (0 here), with nothing built."""
  from realm_jax.configs.pretrain import get_config
  from realm_jax.train import refresher
  monkeypatch.setattr(refresher, "CONFIG_WAIT_S", 0.0, raising=False)
  workdir = tmp_path / "pretrian_demo"
  with pytest.raises(FileNotFoundError, match=rf"--workdir={re.escape(str(workdir))}: no "
                     r"pre-training run there .*Start experiments/pretrain.py with the same flags"):
    refresher.run_refresher(get_config("tiny"), str(workdir), poll_seconds=0, stop_after_idle_s=0)
  assert not workdir.exists()


def test_refresher_waits_for_a_starting_trainer_and_says_what_it_waits_for(tmp_path, data_dir,
                                                                          monkeypatch, caplog):
  """Started together with its trainer, the refresher waits for the trainer's config.json, saying
  so; then, while no checkpoint comes, it says what it waits for and where: once, and again every
  REMIND_EVERY_S, not at each poll."""
  import logging
  import threading
  from realm_jax.configs.pretrain import get_config
  from realm_jax.io_utils import write_json
  from realm_jax.train import refresher
  config = get_config("tiny")
  config.data_dir = data_dir
  workdir = tmp_path / "w"
  monkeypatch.setattr(refresher, "CONFIG_WAIT_S", 120.0, raising=False)
  monkeypatch.setattr(refresher, "REMIND_EVERY_S", 3600.0, raising=False)
  trainer = threading.Timer(1.0, lambda: write_json(workdir / "config.json",
                                                   json.loads(config.to_json())))
  trainer.start()
  caplog.set_level(logging.INFO)
  try:
    assert refresher.run_refresher(config, str(workdir), poll_seconds=0.01,
                                   stop_after_idle_s=1.0) == 0
  finally:
    trainer.cancel()
  said = [r.getMessage() for r in caplog.records]
  assert any(m.startswith(f"No trainer config {workdir}/config.json yet: waiting up to 120 s")
             for m in said), said
  waiting = f"Waiting for the trainer's first checkpoint in {workdir}/checkpoints (none yet"
  assert [m for m in said if m.startswith("Waiting for")] == [
      f"{waiting}; the trainer saves one every {config.checkpoint_every} steps)."]  # ~100 polls
  caplog.clear()
  monkeypatch.setattr(refresher, "REMIND_EVERY_S", 0.05)
  refresher.run_refresher(config, str(workdir), poll_seconds=0.01, stop_after_idle_s=1.0)
  assert len([r for r in caplog.records if r.getMessage().startswith(waiting)]) >= 2


@pytest.mark.slow
def test_watcher_keeps_the_current_index_when_a_new_one_is_corrupt(tmp_path, data_dir,
                                                                   uninterrupted, caplog):
  """An index directory that looks complete but whose arrays are damaged: the trainer's watcher
  logs that it cannot load it and keeps training on the current one."""
  import shutil
  from realm_jax.configs.pretrain import get_config
  from realm_jax.train.pretrain_workdir import open_data
  from realm_jax.train.init import build_models
  from realm_jax.train.refresh import AsyncIndexWatcher
  config = get_config("tiny")
  config.data_dir = data_dir
  _, _, vocab = build_models(config)
  corpus, _, _ = open_data(config, str(tmp_path), vocab)
  root = str(tmp_path / "index")
  shutil.copytree(os.path.join(uninterrupted, "index"), root)
  from realm_jax.retrieval.index_store import latest_index_dir
  current = latest_index_dir(root)
  bad = os.path.join(root, "index-00000009")
  shutil.copytree(current, bad)
  with open(os.path.join(bad, "index.safetensors"), "r+b") as f:
    f.truncate(50)
  with open(os.path.join(root, "LATEST"), "w") as f:  # published, as far as LATEST says
    json.dump({"directory": "index-00000009", "step": 9}, f)
  watcher = AsyncIndexWatcher(root, corpus, 16, {}, current)
  got = watcher.poll()
  deadline = time.time() + 60
  while got is None and watcher._pending is not None and time.time() < deadline:
    time.sleep(0.05)
    got = watcher.poll()
  assert got is None and watcher.current_path == current
  assert "Could not load the index" in caplog.text and "index-00000009" in caplog.text
  assert watcher.poll() is None and watcher._pending is None  # not retried in a loop
  watcher.close()


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_later_indexes_are_not_used(
    tmp_path, data_dir, uninterrupted):
  """The run stopped after publishing index 3, its checkpoint of step 4 lost and a data file
  deleted inside the newest (6): the run warns, naming 6, moves it to checkpoints-damaged/ (kept,
  out of orbax's sight) and resumes from step 2 with index 0 (the one that checkpoint names),
  points LATEST back at it and says so; it republishes step 3 as it gets there, saves 4 and 6
  afresh and ends with the uninterrupted parameters and metrics rows."""
  import shutil
  from realm_jax.retrieval.index_store import latest_index_dir
  workdir = tmp_path / "w"
  shutil.copytree(uninterrupted, workdir)
  shutil.rmtree(workdir / "checkpoints" / "4")
  state = workdir / "checkpoints" / "6" / "state"
  biggest = max((p for p in state.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  biggest.unlink()  # the array data (MBs of embeddings)
  assert os.path.basename(latest_index_dir(workdir / "index")) == "index-00000003"
  code, out = run(str(workdir), data_dir)
  assert code == 0, out[-3000:]
  aside = list((workdir / "checkpoints-damaged").iterdir())
  assert [p.name.split("-")[0] for p in aside] == ["6"]
  assert re.search(rf"The checkpoint {workdir}/checkpoints/6 is damaged \(.+\): step 2 is used "
                   rf"instead; it is kept at {aside[0]} ", out), out[-3000:]
  assert re.findall(r"Restored step (\d+)", out) == ["2"]
  assert not (aside[0] / biggest.relative_to(workdir / "checkpoints" / "6")).exists()
  assert (aside[0] / "meta" / "metadata").exists()  # the rest of it is still there
  assert re.search(r"Resumed at step 2 with the index index-00000000; index-00000003 in \S+ were "
                   r"published after the checkpoint and are not used \(LATEST now names "
                   r"index-00000000 again", out), out[-3000:]
  assert "Index refreshed at step 3" in out
  assert os.path.basename(latest_index_dir(workdir / "index")) == "index-00000003"
  assert complete_checkpoints(workdir) == complete_checkpoints(uninterrupted)
  # The rows the stopped run logged after step 2 were replaced, not repeated.
  key = lambda r: (r["step"], r["split"], r.get("loss"))
  assert [key(r) for r in read_rows(workdir)] == [key(r) for r in read_rows(uninterrupted)]
  got, want = final_params(str(workdir), 6), final_params(uninterrupted, 6)
  for (path, a), (_, b) in zip(got, want):
    np.testing.assert_array_equal(a, b, err_msg=str(path))


# TensorStore's reads that end after a failed restore call back into orbax's closed event loop;
# restore_latest drops that noise, but pytest puts its own unraisablehook back at each test phase.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_restore_tells_damaged_checkpoints_from_another_model(tmp_path, caplog):
  """Damaged checkpoints are passed over (a reader leaves them where they are); none left that
  reads is one error naming the directory, changing nothing; a checkpoint of another model is
  the error it always was, even behind a damaged one, never passed over."""
  import jax
  import jax.numpy as jnp
  from realm_jax.checkpoints import training as checkpoints
  directory = tmp_path / "checkpoints"
  state = {"params": {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4)},
           "step": jnp.zeros((), jnp.int32)}
  manager = checkpoints.checkpoint_manager(str(directory), asynchronous=False, data=False)
  for step in (2, 4, 6):
    checkpoints.save(manager, step, jax.tree.map(lambda x, s=step: x + s, state), {"step": step})

  def damage(step):
    for f in (directory / str(step) / "state").rglob("*"):
      if f.is_file() and f.parent.name == "d":
        f.unlink()

  damage(6)
  got, meta = checkpoints.restore_latest(manager, state, set_aside=False)
  assert meta == {"step": 4} and float(got["params"]["w"][0, 0]) == 4.0
  assert f"The checkpoint {directory}/6 is damaged" in caplog.text
  assert "step 4 is used instead; it is left as it is" in caplog.text
  other = {**state, "params": {"w": jnp.zeros((3, 5)), "b": jnp.ones(4)}}
  with pytest.raises(ValueError, match=rf"checkpoint at {directory}/4 does not fit this run's "
                     r"model \(params/w is \(3, 4\) there, \(3, 5\) here\)"):
    checkpoints.restore_latest(manager, other)
  damage(4)
  damage(2)
  with pytest.raises(ValueError, match=rf"No checkpoint in {directory} can be read \(step 6: "
                     r".+; step 4: .+; step 2: .+\)\. Nothing was changed\. Restore "):
    checkpoints.restore_latest(manager, state)
  assert sorted(os.listdir(directory)) == ["2", "4", "6"]
  assert not (tmp_path / "checkpoints-damaged").exists()
