"""Multi-host pre-training for real: 2 processes x 2 fake CPU devices, talking through
`jax.distributed` (gloo collectives on localhost), train the tiny config with the index sharded over
all 4 devices of both processes, refresh the index once and write one checkpoint. The parameters
and losses equal those of one process with 4 devices and the same global batch."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import forked_runs
from conftest import devices_env, started_early

try:  # the tiny config reads the embedded corpus and the MiniLM vocabulary (the demo extra)
  from realm_jax.checkpoints.minilm import minilm_dir
  from realm_jax.data.wiki_vital import summaries_path
  summaries_path(), minilm_dir()
except Exception as e:  # noqa: BLE001
  pytest.skip(f"needs the demo extra: {e}", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3  # the index refreshed at step 2, then one step on it
# The tiny random BERT drawn at a std of 0.5 instead of BERT's 0.02: at 0.02 every sentence embeds
# almost alike (the [CLS] output is mostly its own embedding), so retrieval scores tie to ~1e-7 and
# the reduction-order noise of another device layout flips which blocks are retrieved; at 0.5
# they separate (retrieval entropy over the 4 candidates 0.36-0.54 on the training batches and 1.12
# held out, against ln 4 = 1.39, uniform, held out at 0.02). MiniLM's first layer (28M parameters)
# did that before, for ~1.7x the CPU (docs/notes.md, 2026-12-02).
FLAGS = ["--config=realm_jax/configs/pretrain.py:tiny", "--config.model.initializer_range=0.5",
         f"--config.num_steps={STEPS}",
         f"--config.checkpoint_every={STEPS}", "--config.index.refresh_every=2",
         f"--config.eval_every={STEPS}", "--config.learning_rate=1e-4",
         # Data 2 x fsdp 2: the batch split over the hosts (the data axis, one host's devices
         # each) and each host's parameters and Adam's moments split over its 2 devices, so the
         # run also checks parameters split within hosts (as fast as data 4: docs/notes.md).
         "--config.mesh=data=2,fsdp=2"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
  return {**devices_env(devices), "JAX_PLATFORMS": "cpu", **extra}


def _start(workdir, data_dir, env, *extra):
  cmd = [sys.executable, "experiments/pretrain.py", *FLAGS, f"--workdir={workdir}",
         f"--config.data_dir={data_dir}", *extra]
  return forked_runs.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)


def _finish(procs):
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=600)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-4000:]
  return outs


def _params(workdir):
  """The parameters of the checkpoint, read onto this process's first device (whatever topology
  wrote them)."""
  import jax
  import orbax.checkpoint as ocp
  path = os.path.join(workdir, "checkpoints", str(STEPS), "state")
  ckpt = ocp.StandardCheckpointer()
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  meta = ckpt.metadata(path)
  meta = getattr(meta, "item_metadata", meta)
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
  state = ckpt.restore(path, target)
  return dict(jax.tree_util.tree_leaves_with_path(state["params"]))


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [(r["step"], r["split"], r["loss"]) for r in rows]


def _start_runs(tmp_path_factory):
  """The one-process run and the two processes, all three at once (each is on one core or waits on
  collectives most of the time); each run builds its own copy of the data."""
  single = str(tmp_path_factory.mktemp("single"))
  multi = str(tmp_path_factory.mktemp("multi"))
  port = _free_port()
  procs = [_start(single, str(tmp_path_factory.mktemp("data")), _env(4))]
  multi_data = str(tmp_path_factory.mktemp("data"))
  procs += [_start(multi, multi_data, _env(2, REALM_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                           REALM_NUM_PROCESSES="2", REALM_PROCESS_ID=str(i)),
                   "--config.distributed=True") for i in range(2)]
  return procs, lambda: (single, multi, _finish(procs))


EARLY = {"runs": _start_runs}  # (conftest.py starts them with the session)


@pytest.fixture(scope="module")
def runs(request):
  return started_early(request, _start_runs)


@pytest.mark.slow
def test_two_processes_equal_one(runs):
  single, multi, outs = runs
  assert "Process 0 of 2: 2 local / 4 global devices" in outs[1]
  assert "Process 1 of 2: 2 local / 4 global devices" in outs[2]
  # One checkpoint, written by both processes into one work directory (each its data iterator).
  ckpt = os.path.join(multi, "checkpoints", str(STEPS))
  assert sorted(os.listdir(os.path.join(multi, "checkpoints"))) == [str(STEPS)]
  data_states = sorted(os.listdir(os.path.join(ckpt, "data")))
  assert [n for n in data_states if n.startswith("process_")] == [
      "process_0-of-2.json", "process_1-of-2.json"]
  # The index was refreshed at step 2 and published once, by the first process.
  assert sorted(d for d in os.listdir(os.path.join(multi, "index")) if d.startswith("index-")) == [
      "index-00000000", "index-00000002"]
  got, want = _params(multi), _params(single)
  assert got.keys() == want.keys()
  worst = max(float(np.max(np.abs(np.asarray(got[k], np.float64) - np.asarray(want[k]))))
              for k in want)
  assert worst <= 1e-5, worst
  moved = max(float(np.max(np.abs(np.asarray(want[k])))) for k in want)
  assert moved > 0
  a, b = _losses(multi), _losses(single)
  assert [r[:2] for r in a] == [r[:2] for r in b] and len(a) >= STEPS
  np.testing.assert_allclose([r[2] for r in a], [r[2] for r in b], rtol=1e-5)


def test_async_index_swaps_only_when_every_host_holds_the_same_version(tmp_path, monkeypatch):
  """Two hosts' watchers (threads here, exchanging through a fake allgather) that started loading
  different published indexes end up swapping in the same, newest one, in the same round."""
  import threading
  import types

  from realm_jax import distributed
  from realm_jax.retrieval.index import DocIndex
  from realm_jax.retrieval.index_store import publish_index
  from realm_jax.train.refresh import AsyncIndexWatcher

  barrier, slots = threading.Barrier(2), {}

  def fake_allgather(x):  # what process_allgather gives each host: both hosts' rows in order
    slots[threading.current_thread().name] = np.asarray(x)
    barrier.wait()
    out = np.concatenate([slots["host0"], slots["host1"]])
    barrier.wait()
    return out

  monkeypatch.setattr(distributed, "allgather_rows", fake_allgather)
  corpus = types.SimpleNamespace(fingerprint="corpus")
  root = str(tmp_path / "index")

  def publish(step):
    emb = np.random.default_rng(step).normal(size=(6, 4)).astype(np.float32)
    publish_index(root, DocIndex(emb, np.arange(6) + 10), step, model_fingerprint=str(step),
                  corpus_fingerprint="corpus")

  publish(0)
  watchers = [AsyncIndexWatcher(root, corpus, 4, {}, None, agree=True) for _ in range(2)]
  watchers[0]._collect()  # host 0 starts loading index 0 ...
  publish(5)
  watchers[1]._collect()  # ... host 1 already sees index 5
  rounds = {0: [], 1: []}

  def host(i):
    for _ in range(200):
      got = watchers[i].poll()
      rounds[i].append(None if got is None else os.path.basename(got[1]))
      if got is None:
        threading.Event().wait(0.01)

  threads = [threading.Thread(target=host, args=(i,), name=f"host{i}") for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=60)
  for w in watchers:
    w.close()
  swaps = [[(r, name) for r, name in enumerate(rounds[i]) if name] for i in range(2)]
  assert swaps[0] == swaps[1] and [name for _, name in swaps[0]] == ["index-00000005"]
