"""Test setup: 8 fake CPU devices for every sharded path, and the HF REALM port as oracle."""

import contextlib
import functools
import os
import shutil
import sys

import pytest

from cli_forks import collect_less_often, freeze_imports

collect_less_often()  # before the test modules import JAX, PyTorch and transformers

# Must happen before jax is imported anywhere. The suite's time is mostly XLA compiling tiny models
# (backend compilation was half of the quick tests' time), and LLVM at -O0 compiles them faster:
# 37% less time for test_pieces.py and test_retro_model.py's quick tests, 15% for test_pretrain.py
# and test_train_step.py (docs/notes.md, 2026-11-27). It changes LLVM's code generation, not the
# HLO program; every test passed both ways. XLA:CPU's older fusion emitters (not the MLIR ones)
# then compile the same fusions in about half the time: 30% less for test_pieces.py and
# test_train_step.py (docs/notes.md, 2026-11-28). User runs keep the defaults (-O2).
_DEVICES = "--xla_force_host_platform_device_count"
os.environ.setdefault("XLA_FLAGS", f"{_DEVICES}=8 --xla_backend_optimization_level=0 "
                      "--xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# glibc keeps freed blocks in its heap instead of unmapping them and faulting them back in
# (realm_jax/host_memory.py): in the workers and the processes they start (they inherit the
# environment; glibc reads it at start-up), and in this process from here on. The suite side by
# side with and without, twice: 25.0M -> 17.0-17.3M minor page faults, 1-3% less CPU (system time
# 143 -> 111 s, 117 -> 100 s; user time within 0.3%) (docs/notes.md, 2026-12-02). User runs keep
# glibc's defaults.
from realm_jax.host_memory import KEEP_FREED_ENV, keep_freed_memory  # noqa: E402 (ctypes only)
for _name, _value in KEEP_FREED_ENV.items():
  os.environ.setdefault(_name, _value)
if all(os.environ[k] == v for k, v in KEEP_FREED_ENV.items()):  # not when set otherwise outside
  keep_freed_memory()
# transformers would otherwise import TensorFlow (slow) whenever the `tf` extra is installed.
os.environ.setdefault("USE_TF", "0")
os.environ.setdefault("TRANSFORMERS_NO_TF", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# XLA compilations are most of the suite's time, and many tests (and the runs they start as
# subprocesses) compile the same programs: share them through jax's persistent cache, one
# directory per test session.
# Under pytest-xdist the controller makes the directory before it starts the workers, which inherit
# the variable: the workers share one cache.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import tempfile
  _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(
      prefix="realm_jax-xla-cache-")
  # Every compilation, the many small ones too (jax's default keeps those over 1 s): a tiny
  # pre-training run compiles ~100 programs, and the second run that finds them all in the
  # cache starts ~2-7 s sooner than one that finds only the 4 large ones (docs/notes.md).
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


# pytest runs one test at a time, on one core most of the time. The long runs that a module's tests
# wait for (subprocesses) start with the session instead, beside the tests before them, when a
# selected test needs them: the module lists them in EARLY = {fixture name: start}, where
# start(tmp_path_factory) starts the processes and returns (processes, finish); the fixture returns
# `started_early(request, start)`: finish() of the processes started early (or now).
_EARLY = {}  # start -> (processes, finish, the directories its start made)
# Every run here writes checkpoints and exports (~200 MB for a MiniLM-sized model), and a CI
# machine's disk can be small: a passed test's tmp_path goes when it ends (pyproject.toml's
# tmp_path_retention_policy), an early run's directories when its module ends, and a session
# fixture's directory that it puts in _SCRATCH after the last test that uses the fixture, unless a
# test has failed by then (kept to debug, as pytest keeps a failed test's tmp_path).
_SCRATCH = {}  # fixture name -> its directory, once made
_LAST_USE = {}  # fixture name -> the last selected test that uses it


class _Recording:
  """A tmp_path_factory that remembers the directories it made."""

  def __init__(self, factory):
    self._factory, self.made = factory, []

  def mktemp(self, *args, **kwargs):
    path = self._factory.mktemp(*args, **kwargs)
    self.made.append(path)
    return path


def _remove_unless_failed(session, *paths):
  if session.testsfailed == 0:
    for path in paths:
      shutil.rmtree(path, ignore_errors=True)


def _waits_for_early_runs(item) -> bool:
  return bool(getattr(getattr(item, "module", None), "EARLY", None))


# pyproject.toml runs the suite on 2 pytest-xdist workers, one per core (`-n 0`: one process, as
# before). The scheduler below sends the tests out in groups: a module is a group (its
# module-scoped runs are made once), the modules that share the tiny QA run are one, and the groups
# go out heaviest first (the workers' order, set below), so that the last ones to finish are short.
# A worker starts no run early (the other worker keeps the second core busy instead): a module's
# runs start when its tests first need them.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_SHARED_GROUPS = {"test_ask": "tiny_qa", "test_finetune": "tiny_qa", "test_dpr": "tiny_qa"}
# Each group's CPU seconds with `-n 0`, the runs it starts included (one group at a time, 2 AMD
# EPYC cores shared with other work, 2026-11-28, docs/notes.md): test_pretrain ~208, tiny_qa ~200,
# test_retro_train 127, test_multihost 103, ..., test_paths 16; the groups not named take less.
_HEAVIEST_FIRST = ("test_pretrain", "tiny_qa", "test_retro_train", "test_multihost",
                   "test_train_step", "test_search_demo", "test_llama_checkpoint",
                   "test_compile_for", "test_ablations", "test_cli", "test_pieces", "test_ict",
                   "test_qa_step", "test_knnlm", "test_retro_model", "test_chunk_db", "test_mesh",
                   "test_build_index", "test_hf_parity", "test_index_scale", "test_index",
                   "test_lm_tokenizer_gguf", "test_paths")


def _group(nodeid: str) -> str:
  module = nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
  return _SHARED_GROUPS.get(module, module)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """xdist's scheduler by scope, each group a scope (its `loadgroup` marks do not reach the
  scheduler under pytest 9)."""
  from xdist.scheduler import LoadScopeScheduling

  class ByGroup(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
      return _group(nodeid)

  return ByGroup(config, log)


def pytest_collection_modifyitems(session, config, items):
  """Without xdist, the modules with runs started early go last (in their order, each whole), so
  those runs have the rest of the suite to finish beside: test_ablations.py, first by name, used to
  wait ~4 minutes for its runner. On an xdist worker, the groups above, heaviest first."""
  del session, config
  strays = sorted({_group(item.nodeid) for item in items
                   if "tiny_qa_workdir" in getattr(item, "fixturenames", ())} - {"tiny_qa"})
  if strays:  # each worker would make the run again
    raise pytest.UsageError(f"tests/conftest.py: add {strays} to _SHARED_GROUPS (they use the "
                            "tiny QA run)")
  if _XDIST_WORKER:
    rank = {name: i for i, name in enumerate(_HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(_group(item.nodeid), len(rank)))  # stable
  else:
    items.sort(key=_waits_for_early_runs)  # stable: False before True, each group in its order
  _LAST_USE.update((name, item) for item in items for name in getattr(item, "fixturenames", ()))


def pytest_runtest_teardown(item, nextitem):
  del nextitem
  for name in [name for name in _SCRATCH if _LAST_USE.get(name) is item]:
    _remove_unless_failed(item.session, _SCRATCH.pop(name))


def pytest_collection_finish(session):
  freeze_imports()  # the test modules' imports made
  if session.config.option.collectonly or _XDIST_WORKER:
    return
  for item in session.items:
    for name, start in getattr(getattr(item, "module", None), "EARLY", {}).items():
      if name in item.fixturenames and start not in _EARLY:
        # (the object the tmp_path_factory fixture returns)
        _EARLY[start] = _start(start, session.config._tmp_path_factory)  # pylint: disable=protected-access


def _start(start, factory):
  recording = _Recording(factory)
  return (*start(recording), recording.made)


def started_early(request, start):
  """finish() of the processes started early (or now); their directories go when the fixture's
  scope (the module) ends."""
  _, finish, made = (_EARLY.pop(start, None)
                     or _start(start, request.getfixturevalue("tmp_path_factory")))
  request.addfinalizer(lambda: _remove_unless_failed(request.session, *made))
  return finish()


def pytest_sessionfinish(session, exitstatus):
  del session, exitstatus
  for procs, _, _ in _EARLY.values():  # started for tests that did not run (-x, an interrupt)
    for proc in procs:
      proc.kill()
      proc.wait()
  if "forked_runs" in sys.modules:  # the fork servers stopped and waited for (their CPU counted)
    sys.modules["forked_runs"].stop_servers()
  if _OWN_CACHE is not None:
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
  """A worker has sent its results by now (pytest-xdist sends them at pytest_sessionfinish): it
  ends without jax's exit function, which frees every program the worker compiled one by one,
  nor the interpreter's teardown: ~6 CPU-seconds per worker, and as many of wall at the end of
  the suite (docs/notes.md, 2026-12-01)."""
  if _XDIST_WORKER:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(config.workeroutput.get("exitstatus", 0))


import numpy as np  # noqa: E402

from realm_jax.models import RealmConfig  # noqa: E402

TINY_HF = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=37, max_position_embeddings=64, retriever_proj_size=16,
               span_hidden_size=12, max_span_width=4, num_candidates=3, reader_beam_size=2,
               searcher_beam_size=4)


def hf_realm_config(**overrides):
  """The tiny HF REALM config; torch's global generator seeded for the random model built from it.
  (`_seed_torch` cannot seed a test that imports torch itself, and torch 2.13 seeds its generator
  at random on import: test_train_step's HF loss test drew other weights in each process, and on
  some of them no example's accuracy differed with and without retrieval, failing its check that
  the standard error of that difference is above 1e-3.)"""
  import torch
  from transformers.models.deprecated.realm.configuration_realm import RealmConfig as HFRealmConfig
  torch.manual_seed(0)
  return HFRealmConfig(**{**TINY_HF, **overrides})


@pytest.fixture(autouse=True)
def _seed_torch():
  """HF models draw their initial weights from torch's global generator: it is seeded before each
  test, so no test depends on what the tests before it drew (a fresh clone once failed a check
  that passed in the development tree)."""
  torch = sys.modules.get("torch")  # not imported here: most tests never need it
  if torch is not None:
    torch.manual_seed(0)


def write_tf1_checkpoint(prefix, variables: dict) -> str:
  """Saves {name: array} as a TF1 checkpoint at `prefix` (TensorFlow's own Saver; the test is
  skipped without TensorFlow); returns the prefix as saved."""
  tf = pytest.importorskip("tensorflow")
  graph = tf.Graph()
  with graph.as_default():
    tf_vars = [tf.compat.v1.Variable(v, name=n) for n, v in variables.items()]
    saver = tf.compat.v1.train.Saver(tf_vars)
    with tf.compat.v1.Session(graph=graph) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      return saver.save(sess, str(prefix))


def perturbed(model, seed=0, scale=0.2):
  """Moves every weight away from its init (so a wrong transpose or a swapped LayerNorm shows)."""
  import torch
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(scale * torch.randn(p.shape, generator=g))
  return model.eval()


@contextlib.contextmanager
def gguf_parsed_once(path: str):
  """transformers reading the GGUF file `path` (its config, weights, tokenizer) from the reader the
  project caches (`lm_tokenizer.open_gguf`: one parse per file version, shared with the project's
  own loaders) and with llama.cpp's tensor-name table built once: transformers parses the whole
  file again on each read (SmolLM2's 49,152 vocabulary strings: ~3 s) and builds the table anew
  for each of its 272 tensors (~5 s). The same reader of the same file and the same table: no
  number changes."""
  import gguf

  from realm_jax.text.lm_tokenizer import open_gguf
  reader, real = open_gguf(path, "gguf_file"), gguf.GGUFReader
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(gguf, "GGUFReader", lambda p: reader if os.path.samefile(p, path) else real(p))
    patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(None)(gguf.get_tensor_name_map))
    yield


@pytest.fixture(scope="session")
def hf_config():
  return hf_realm_config()


@pytest.fixture(scope="session")
def jax_config(hf_config):
  return RealmConfig.from_dict(hf_config.to_dict())


def jit_init(module, seed, *args, **kwargs):
  """`module.init(jax.random.key(seed), *args, **kwargs)["params"]`, jitted: run op by op, a
  model's init dispatches each of its ops alone, seconds for the tiny models here."""
  import jax
  return jax.jit(lambda key: module.init(key, *args, **kwargs)["params"])(jax.random.key(seed))


def random_inputs(rng, batch_shape, seq_len, vocab, min_len=3):
  """Token ids with [CLS]-like start, random lengths and padding (id 0) after the length."""
  ids = rng.integers(1, vocab, size=(*batch_shape, seq_len))
  lengths = rng.integers(min_len, seq_len + 1, size=batch_shape)
  mask = (np.arange(seq_len) < lengths[..., None]).astype(np.int64)
  ids = ids * mask
  types = ((np.arange(seq_len) >= (lengths[..., None] // 2)) & (mask == 1)).astype(np.int64)
  return ids, mask, types


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NQ_OPEN = os.path.join(os.path.dirname(ROOT), "shared", "data", "nq_open")


def devices_env(devices: int) -> dict:
  """os.environ for a process with `devices` fake CPU devices (the other XLA flags kept)."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICES)]
  return {**os.environ, "XLA_FLAGS": " ".join(flags + [f"{_DEVICES}={devices}"] * (devices > 1))}


def one_device_env() -> dict:
  """The environment of a user's run: one CPU device, not the fake ones of the tests."""
  return devices_env(1)


@pytest.fixture(scope="session")
def tiny_reader(tmp_path_factory):
  """A HF directory holding a random BERT of the tiny configs' sizes (configs/pretrain.TINY_BERT:
  32 wide, 1 layer) with MiniLM's word pieces (transformers' BertModel, seed 0), the reader of
  the tests' tiny fine-tuning runs: the tiny config's reader (MiniLM's first layer, 384 wide) is
  half of the trained parameters and of the checkpoints. With this one the tiny QA run alone
  takes 38.9 CPU-s instead of 51.3, and the tests that use it 212.9 instead of 291.8
  (docs/notes.md, 2026-12-02). What the tests check of the reader (spans, scores, EM) they
  compute from the model they load."""
  import torch
  from transformers import BertConfig, BertModel

  from realm_jax.checkpoints import minilm_dir
  from realm_jax.configs.pretrain import TINY_BERT
  directory = tmp_path_factory.mktemp("tiny_reader")
  torch.manual_seed(0)
  sizes = {k: v for k, v in TINY_BERT.items() if k != "retriever_proj_size"}  # (no retriever)
  BertModel(BertConfig(**sizes)).save_pretrained(directory)
  shutil.copy(os.path.join(minilm_dir(), "vocab.txt"), directory)
  return str(directory)


@pytest.fixture(scope="session")
def tiny_qa_workdir(tmp_path_factory, tiny_reader):
  """One tiny open-QA fine-tuning run, shared by test_finetune and test_ask: 40 articles,
  2 retriever-only steps then 2 joint steps, dev evaluation every 2 steps, the `tiny_reader`. Run
  as a user runs it (experiments/finetune.py, one device: on the 8 fake devices of 2 cores it
  takes ~20 s more)."""
  import forked_runs
  workdir = _SCRATCH["tiny_qa_workdir"] = str(tmp_path_factory.mktemp("qa_tiny"))
  got = forked_runs.run(
      [sys.executable, os.path.join(ROOT, "experiments", "finetune.py"),
       f"--config={ROOT}/realm_jax/configs/finetune.py:tiny", f"--workdir={workdir}",
       f"--config.data.local_dir={NQ_OPEN}", "--config.retriever_steps=2",
       f"--config.reader_weights={tiny_reader}"],
      env=one_device_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert got.returncode == 0, got.stderr[-5000:]
  with open(workdir + ".log", "w") as f:  # its log, beside it (test_finetune reads it)
    f.write(got.stderr)
  return workdir


@pytest.fixture(scope="session")
def articles():
  """The embedded corpus's Wikipedia summaries (the demo extra)."""
  from realm_jax.data.wiki_vital import load_articles
  try:
    return load_articles()
  except FileNotFoundError as e:
    pytest.skip(str(e))


def importorskip_scann():
  """ScaNN's searcher module as realm_jax imports it (without TensorFlow: scann_searcher.scann_ops),
  or the test skipped when ScaNN is not installed."""
  from realm_jax.retrieval.scann_searcher import scann_ops
  try:
    return scann_ops()
  except ModuleNotFoundError as e:
    pytest.skip(f"needs scann: {e}")


def damaged_best_copy(workdir, tmp_path):
  """(copy, its kept step directory): a copy of a fine-tuning work directory whose kept model
  (best/<step>) lost its largest data file."""
  import pathlib
  from realm_jax.systems import open_qa
  where = pathlib.Path(tmp_path) / "w"
  shutil.copytree(workdir, where)
  (step,) = [p for p in (where / open_qa.BEST).iterdir() if p.name.isdigit()]
  biggest = max((p for p in (step / "state").rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)
  biggest.unlink()
  return where, step


# The mesh the sharded-step tests compare with one device: every kind of split at once.
MESH_3D = "data=2,fsdp=2,tensor=2"


def laid_out(spec: str, params, tx):
  """(state shardings, batch sharding, replicated) of a TrainState of `params` and `tx` on a mesh
  `spec` (e.g. MESH_3D, or "data=1": one device) over the first devices it takes, with the
  parameters split by realm_jax/sharding.py's default rules, as the training loop splits them."""
  import math

  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from realm_jax import sharding
  from realm_jax.train.realm_step import TrainState
  n = math.prod(int(p.split("=")[1]) for p in spec.split(","))
  mesh = sharding.make_mesh(jax.devices()[:n], sharding.mesh_axes(spec, n))
  shardings = sharding.param_shardings(params, mesh, sharding.parse_rules(""))
  state = jax.eval_shape(lambda p: TrainState.create(apply_fn=None, params=p, tx=tx), params)
  return (sharding.state_shardings(state, params, shardings, mesh),
          sharding.batch_sharding(mesh), NamedSharding(mesh, P()))


def split_arrays(tree) -> int:
  """How many arrays of `tree` no device holds whole (split over the mesh)."""
  import jax
  return sum(a.addressable_shards[0].data.shape != a.shape for a in jax.tree.leaves(tree))
