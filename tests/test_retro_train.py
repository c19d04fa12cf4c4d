"""RETRO training, evaluation and sampling end to end on the tiny config: the sharded step equals a
plain one-device loop; a SIGKILLed run resumes to bit-identical parameters; eval.json equals a
recomputation by hand over every held-out sequence; greedy sampling and its evidence equal a plain
loop with a brute-force search; sampling refuses a long prompt and another tokenizer; the Colab
notebook reports, plots and samples. (The retro scripts' other user mistakes: tests/test_cli.py.)

One tiny run of both decoders (`trained`, ~30 s, started with the session: see conftest.py)
builds the tiny chunk database that every run here reads and serves the other tests, all marked
slow but the two by hand.
"""

import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
import forked_runs
from conftest import MESH_3D, ROOT, one_device_env, started_early

from realm_jax.checkpoints import retro_export
from realm_jax.configs.retro import get_config
from realm_jax.data.retro_batches import retro_batches
from realm_jax.eval import retro as retro_eval
from realm_jax.models.retro import RetroModel, token_nll
from realm_jax.retrieval.chunk_db import build_database
from realm_jax.systems.retro_lm import RetroLm
from realm_jax.train.retro import optimizer, sequence_loss

NOTEBOOK = os.path.join(ROOT, "experiments", "colab", "retro_demo.ipynb")
CONFIG = "--config=realm_jax/configs/retro.py:tiny"
# The runs here: 6 steps, a checkpoint every 2, a metrics row every step (to kill after it).
STEPS = ("--config.num_steps=6", "--config.checkpoint_every=2", "--config.log_every=1")
LN2 = math.log(2.0)


def start(script, *args, log=None):
  """experiments/<script>.py; training on the 8 fake devices (its steps are sharded), the others
  on one device as a user runs them; output to `log` (a file) or piped."""
  cmd = [sys.executable, os.path.join("experiments", f"{script}.py"), *args]
  env = dict(os.environ) if script == "retro_train" else one_device_env()
  if log is None:
    return forked_runs.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
  with open(log, "w") as out:  # (the child has its own copy of the file)
    return forked_runs.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def run(script, *args):
  """(exit status, stdout and stderr together) of experiments/<script>.py."""
  proc = start(script, *args)
  out, _ = proc.communicate(timeout=600)
  return proc.returncode, out


def train_steps(run_dir):
  """Steps of the train rows of a run's metrics.jsonl so far."""
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [r["step"] for r in rows if r["split"] == "train"]


def complete_checkpoints(run_dir):
  root = os.path.join(run_dir, "checkpoints")
  return sorted(int(d) for d in os.listdir(root) if d.isdigit()) if os.path.isdir(root) else []


def read_json(path):
  with open(path) as f:
    return json.load(f)


def export_arrays(export):
  from safetensors.numpy import load_file
  return load_file(os.path.join(export, retro_export.PARAMS))


def _start_training(tmp_path_factory):
  """The RETRO and baseline decoders trained 6 steps, then evaluated, in a fresh work directory,
  on the 8 fake devices as data 2 x fsdp 2 x tensor 2 (parameters and optimizer state split by
  their logical axes); the run first builds the tiny chunk database in <work>/db (where it looks:
  config.db.dir left empty)."""
  root = tmp_path_factory.mktemp("retro")
  work, log = str(root / "work"), root / "trained.log"
  # One checkpoint per model, at the end: no test reads the others (~4 s of writes).
  proc = start("retro_train", CONFIG, f"--workdir={work}", "--config.num_steps=6",
               "--config.checkpoint_every=6", "--config.log_every=1", f"--config.mesh={MESH_3D}",
               log=log)

  def finish():
    proc.wait(timeout=600)
    assert proc.returncode == 0, log.read_text()[-3000:]
    return work
  return [proc], finish


EARLY = {"trained": _start_training}  # (conftest.py starts it with the session)


@pytest.fixture(scope="module")
def trained(request):
  from realm_jax.checkpoints import minilm_dir
  try:
    minilm_dir()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  return started_early(request, _start_training)


@pytest.fixture(scope="module")
def db(trained):
  """The database the `trained` run built, opened."""
  return build_database(get_config("tiny").db, os.path.join(trained, "db"))


# ------------------------------------------------------------------------------------ training
@pytest.mark.slow
def test_sharded_steps_equal_a_plain_one_device_loop(db, trained):
  """`trained` ran on the 8 fake devices split three ways (the batch of 8 in 4 parts, the
  parameters split by their logical axes); a plain loop here on one device, from the same initial parameters (`module.init` with key(seed), as the trainer)
  over the same batches, ends with the same parameters."""
  config = get_config("tiny")
  config.num_steps = 6
  model_config, got, _ = retro_export.load(os.path.join(trained, "retro", "export"))
  module = RetroModel(model_config)
  length, k = db.chunk_length * db.seq_chunks, model_config.num_neighbours
  params = jax.jit(lambda key: module.init(
      key, np.zeros((1, length), np.int32),
      np.zeros((1, db.seq_chunks, k, 2 * db.chunk_length), np.int32))["params"])(
          jax.random.key(config.seed))
  initial = jax.device_get(params)
  _, tx = optimizer(config, params)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    grads = jax.grad(lambda p: sequence_loss(module, p, batch, retrieval=True)[0])(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  batches = retro_batches(db, "train", batch_size=config.batch_size, seed=config.seed,
                          num_neighbours=k)
  for _ in range(config.num_steps):
    params, opt_state = step(params, opt_state, next(batches))
  assert jax.tree.structure(got) == jax.tree.structure(jax.device_get(params))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path))
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got),
                                                      jax.tree.leaves(initial)))


@pytest.mark.slow
def test_killed_run_resumes_to_bit_identical_parameters(tmp_path, db, trained):
  workdir = str(tmp_path / "killed")
  run_dir = os.path.join(workdir, "retro")
  args = (CONFIG, f"--workdir={workdir}", *STEPS, f"--config.db.dir={db.directory}",
          "--config.models=('retro',)", "--config.eval_every=0",  # (evaluation moves nothing)
          f"--config.mesh={MESH_3D}")  # the `trained` run's mesh: the same program, bit for bit
  kill_after = random.Random().randint(1, 5)  # a random step of the 6
  log = tmp_path / "killed.log"
  proc = start("retro_train", *args, log=log)
  deadline = time.time() + 300
  while not any(s >= kill_after for s in train_steps(run_dir)):
    assert proc.poll() is None, log.read_text()[-3000:]
    assert time.time() < deadline
    time.sleep(0.01)
  # Checkpoints are written asynchronously: one complete before the kill must be restored.
  saved = complete_checkpoints(run_dir)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not os.path.exists(os.path.join(run_dir, "export")), "the run ended before the kill"
  code, out = run("retro_train", *args)
  assert code == 0, out[-3000:]
  if saved:  # (a later one may have completed between the look and the kill)
    restored = [int(s) for s in re.findall(r"Restored step (\d+)", out)]
    assert restored and restored[0] >= max(saved), (saved, out[-3000:])
  got = export_arrays(os.path.join(run_dir, "export"))
  want = export_arrays(os.path.join(trained, "retro", "export"))
  assert sorted(got) == sorted(want)
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} (killed after step "
                                  f"{kill_after}, checkpoints {saved})")


# ------------------------------------------------------------------------------ bad runs
def test_settings_no_run_can_use_are_refused_before_the_database(tmp_path):
  """No held-out documents, a decoder that is not there, CCA layers the decoder lacks: each is
  refused naming its flag before the database is built or anything written (they were refused
  once the database was built, the last without naming the flag)."""
  from realm_jax.train.retro import train_and_evaluate
  cases = [("db.heldout_percent", 0, ValueError,
            r"--config\.db\.heldout_percent=0: the models are evaluated on held-out documents"),
           ("init", "/nonexistent", FileNotFoundError,
            r"--config\.init=/nonexistent is not a directory"),
           ("model.cca_layers", (5,), ValueError, r"--config\.model\.cca_layers=\(5,\): \[5\] are "
            r"not layers of the decoder, 1 to 2 \(--config\.model\.num_layers\)")]
  workdir = tmp_path / "w"
  for key, value, error, message in cases:
    config = get_config("tiny")
    part, name = key.rsplit(".", 1) if "." in key else ("", key)
    (config[part] if part else config)[name] = value
    with pytest.raises(error, match=message):
      train_and_evaluate(config, str(workdir))
    assert not workdir.exists(), key


@pytest.mark.slow
def test_a_refused_run_leaves_nothing_in_a_new_workdir(tmp_path, db, trained):
  """A run refused once it holds its new work directory (here: a --config.db.dir built with
  other settings) leaves neither run.lock nor the directory."""
  from realm_jax.train.retro import train_and_evaluate
  config = get_config("tiny")
  config.db.dir, config.db.chunk_length = db.directory, 8
  workdir = tmp_path / "new"
  with pytest.raises(ValueError, match=r"--config\.db\.chunk_length=16 \(now 8\)"):
    train_and_evaluate(config, str(workdir))
  assert not workdir.exists()


@pytest.mark.slow
def test_a_run_trained_on_another_build_of_its_database_is_refused(tmp_path, trained, db):
  """The database of a finished run built again with other files (the issue's: the first build
  had read a damaged stage; deleted and built again, its neighbours differ): going on would keep
  models and results of the old database beside the new one ("Nothing to do"), so the run is
  refused, naming the run and the database and what to do."""
  from realm_jax.retrieval.chunk_db import MANIFEST, file_crc32
  from realm_jax.train.retro import train_and_evaluate
  workdir = tmp_path / "w"
  shutil.copytree(trained, workdir, ignore=shutil.ignore_patterns("baseline", "tb"))
  db_dir = workdir / "db"
  neighbours = np.load(db_dir / "train.neighbours.npy")
  np.save(db_dir / "train.neighbours.npy", np.ascontiguousarray(neighbours[:, ::-1]))
  manifest = read_json(db_dir / MANIFEST)
  manifest["files"]["train.neighbours.npy"] = file_crc32(str(db_dir / "train.neighbours.npy"))
  (db_dir / MANIFEST).write_text(json.dumps(manifest))
  config = get_config("tiny")
  config.models, config.num_steps = ("retro",), 6
  with pytest.raises(ValueError, match=rf"{workdir}/retro was trained on another chunk database "
                     rf"than the one in {db_dir} now \(its files' fingerprint was [0-9a-f]{{16}}, "
                     r"now [0-9a-f]{16}: built again, or from other text\)\. To train it on this "
                     rf"database, move {workdir}/retro away"):
    train_and_evaluate(config, str(workdir))
  # Its export, evaluated or sampled over the rebuilt database, is refused the same way (the
  # evaluation, kNN-LM and sampling all open a model through check_compatible).
  rebuilt = build_database(get_config("tiny").db, str(db_dir))
  with pytest.raises(ValueError, match=rf"trained on another build of the chunk database than the "
                     rf"one in {db_dir} now \(its files' fingerprint was [0-9a-f]{{16}}, now "
                     r"[0-9a-f]{16}: built again, or from other text\): evaluate it with the"):
    RetroLm(str(workdir / "retro" / "export"), rebuilt)
  RetroLm(os.path.join(trained, "retro", "export"), db)  # (its own database: accepted)


# ---------------------------------------------------------------------------------- evaluation
def test_ratio_and_its_standard_error_by_hand():
  num, den = np.array([1.0, 2.0, 3.0]), np.array([2.0, 2.0, 4.0])
  # r = 6 / 8; residuals num - r den = (-0.5, 0.5, 0); se = sqrt(3/2 * 0.5) / 8
  r, se = retro_eval.ratio_se(num, den)
  assert r == pytest.approx(0.75) and se == pytest.approx(math.sqrt(0.75) / 8)
  r, se = retro_eval.ratio_se(np.array([3.0]), np.array([4.0]))
  assert r == 0.75 and math.isnan(se)


def test_ngram_overlap_and_buckets_by_hand():
  pad, targets = 0, np.arange(100, 116)                               # 16 targets
  neighbours = np.array([[7, *targets[2:10], 8, pad, pad],            # one 8-gram: 2 .. 9
                         [*targets[3:11], 9, 9, 9, pad]])             # another: 3 .. 10
  assert retro_eval.ngram_overlap(targets, neighbours[:1], pad) == 8 / 16
  assert retro_eval.ngram_overlap(targets, neighbours, pad) == 9 / 16
  assert retro_eval.ngram_overlap(targets, np.array([[*targets[:7], 5, targets[7]]]), pad) == 0.0
  assert retro_eval.ngram_overlap(targets[:7], np.array([targets[:7]]), pad) == 0.0  # T < 8
  # Padding is no text: padded targets (the end of the stream) match no padded neighbour.
  assert retro_eval.ngram_overlap(np.full(16, pad), np.full((2, 32), pad), pad) == 0.0
  # A sequence of 48 tokens, chunks of m = 16: the first 15 read nothing; chunk v's neighbours are
  # read by targets 15 + 16 v .. 30 + 16 v (the last attending chunk has one target).
  m, seq = 16, np.arange(1000, 1048)
  absent = np.full((2, 2 * m), 5)
  nb = np.stack([absent, absent, absent])                             # [C, K, R]
  nb[0, 1, :9] = seq[15:24]                                           # 9 of 16: (50, 75%]
  nb[1, 0, 3:19] = seq[31:47]                                         # all 16: (75, 100%]
  nb[2, 0, :8] = seq[40:48]                                           # only 1 target: 0%
  want = np.concatenate([np.full(15, -1), np.full(16, 3), np.full(16, 4), [0]])
  np.testing.assert_array_equal(retro_eval.overlap_buckets(seq, nb, m, pad_id=0), want)
  nb[0, 1, :9] = 5
  nb[0, 0, :8] = seq[20:28]                                           # 8 of 16: (25, 50%]
  assert (retro_eval.overlap_buckets(seq, nb, m, pad_id=0)[15:31] == 2).all()
  nb[0, 0, :8] = 5                                                    # none: 0%
  assert (retro_eval.overlap_buckets(seq, nb, m, pad_id=0)[15:31] == 0).all()


def test_overlap_rows_keep_each_systems_own_buckets():
  """A system that read other neighbours has its tokens in other overlap buckets: each row keeps
  every system's tokens, bytes and bits per byte, and the table gives each bucketing its own
  tokens column (hand-computed: 2 documents, 6 bucket slots)."""
  ln2 = math.log(2)
  def system(tokens, nll):
    tokens = np.array(tokens, np.float64)
    return {"nll_doc": np.array([2.0, 4.0]) * ln2, "nll_bucket": np.array(nll) * ln2,
            "bytes_bucket": tokens * 2, "tokens_bucket": tokens}
  systems = {"retro": system([1, 2, 0, 0, 0, 1], [1, 2, 0, 0, 0, 3]),
             "retro_no_neighbours": system([1, 2, 0, 0, 0, 1], [1, 4, 0, 0, 0, 1]),
             "retro_other_neighbours": system([1, 3, 0, 0, 0, 0], [1, 5, 0, 0, 0, 0])}
  report = retro_eval._report(systems, np.array([4.0, 4.0]), np.array([2.0, 2.0]))
  rows = report["overlap"]
  assert [r["tokens"]["retro"] for r in rows] == [1, 2, 0, 0, 0, 1]
  assert [r["tokens"]["retro_other_neighbours"] for r in rows] == [1, 3, 0, 0, 0, 0]
  assert rows[1]["bits_per_byte"] == {"retro": 0.5, "retro_no_neighbours": 1.0,
                                      "retro_other_neighbours": 5 / 6}
  assert rows[5]["bits_per_byte"]["retro_other_neighbours"] is None
  assert rows[5]["bytes"]["retro"] == 2.0
  table = retro_eval.markdown(report).split("Bits per byte by the 8-gram")[1].splitlines()
  assert table[2] == ("| overlap | tokens | retro | retro_no_neighbours | tokens | "
                      "retro_other_neighbours |")
  assert table[5] == "| 0% | 2 | 0.5000 | 1.0000 | 3 | 0.8333 |"
  assert table[-1] == "| (75, 100%] | 1 | 1.5000 | 0.5000 | 0 | - |"


def _heldout_nll(export, db, retrieval):
  """(summed nats, scored targets, nats per held-out document) of an export over every held-out
  sequence, one at a time."""
  config, params, _ = retro_export.load(export)
  module = RetroModel(config)
  apply = jax.jit(lambda p, t, n, s, y: token_nll(module.apply({"params": p}, t, n, segments=s),
                                                  y))
  per_doc = np.zeros(len(db.documents("heldout")))
  total, tokens = 0.0, 0
  for s in range(db.num_sequences("heldout")):
    r = db.read_sequence("heldout", s)
    nb = r["neighbours"][None, :, :config.num_neighbours] if retrieval else None
    nll = np.asarray(apply(params, r["inputs"][None], nb, r["input_docs"][None],
                           r["targets"][None])[0], np.float64)
    scored = r["target_docs"] >= 0
    total, tokens = total + nll[scored].sum(), tokens + int(scored.sum())
    np.add.at(per_doc, r["target_docs"][scored], nll[scored])
  return total, tokens, per_doc


@pytest.mark.slow
def test_eval_json_equals_a_recomputation_over_every_heldout_sequence(db, trained):
  report = read_json(os.path.join(trained, "eval.json"))
  docs = db.documents("heldout")
  doc_bytes = np.array([d["bytes"] for d in docs], np.float64)
  assert report["bytes"] == doc_bytes.sum() and report["documents"] == len(docs)
  # label: (export, neighbours given); the baseline has no CCA layers and ignores them.
  systems = {"retro": ("retro", True), "retro_no_neighbours": ("retro", False),
             "baseline": ("baseline", True)}
  assert list(report["models"]) == list(systems)
  per_doc = {}
  for label, (model, retrieval) in systems.items():
    total, tokens, per_doc[label] = _heldout_nll(os.path.join(trained, model, "export"), db,
                                                 retrieval)
    assert tokens == sum(d["tokens"] for d in docs) == report["tokens"]  # each scored once
    got = report["models"][label]
    np.testing.assert_allclose(got["bits_per_byte"], total / LN2 / doc_bytes.sum(), rtol=1e-5)
    np.testing.assert_allclose(got["nats_per_token"], total / tokens, rtol=1e-5)
    np.testing.assert_allclose(got["se"], retro_eval.ratio_se(per_doc[label] / LN2, doc_bytes)[1],
                               rtol=1e-4)
  # The neighbours change the RETRO decoder's predictions.
  assert report["models"]["retro"] != report["models"]["retro_no_neighbours"]
  # Each difference is the difference of the models' values (the same bytes), paired over docs.
  assert sorted(report["differences"]) == ["retro - baseline", "retro_no_neighbours - baseline",
                                           "retro_no_neighbours - retro"]
  for name, d in report["differences"].items():
    a, b = name.split(" - ")
    np.testing.assert_allclose(d["bits_per_byte"], report["models"][a]["bits_per_byte"]
                               - report["models"][b]["bits_per_byte"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(d["se"], retro_eval.ratio_se(
        (per_doc[a] - per_doc[b]) / LN2, doc_bytes)[1], rtol=1e-3, atol=1e-7)
  # The overlap rows split the same tokens and bytes.
  rows = report["overlap"]
  assert rows[0]["overlap"] == retro_eval.NO_NEIGHBOURS
  for label in systems:
    assert sum(r["tokens"][label] for r in rows) == report["tokens"]
    np.testing.assert_allclose(sum(r["bytes"][label] for r in rows), report["bytes"], rtol=1e-5)
    bits = sum(r["bits_per_byte"][label] * r["bytes"][label] for r in rows if r["tokens"][label])
    np.testing.assert_allclose(bits / report["bytes"], report["models"][label]["bits_per_byte"],
                               rtol=1e-5)


# ------------------------------------------------------------------------------------ sampling
PROMPT_TOKENS = 26  # with the leading separator: one chunk of 16 complete, the second on its way
NEW_TOKENS = 20     # the second chunk completes too


def _prompt(db):
  """Text from the start of the first training document (its chunks are in the index)."""
  return db.tokenizer.decode(np.asarray(db.train_stream[1:PROMPT_TOKENS]).tolist())


def greedy_reference(export, db, prompt, max_new_tokens):
  """(continuation, [(chunk, ids, scores)]): greedy decoding with a full forward pass per token
  over the context, and the neighbours of each completed chunk by a numpy search of the keys of
  the indexed train chunks (those holding a document token)."""
  config, params, _ = retro_export.load(export)
  module = RetroModel(config)
  logits_of = jax.jit(lambda p, t, n: module.apply({"params": p}, t, n))
  tok, m, k = db.tokenizer, config.chunk_length, config.num_neighbours
  context = config.max_length // m * m
  docs = np.asarray(db.array("train", "docs"))[:db.num_chunks("train") * m].reshape(-1, m)
  indexed = np.flatnonzero((docs >= 0).any(1))
  keys = np.asarray(db.array("train", "keys"), np.float64)[indexed]
  ids = [tok.eos_id] + tok.encode_batch([prompt])[0]
  start_len = len(ids)
  neighbours = np.full((1, context // m, k, 2 * m), tok.pad_id, np.int32)
  found = []
  while len(ids) - start_len < max_new_tokens and len(ids) < context:
    for u in range(len(found), len(ids) // m):
      scores = keys @ db.embed_keys(np.array(ids[u * m:(u + 1) * m])[None])[0].astype(np.float64)
      best = np.argsort(-scores, kind="stable")[:k]
      found.append((u, indexed[best], scores[best]))
      neighbours[0, u] = db.values(indexed[best])
    tokens = np.full((1, context), tok.pad_id, np.int32)
    tokens[0, :len(ids)] = ids
    nxt = int(np.argmax(logits_of(params, tokens, neighbours)[0, len(ids) - 1]))
    if nxt == tok.eos_id:
      break
    ids.append(nxt)
  return tok.decode(ids[start_len:]), found


@pytest.fixture(scope="module")
def lm(db, trained):
  return RetroLm(os.path.join(trained, "retro", "export"), db)


@pytest.fixture(scope="module")
def sample(db, lm):
  """(prompt, continuation, evidence) of greedy sampling from the trained RETRO decoder."""
  prompt = _prompt(db)
  return (prompt, *lm.generate(prompt, max_new_tokens=NEW_TOKENS, temperature=0))


@pytest.mark.slow
def test_greedy_sampling_and_evidence_equal_a_plain_loop(db, trained, sample):
  prompt, text, evidence = sample
  want_text, want = greedy_reference(os.path.join(trained, "retro", "export"), db, prompt,
                                     NEW_TOKENS)
  assert text == want_text and text
  assert len(want) >= 2  # the prompt's chunk, then one the model completed
  assert [e.chunk for e in evidence] == [u for u, _, _ in want]
  for e, (_, ids, scores) in zip(evidence, want):
    assert [n["chunk_id"] for n in e.neighbours] == ids.tolist()
    np.testing.assert_allclose([n["score"] for n in e.neighbours], scores, rtol=1e-4, atol=1e-5)
    assert all(n["title"] and n["text"] for n in e.neighbours)


@pytest.mark.slow
def test_sampling_refuses_a_long_prompt_and_another_tokenizer(db, trained, lm, tmp_path):
  export = os.path.join(trained, "retro", "export")
  with pytest.raises(ValueError, match=r"--prompt is \d+ tokens long .*context is 64 tokens"):
    lm.generate("river " * 64, max_new_tokens=4)
  other = tmp_path / "other"
  shutil.copytree(export, other)
  meta = json.loads((other / retro_export.CONFIG).read_text())
  (other / retro_export.CONFIG).write_text(json.dumps({**meta, "tokenizer": "gpt2-bpe-50257"}))
  with pytest.raises(ValueError, match=r"--config\.db\.tokenizer_file giving gpt2-bpe-50257"):
    RetroLm(str(other), db)
  # A RETRO model that reads chunks of another length than the database's: one error, not shapes.
  (other / retro_export.CONFIG).write_text(json.dumps(
      {**meta, "model": {**meta["model"], "chunk_length": 8}}))
  with pytest.raises(ValueError, match=r"--config\.db\.chunk_length giving 8, but the chunk "
                     rf"database in {db.directory} with 16"):
    RetroLm(str(other), db)


@pytest.mark.slow
def test_sampling_a_long_prompt_is_one_error_line(trained):
  code, out = run("retro_sample", f"--workdir={trained}", "--prompt=" + "river " * 64)
  errors = [line for line in out.splitlines() if line.startswith("error: ")]
  assert code == 2 and len(errors) == 1 and "Traceback" not in out, out[-3000:]
  assert "--prompt is" in errors[0] and "shorten the prompt" in errors[0]


# ------------------------------------------------------------------------------------ notebook
@pytest.mark.slow
def test_the_notebook_trains_reports_plots_and_samples(trained, sample, tmp_path, monkeypatch):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
  assert len(params) == 1
  # A copy of the finished run: training resumes with nothing to do, then evaluates and samples.
  copy = str(tmp_path / "w")
  shutil.copytree(trained, copy)
  prompt, lm_text, evidence = sample
  params[0].source = "\n".join([
      'variant = "tiny"', f"workdir = {copy!r}", "num_steps = 6", f"prompt = {prompt!r}",
      f"max_new_tokens = {NEW_TOKENS}"])
  monkeypatch.setenv("XLA_FLAGS", one_device_env()["XLA_FLAGS"])  # one device, like Colab's
  nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}}).execute()
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  text += "".join(o.get("data", {}).get("text/markdown", "") for o in outputs)
  report = read_json(os.path.join(copy, "eval.json"))
  assert report == read_json(os.path.join(trained, "eval.json"))  # nothing was trained again
  for label, m in report["models"].items():
    assert f"| {label} | {m['bits_per_byte']:.4f} | {m['se']:.4f} |" in text, text
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) == 1
  assert f"{prompt} >>> {lm_text}\n" in text, text
  for e in evidence:
    assert f"chunk {e.chunk}: {e.chunk_text!r}\n" in text, text
    for n in e.neighbours:
      assert f"  [{n['score']:.3f}] {n['title']}: {n['text']}\n" in text, text


@pytest.mark.slow
def test_retrofit_trains_only_cca_and_the_encoder_of_a_gpt2(tmp_path):
  """RETROfitting: a tiny random Hugging Face GPT-2 with its own byte-level BPE tokenizer.json
  (trained here on the articles); the database is keyed through decoded text; with
  freeze_decoder the exported decoder arrays are exactly the checkpoint's, while CCA and the
  encoder moved from their initial values."""
  import torch
  import transformers
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from realm_jax.checkpoints import gpt2
  from realm_jax.data.wiki_vital import load_articles
  from realm_jax.train.retro import train_and_evaluate

  ckpt = tmp_path / "gpt2"
  ckpt.mkdir()
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(
      [a["text"] for a in load_articles()[:200]],
      trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(ckpt / "tokenizer.json"))
  torch.manual_seed(0)
  hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
      vocab_size=tok.get_vocab_size(), n_positions=64, n_embd=32, n_layer=2, n_head=2))
  hf.save_pretrained(str(ckpt), safe_serialization=True)

  config = get_config("tiny")
  config.init, config.freeze_decoder = str(ckpt), True
  config.db.tokenizer_file = str(ckpt / "tokenizer.json")
  config.db.max_docs = 20  # half the tiny database: embedding its chunks' keys is most of the time
  config.models, config.num_steps, config.eval_every = ("retro",), 3, 0
  workdir = str(tmp_path / "work")
  report = train_and_evaluate(config, workdir)
  assert set(report["models"]) == {"retro", "retro_no_neighbours"}

  model_config, got, meta = retro_export.load(os.path.join(workdir, "retro", "export"))
  assert meta["tokenizer"].startswith("tokenizer.json:") and model_config.cca_layers == (2,)
  want = gpt2.load_decoder(str(ckpt))
  flat_got = {jax.tree_util.keystr(p): np.asarray(v)
              for p, v in jax.tree_util.tree_leaves_with_path(got)}
  flat_want = {jax.tree_util.keystr(p): np.asarray(v)
               for p, v in jax.tree_util.tree_leaves_with_path(want)}
  for key, value in flat_want.items():
    np.testing.assert_array_equal(flat_got[key], value, err_msg=key)
  module = RetroModel(model_config)
  length = 64
  init = jax.jit(lambda key: module.init(
      key, np.zeros((1, length), np.int32),
      np.zeros((1, 4, model_config.num_neighbours, 2 * model_config.chunk_length), np.int32))
      ["params"])(jax.random.key(config.seed))
  moved = [k for k, v in jax.tree_util.tree_leaves_with_path(init)
           if jax.tree_util.keystr(k) not in flat_want
           and not np.array_equal(flat_got[jax.tree_util.keystr(k)], np.asarray(v))]
  assert moved and all("cca" in jax.tree_util.keystr(k) or "encoder" in jax.tree_util.keystr(k)
                       for k in moved)
