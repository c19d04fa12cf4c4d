"""kNN-LM (models/knnlm.py, retrieval/datastore.py, eval/knnlm.py, experiments/knnlm_eval.py):
p_kNN through the datastore's search equals a brute-force numpy computation; the interpolation
equals the formula by hand, edge cases exactly; the datastore of a tiny decoder holds one entry
per scored train token whose key is the decoder's hidden state there; an interrupted build
resumes to the same arrays, another model's datastore is refused; the evaluation's figures equal
a recomputation by hand; the script's mistakes are one `error:` line.

The decoders are tiny RetroModels with random parameters, exported as training exports them, over
the tiny chunk database (built once, ~5 s).
"""

import math
import os
import shutil

import jax
import numpy as np
import pytest
from cli_forks import run_forked
from conftest import importorskip_scann, jit_init, one_device_env

from realm_jax.checkpoints import retro_export
from realm_jax.checkpoints.decoder import is_decoder_param
from realm_jax.configs.retro import get_config
from realm_jax.eval import knnlm as knnlm_eval
from realm_jax.models.knnlm import interpolate, knn_log_prob, knn_probs
from realm_jax.models.retro import RetroModel
from realm_jax.retrieval import datastore as ds
from realm_jax.retrieval.chunk_db import build_database
from realm_jax.retrieval.index import DocIndex
from realm_jax.train.retro import model_config

LN2 = math.log(2.0)


# ------------------------------------------------------------------ p_kNN and the interpolation

def _brute_force_p_knn(keys, values, queries, k, vocab, temperature):
  """p_kNN [Q, V] in float64: every distance, a full sort, the softmax of the k nearest, summed
  per token."""
  keys, queries = keys.astype(np.float64), queries.astype(np.float64)
  d = ((queries[:, None, :] - keys[None, :, :]) ** 2).sum(-1)        # [Q, N]
  order = np.argsort(d, axis=1, kind="stable")
  p = np.zeros((len(queries), vocab))
  gaps = []
  for i in range(len(queries)):
    near = order[i, :k]
    gaps.append(d[i, order[i, k]] - d[i, near[-1]])
    w = np.exp(-(d[i, near] - d[i, near].min()) / temperature)
    w /= w.sum()
    for weight, j in zip(w, near):
      p[i, values[j]] += weight
  return p, np.array(gaps)


@pytest.mark.parametrize("searcher,options", [
    ("exact", {}),
    # Slow: importing ScaNN loads TensorFlow (~10 s on 2 cores).
    pytest.param("scann", {"reorder_num_neighbors": 300}, marks=pytest.mark.slow)])
def test_p_knn_through_the_datastore_equals_brute_force(searcher, options):
  """On 8 fake devices (exact: the keys sharded) and with ScaNN (all 300 rows re-scored)."""
  if searcher == "scann":
    importorskip_scann()
  rng = np.random.default_rng(0)
  n, h, q, k, vocab = 300, 8, 12, 24, 20
  keys = rng.normal(size=(n, h)).astype(np.float32)
  values = rng.integers(0, vocab, n).astype(np.int32)
  queries = rng.normal(size=(q, h)).astype(np.float32)
  index = DocIndex(ds.augment_keys(keys), np.arange(n), searcher=searcher, **options)
  store = ds.Datastore(index, values, {"count": n, "dim": h})
  distances, got_values = store.search(queries, k)
  for temperature in (1.0, 3.0):
    want, gaps = _brute_force_p_knn(keys, values, queries, k, vocab, temperature)
    assert gaps.min() > 1e-3   # no near tie at the k-th neighbour: the same k on any CPU
    got = np.asarray(knn_probs(distances, got_values, vocab, temperature))
    np.testing.assert_allclose(got, want, atol=2e-6)
    np.testing.assert_allclose(got.sum(1), 1.0, atol=1e-5)
    targets = rng.integers(0, vocab, q)
    with np.errstate(divide="ignore"):
      np.testing.assert_allclose(
          np.asarray(knn_log_prob(distances, got_values, targets, temperature)),
          np.log(want[np.arange(q), targets]), atol=1e-5)
  # The distances are the exact squared L2 distances of the neighbours found, nearest first.
  exact = ((queries[:, None] - keys[None]) ** 2).sum(-1)
  assert np.all(np.diff(distances, axis=1) >= -1e-5)
  np.testing.assert_allclose(distances, np.sort(exact, axis=1)[:, :k], rtol=1e-5, atol=1e-5)


def test_a_target_no_neighbour_holds_has_log_probability_minus_infinity():
  got = knn_log_prob(np.array([[0.0, 1.0]]), np.array([[3, 4]]), np.array([5]))
  assert np.isneginf(np.asarray(got)).all()
  # A far-away target keeps a finite log-probability (summed in log space, no underflow).
  far = knn_log_prob(np.array([[0.0, 300.0]]), np.array([[3, 4]]), np.array([4]))
  np.testing.assert_allclose(np.asarray(far), [-300.0], rtol=1e-6)


def test_interpolation_equals_the_formula_by_hand():
  rng = np.random.default_rng(1)
  log_lm = np.log(rng.uniform(1e-4, 1, 50)).astype(np.float32)
  log_knn = np.log(rng.uniform(1e-4, 1, 50)).astype(np.float32)
  log_knn[::7] = -np.inf   # p_kNN = 0: no neighbour holds the target
  for lam in (0.05, 0.25, 0.5, 0.95):
    with np.errstate(divide="ignore"):
      want = np.log(lam * np.exp(log_knn.astype(np.float64))
                    + (1 - lam) * np.exp(log_lm.astype(np.float64)))
    got = np.asarray(interpolate(log_lm, log_knn, lam))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(knnlm_eval.interpolated_nll(-log_lm.astype(np.float64), log_knn,
                                                           lam), -want, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(interpolate(log_lm, log_knn, 0.0)), log_lm)
  np.testing.assert_array_equal(np.asarray(interpolate(log_lm, log_knn, 1.0)), log_knn)
  with pytest.raises(ValueError, match="between 0 and 1"):
    interpolate(log_lm, log_knn, 1.5)


# ---------------------------------------------------------------------------- the tiny decoders

@pytest.fixture(scope="module")
def db(tmp_path_factory):
  from realm_jax.checkpoints import minilm_dir
  try:
    minilm_dir()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  return build_database(get_config("tiny").db, str(tmp_path_factory.mktemp("knnlm") / "db"))


@pytest.fixture(scope="module")
def exports(db, tmp_path_factory):
  """{"retro": dir, "baseline": dir}: tiny decoders with random parameters, exported."""
  root = tmp_path_factory.mktemp("exports")
  out = {}
  for seed, name in enumerate(("retro", "baseline")):
    config = model_config(get_config("tiny"), db, retrieval=name == "retro")
    seq = db.read_sequence("train", 0)
    params = jit_init(RetroModel(config), seed, seq["inputs"][None],
                      seq["neighbours"][None, :, :config.num_neighbours])
    out[name] = str(root / name / "export")
    retro_export.save(out[name], config, jax.device_get(params), {
        "step": 0, "tokenizer": db.tokenizer.name, "key_fingerprint": db.key_fingerprint,
        "db_fingerprint": db.fingerprint, "retrieval": name == "retro"})
  return out


def _load(export):
  config, params, _ = retro_export.load(export)
  return config, params


@pytest.fixture(scope="module")
def retro_store(db, exports, tmp_path_factory):
  """The RETRO decoder's datastore, built in one go (shards of 16 sequences)."""
  directory = str(tmp_path_factory.mktemp("stores") / "retro")
  manifest = ds.build_datastore(*_load(exports["retro"]), db, directory, source=exports["retro"],
                                shard_size=16)
  return directory, manifest


def test_one_entry_per_scored_train_token_keyed_by_the_hidden_state(db, exports, retro_store):
  directory, manifest = retro_store
  config, params = _load(exports["retro"])
  places = [(s, t) for s in range(db.num_sequences("train"))
            for t in np.flatnonzero(db.read_sequence("train", s)["target_docs"] >= 0)]
  assert manifest["count"] == len(places) == ds.num_entries(db) and not manifest["reused"]
  store = ds.Datastore.open(directory)
  augmented = np.asarray(store.index.embeddings())
  keys = augmented[:, :config.hidden_size]
  np.testing.assert_allclose(augmented[:, -1], (keys ** 2).sum(1), rtol=1e-5)
  module = RetroModel(config)
  for i in np.random.default_rng(0).choice(len(places), 6, replace=False):
    s, t = places[i]
    seq = db.read_sequence("train", s)
    nb, segments = seq["neighbours"][None, :, :config.num_neighbours], seq["input_docs"][None]
    _, hidden = module.apply({"params": params}, seq["inputs"][None], nb, return_hidden=True,
                             segments=segments)
    np.testing.assert_allclose(keys[i], np.asarray(hidden)[0, t], rtol=1e-5, atol=1e-5)
    assert store.values[i] == seq["targets"][t]
    if t >= db.chunk_length:   # past the first chunk the neighbours count: the key is RETRO's own
      _, alone = module.apply({"params": params}, seq["inputs"][None], None, return_hidden=True,
                              segments=segments)
      assert np.abs(np.asarray(alone)[0, t] - keys[i]).max() > 1e-4


def test_an_interrupted_build_resumes_to_the_same_arrays(db, exports, retro_store, tmp_path,
                                                         monkeypatch):
  directory = str(tmp_path / "retro")
  config, params = _load(exports["retro"])
  real, calls = ds._train_batch, []

  def stop_after_the_first_shard(db_, lo, *args):
    calls.append(lo)
    if lo >= 16:
      raise KeyboardInterrupt   # as a killed run: the first shard is written, nothing else
    return real(db_, lo, *args)

  monkeypatch.setattr(ds, "_train_batch", stop_after_the_first_shard)
  with pytest.raises(KeyboardInterrupt):
    ds.build_datastore(config, params, db, directory, shard_size=16)
  shards = sorted(os.listdir(os.path.join(directory, "shards")))
  assert len(shards) == 1 and not os.path.exists(os.path.join(directory, ds.MANIFEST))
  with pytest.raises(ValueError, match="other settings: batch_size=8 \\(now 4\\)"):
    ds.build_datastore(config, params, db, directory, shard_size=16, batch_size=4)
  with open(os.path.join(directory, "shards", ".tmp-shard-x"), "w") as f:
    f.write("half a shard a killed write left")
  calls.clear()
  monkeypatch.setattr(ds, "_train_batch", real)
  manifest = ds.build_datastore(config, params, db, directory, shard_size=16)
  assert manifest["count"] == retro_store[1]["count"]
  once, resumed = ds.Datastore.open(retro_store[0]), ds.Datastore.open(directory)
  np.testing.assert_array_equal(np.asarray(resumed.index.embeddings()),
                                np.asarray(once.index.embeddings()))
  np.testing.assert_array_equal(resumed.values, once.values)
  assert not os.path.exists(os.path.join(directory, "shards"))   # gone once complete
  again = ds.build_datastore(config, params, db, directory, shard_size=16)
  assert again["reused"] and again["count"] == manifest["count"]


def test_the_datastore_of_another_model_is_refused(db, exports, retro_store):
  directory, manifest = retro_store
  config, params = _load(exports["baseline"])
  with pytest.raises(ValueError, match="another model or database") as e:
    ds.build_datastore(config, params, db, directory, source=exports["baseline"], shard_size=16)
  said = str(e.value)
  assert manifest["model_fingerprint"] in said and ds.model_fingerprint(config, params) in said
  assert exports["baseline"] in said and "--datastore_dir" in said
  with pytest.raises(ValueError, match="other settings: dtype='float32' \\(now 'bfloat16'\\)"):
    ds.build_datastore(*_load(exports["retro"]), db, directory, shard_size=16, dtype="bfloat16")
  # Complete: how its batches and shards were cut no longer matters.
  assert ds.build_datastore(*_load(exports["retro"]), db, directory, batch_size=4)["reused"]
  with pytest.raises(ValueError, match="model_fingerprint"):
    ds.Datastore.open(directory, model_fingerprint=ds.model_fingerprint(config, params))


def test_a_damaged_datastore_says_to_build_the_datastore_again(db, exports, retro_store, tmp_path):
  """Not build_index.py's advice (REALM's block indexes): the datastore's own."""
  directory = str(tmp_path / "copy")
  shutil.copytree(retro_store[0], directory)
  arrays = os.path.join(directory, "index", "index.safetensors")
  data = open(arrays, "rb").read()
  with open(arrays, "wb") as f:
    f.write(data[:-8] + bytes(b ^ 0xFF for b in data[-8:]))
  with pytest.raises(ValueError, match="is corrupt") as e:
    ds.Datastore.open(directory)
  assert f"Delete {directory} and build the datastore again" in str(e.value)
  assert "build_index" not in str(e.value)


# ------------------------------------------------------------------------------ the evaluation

def test_the_evaluation_equals_a_recomputation_by_hand(db, exports, tmp_path):
  """Held-out scores of the baseline; lambda the grid's best on the dev documents; the test
  half's bits per byte and perplexity from the per-token figures by hand."""
  config, params = _load(exports["baseline"])
  directory = str(tmp_path / "baseline")
  ds.build_datastore(config, params, db, directory)
  store = ds.Datastore.open(directory)
  k, temps, lambdas = 8, (1.0, 10.0), (0.0, 0.25, 0.5, 1.0)
  scores = knnlm_eval.score_heldout(config, params, store, db, k=k, temperatures=temps)
  docs = db.documents("heldout")
  assert len(scores["nll"]) == sum(d["tokens"] for d in docs)
  assert np.bincount(scores["doc"], minlength=len(docs)).tolist() == [d["tokens"] for d in docs]
  # The first held-out sequence by hand: its nll, and p_kNN from its own search.
  seq = db.read_sequence("heldout", 0)
  scored = seq["target_docs"] >= 0
  logits, hidden = RetroModel(config).apply({"params": params}, seq["inputs"][None], None,
                                            return_hidden=True, segments=seq["input_docs"][None])
  logp = jax.nn.log_softmax(np.asarray(logits)[0], -1)
  n = int(scored.sum())
  np.testing.assert_allclose(scores["nll"][:n], -np.asarray(logp)[scored, seq["targets"][scored]],
                             rtol=1e-5)
  d, v = store.search(np.asarray(hidden)[0][scored], k)
  w = np.exp(-d / 10.0) / np.exp(-d / 10.0).sum(1, keepdims=True)
  with np.errstate(divide="ignore"):
    want = np.log((w * (v == seq["targets"][scored][:, None])).sum(1))
  np.testing.assert_allclose(scores["log_knn"][:n, 1], want, rtol=1e-5, atol=1e-5)

  dev = knnlm_eval.dev_documents(docs)
  assert 0 < dev.sum() < len(docs)
  got = knnlm_eval.report_model(scores, docs, dev, lambdas, temps)
  on_dev = dev[scores["doc"]]

  def nll_at(lam, t, mask):
    lm, kn = scores["nll"][mask], scores["log_knn"][mask, t]
    with np.errstate(divide="ignore", over="ignore"):
      return -np.log(lam * np.exp(kn) + (1 - lam) * np.exp(-lm))
  grid = {(lam, temps[t]): nll_at(lam, t, on_dev).mean() for t in range(2) for lam in lambdas}
  assert (got["lambda"], got["temperature"]) == min(grid, key=grid.get)
  t_best = temps.index(got["temperature"])
  test = ~on_dev
  test_bytes = sum(d["bytes"] for d, is_dev in zip(docs, dev) if not is_dev)
  alone, inter = scores["nll"][test], nll_at(got["lambda"], t_best, test)
  report = got["test"]
  assert report["tokens"] == test.sum() and report["bytes"] == test_bytes
  np.testing.assert_allclose(report["alone"]["bits_per_byte"], alone.sum() / LN2 / test_bytes,
                             rtol=1e-9)
  np.testing.assert_allclose(report["knnlm"]["bits_per_byte"], inter.sum() / LN2 / test_bytes,
                             rtol=1e-6)
  np.testing.assert_allclose(report["knnlm"]["perplexity"], np.exp(inter.mean()), rtol=1e-6)
  np.testing.assert_allclose(report["difference"]["bits_per_byte"],
                             (inter.sum() - alone.sum()) / LN2 / test_bytes, rtol=1e-6, atol=1e-9)
  assert report["alone"]["se"] > 0 and report["difference"]["se"] >= 0


def test_the_decoder_memory_is_the_retro_decoder_without_its_neighbours(db, exports, retro_store,
                                                                         tmp_path):
  """decoder_memory: the RETRO export's datastore keys are its states with the CCA skipped (its
  own fingerprint, not the one of the keys with neighbours, and the same for another RETRO
  decoder with the same decoder weights); it is reported twice, and the
  paired difference RETRO + kNN-LM - RETRO without neighbours is the two rows' difference."""
  config, params = _load(exports["retro"])
  directory, out = str(tmp_path / "memory"), str(tmp_path / "out")
  report = knnlm_eval.evaluate_knnlm({"retro": exports["retro"]}, db, out,
                                     datastore_dirs={"retro": directory}, k=8,
                                     lambdas=(0.0, 0.5), decoder_memory=True)
  store = ds.Datastore.open(directory)
  assert store.manifest["model_fingerprint"] == ds.model_fingerprint(config, params, False)
  assert store.manifest["model_fingerprint"] != retro_store[1]["model_fingerprint"]
  other_cca = jax.tree_util.tree_map_with_path(
      lambda path, x: x if is_decoder_param(path) else x + 1, params)
  assert ds.model_fingerprint(config, other_cca, False) == store.manifest["model_fingerprint"]
  assert ds.model_fingerprint(config, other_cca) != ds.model_fingerprint(config, params)
  keys = np.asarray(store.index.embeddings())[:, :config.hidden_size]
  seq = db.read_sequence("train", 0)
  scored = seq["target_docs"] >= 0
  _, alone = RetroModel(config).apply({"params": params}, seq["inputs"][None], None,
                                      return_hidden=True, segments=seq["input_docs"][None])
  np.testing.assert_allclose(keys[:scored.sum()], np.asarray(alone)[0][scored], rtol=1e-5,
                             atol=1e-5)
  assert list(report["models"]) == ["retro_no_neighbours", "retro"]
  without, within = (report["models"][n]["test"] for n in report["models"])
  assert without["alone"]["bits_per_byte"] != within["alone"]["bits_per_byte"]
  np.testing.assert_allclose(within["vs_reference"]["bits_per_byte"],
                             within["knnlm"]["bits_per_byte"] - without["alone"]["bits_per_byte"],
                             rtol=1e-6, atol=1e-9)
  assert "retro + kNN-LM - retro_no_neighbours alone" in open(os.path.join(out, "knnlm.md")).read()


# ------------------------------------------------------------------------------- the script

# One process for the cases (tests/cli_forks.py forks each after the script's imports; each as a
# process of its own, the ten took 31 s of a loaded machine's 2 cores).
@pytest.mark.slow
def test_the_scripts_mistakes_are_one_error_line(db, exports, retro_store, tmp_path):
  out = str(tmp_path / "out")
  models = ["--db=" + db.directory, "--models=" + exports["baseline"], "--out=" + out]
  cases = [
      (["--workdir=" + out, "--k=0"], ["--k=0"]),
      (["--workdir=" + out, "--lambda=1.5"], ["--lambda", "1.5", "between 0 and 1"]),
      (["--workdir=" + out, "--lambdas=0.5,2"], ["--lambdas", "2.0"]),
      (["--workdir=" + out, "--searcher=faiss"], ["--searcher='faiss'", "exact"]),
      (["--workdir=" + out, "--searcher=scann", "--searcher_options=leaves=9"],
       ["--searcher_options", "'leaves'", "num_leaves_to_search"]),
      (["--workdir=" + out, "--temperature=0"], ["--temperature=0.0", "positive"]),
      (["--workdir=" + str(tmp_path / "nowhere")], ["--workdir=", "nowhere"]),
      (["--db=" + db.directory, "--models=" + str(tmp_path / "nothing"), "--out=" + out],
       ["--models=", "nothing", "retro.json"]),
      ([*models, "--datastore_dir=" + retro_store[0]],
       ["--datastore_dir=" + retro_store[0], "another model", exports["retro"],
        exports["baseline"]]),
      (["--db=" + db.directory, "--models=" + ",".join(exports.values()), "--out=" + out,
        "--datastore_dir=" + out + "/d," + out + "/d"], ["--datastore_dir=", "its own directory"]),
  ]
  results = run_forked([("knnlm_eval", args) for args, _ in cases],
                       dict(one_device_env(), JAX_PLATFORMS="cpu"))
  for (args, words), got in zip(cases, results):
    errors = [line for line in got.stderr.splitlines() if line.startswith("error:")]
    assert got.returncode == 2 and len(errors) == 1, (args, got.returncode, got.stderr[-3000:])
    assert "Traceback" not in got.stderr, (args, got.stderr[-3000:])
    for word in words:
      assert word in errors[0], (args, word, errors[0])
  assert not os.path.exists(out)   # refused before any work
