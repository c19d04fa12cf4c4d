"""benchmarks/index_scale.py at a small size, as a user runs it: every step runs, the saved index
holds the shards' rows, exact search finds numpy's top k, and bad flags end in one `error:` line
with exit status 2."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, importorskip_scann, one_device_env

SCRIPT = os.path.join(ROOT, "benchmarks", "index_scale.py")


def load_script():
  spec = importlib.util.spec_from_file_location("index_scale", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_ids_are_unique_non_negative_and_not_row_numbers():
  ids = load_script().block_ids(200_000)
  assert ids.dtype == np.int64 and (ids >= 0).all() and len(np.unique(ids)) == len(ids)
  assert not (ids[1:] == ids[:-1] + 1).all()


@pytest.mark.slow
def test_every_step_at_a_small_size(tmp_path):
  importorskip_scann()
  out = subprocess.run(
      [sys.executable, SCRIPT, f"--workdir={tmp_path}", "--rows=3000", "--dim=16",
       "--clusters=20", "--shard_rows=1100", "--queries=40", "--query_batch_size=16",
       "--scann_leaves=30", "--scann_training=3000", "--scann_search=30:100,2:10"],
      env=one_device_env(), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  results = json.load(open(tmp_path / "results.json"))
  from realm_jax.retrieval.exact import brute_force_top_k
  from realm_jax.retrieval.index import DocIndex
  from realm_jax.retrieval.rows import read_all, safetensors_rows
  script = load_script()
  shards = sorted(p for p in os.listdir(tmp_path / "shards"))
  assert len(shards) == 3
  rows = np.concatenate([read_all(safetensors_rows(str(tmp_path / "shards" / p), "embeddings"))
                         for p in shards])
  saved = DocIndex.load(tmp_path / "index-float32")
  np.testing.assert_array_equal(saved.embeddings(), rows)
  np.testing.assert_array_equal(saved.block_ids, script.block_ids(3000))
  queries = read_all(safetensors_rows(str(tmp_path / "queries.safetensors"), "queries"))
  truth = script.block_ids(3000)[brute_force_top_k(queries, rows, 10)[1]]
  np.testing.assert_array_equal(np.load(tmp_path / "truth.npy"), truth)
  assert results["float32"]["search"]["recall"] == 1.0  # exact is exact
  for dtype in ("float32", "bfloat16"):
    for step in ("build", "save", "load"):
      m = results[dtype][step]
      assert m["seconds"] > 0 and m["peak"] >= m["before"] > 0
  runs = results["scann"]["scann"]["runs"]
  assert [(r["leaves_searched"], r["reordered"]) for r in runs] == [(30, 100), (2, 10)]
  assert runs[0]["recall"] == 1.0 > runs[1]["recall"]  # every leaf vs two of 30
  assert "| float32 | | numpy brute force (the reference)" in out.stdout
  # Run again: every step has its result, none runs.
  again = subprocess.run([sys.executable, SCRIPT, f"--workdir={tmp_path}", "--rows=3000",
                          "--dim=16", "--clusters=20", "--shard_rows=1100", "--queries=40"],
                         env=one_device_env(), capture_output=True, text=True, timeout=300)
  assert again.returncode == 0 and "ScaNN build (30 leaves" in again.stdout


@pytest.mark.parametrize("flags,says", [
    (["--rows=0"], "--rows=0"),
    (["--dtypes=float16"], "--dtypes=float16"),
    (["--scann_search=10"], "--scann_search"),
    (["--skip=everything"], "--skip=everything"),
    (["--rows=5", "--k=10"], "--k=10"),
])
def test_bad_flags(tmp_path, flags, says):
  out = subprocess.run([sys.executable, SCRIPT, f"--workdir={tmp_path}", *flags],
                       env=one_device_env(), capture_output=True, text=True, timeout=120)
  assert out.returncode == 2 and out.stderr.startswith("error: ") and says in out.stderr
  assert len(out.stderr.strip().splitlines()) == 1
  assert os.listdir(tmp_path) == []  # refused before anything is written
