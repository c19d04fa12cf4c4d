"""gs:// work directories through the same code as local ones, without a network.

The `gcs` fixture serves gs:// with an in-memory object store that behaves like GCS where it
matters: no directories (a "directory" is a name prefix), an object appears only when its upload
ends (which sets its modification time), no appends, and no renames (on GCS a rename is a copy,
which realm_jax must not count on). It is reached the way a TPU VM without TensorFlow reaches GCS: etils.epath -> fsspec -> the "gs"
filesystem (gcsfs there, this fake here). Code that fell back to `os`/`open()` on a gs:// path
would find nothing in the store (and would leave a local `gs:` folder, which the fixture checks).
`test_tf_gfile_backend` takes epath's other gs:// road, tf.io.gfile (when TensorFlow is installed),
over a local folder.
"""

import importlib
import io
import json
import os
import re
import struct
import time

import chex
import fsspec
import fsspec.config
import jax
import numpy as np
import pytest
from etils import epath
from etils.epath import backend as epath_backend
from etils.epath import gpath

from realm_jax import io_utils
from realm_jax.retrieval.index import DocIndex
from realm_jax.retrieval.index_store import latest_index_dir, publish_index, read_manifest

BUCKET = "gs://bucket"


class _Upload(io.BytesIO):
  """A GCS upload: the object appears (whole) when the file is closed."""

  def __init__(self, fs: "FakeGCS", key: str):
    super().__init__()
    self._fs, self._key = fs, key

  def close(self):
    if not self.closed:
      self._fs.put_object(self._key, self.getvalue())
    super().close()


class FakeGCS(fsspec.AbstractFileSystem):
  """fsspec's "gs" protocol over a dict {"bucket/name": bytes}."""

  protocol = ("gs", "gcs")
  cachable = False
  store: dict[str, bytes] = {}
  updated: dict[str, int] = {}  # GCS's "updated" time of each object: here, an upload counter

  def put_object(self, key, data):
    self.store[key] = data
    self.updated[key] = max(self.updated.values(), default=0) + 1

  def __init__(self, *args, finalize_on_close=True, **kwargs):
    del finalize_on_close  # gcsfs's option, which epath passes
    super().__init__(*args, **kwargs)
    type(self).options = kwargs

  def _children(self, path):
    prefix = path.rstrip("/") + "/"
    files, dirs = [], set()
    for key, data in self.store.items():
      if key.startswith(prefix):
        head, sep, _ = key[len(prefix):].partition("/")
        if sep:
          dirs.add(prefix + head)
        else:
          files.append({"name": key, "size": len(data), "type": "file"})
    return files + [{"name": d, "size": 0, "type": "directory"} for d in sorted(dirs)]

  def ls(self, path, detail=True, **kwargs):
    path = self._strip_protocol(path)
    if path in self.store:
      out = [self.info(path)]
    else:
      out = self._children(path)
      if not out and "/" in path:
        raise FileNotFoundError(path)
    return out if detail else [o["name"] for o in out]

  def info(self, path, **kwargs):
    path = self._strip_protocol(path)
    if path in self.store:
      return {"name": path, "size": len(self.store[path]), "type": "file",
              "mtime": self.updated.get(path, 0)}
    if "/" not in path or self._children(path):  # a bucket, or a prefix of some object
      return {"name": path, "size": 0, "type": "directory"}
    raise FileNotFoundError(path)

  def _open(self, path, mode="rb", **kwargs):
    path = self._strip_protocol(path)
    if mode == "rb":
      if path not in self.store:
        raise FileNotFoundError(path)
      return io.BytesIO(self.store[path])
    if mode == "wb":
      return _Upload(self, path)
    raise NotImplementedError(f"{mode!r}: GCS objects cannot be appended to or updated.")

  def mkdir(self, path, create_parents=True, **kwargs):
    pass  # as gcsfs below a bucket: there are no directories

  def makedirs(self, path, exist_ok=False):
    pass

  def rmdir(self, path):
    pass

  def rm_file(self, path):
    path = self._strip_protocol(path)
    if path in self.store:
      del self.store[path]
    elif not self._children(path):
      raise FileNotFoundError(path)

  def mv(self, path1, path2, **kwargs):
    raise AssertionError(f"rename {path1} -> {path2}: on GCS a rename is a copy, not atomic.")

  def cp_file(self, path1, path2, **kwargs):
    self.put_object(self._strip_protocol(path2), self.store[self._strip_protocol(path1)])


def _clear_backend_caches():
  gpath._is_tf_installed.cache_clear()
  epath_backend._FileSystemSpecBackend._get_filesystem.cache_clear()
  io_utils._check_gcs_backend.cache_clear()


@pytest.fixture
def gcs(monkeypatch, tmp_path):
  """The fake store (dict), served for gs://; the local cache and the working directory in
  tmp_path."""
  monkeypatch.setenv("EPATH_USE_TF", "false")  # the fsspec path, as on a TPU VM without TF
  registry = importlib.import_module("fsspec.registry")._registry
  for name in FakeGCS.protocol:
    monkeypatch.setitem(registry, name, FakeGCS)
  monkeypatch.setattr(FakeGCS, "store", {})
  monkeypatch.setattr(FakeGCS, "updated", {})
  monkeypatch.setattr(fsspec.config, "conf", {})  # io_utils sets gcsfs options there
  monkeypatch.setenv(io_utils.CACHE_ENV, str(tmp_path / "cache"))
  (tmp_path / "cwd").mkdir()
  monkeypatch.chdir(tmp_path / "cwd")
  _clear_backend_caches()
  yield FakeGCS.store
  _clear_backend_caches()
  assert os.listdir(tmp_path / "cwd") == [], "something wrote a gs:// path to the local disk"


def _keys(store, prefix):
  return sorted(k[len(prefix):] for k in store if k.startswith(prefix))


def test_files_round_trip(gcs):
  path = f"{BUCKET}/w/sub/obj.json"
  io_utils.write_json(path, {"a": [1, 2]})
  assert json.loads(gcs["bucket/w/sub/obj.json"]) == {"a": [1, 2]}
  # Other processes write the work directory: no stale listings from gcsfs's cache.
  assert FakeGCS.options.get("use_listings_cache") is False
  assert io_utils.read_json(path) == {"a": [1, 2]}
  io_utils.write_json(path, {"a": 3})  # replaced in one piece
  assert io_utils.read_json(path) == {"a": 3}

  io_utils.write_text(f"{BUCKET}/w/rows.jsonl", '{"x": 1}\n\n{"x": 2}\n')
  assert list(io_utils.iter_jsonl(f"{BUCKET}/w/rows.jsonl")) == [(1, {"x": 1}), (3, {"x": 2})]
  io_utils.write_text(f"{BUCKET}/w/bad.jsonl", '{"x": 1}\n{"x": \n')
  with pytest.raises(ValueError, match=r"gs://bucket/w/bad.jsonl:2:7: not valid JSON"):
    list(io_utils.iter_jsonl(f"{BUCKET}/w/bad.jsonl"))
  with pytest.raises(FileNotFoundError, match="File gs://bucket/w/none.jsonl does not exist"):
    list(io_utils.iter_jsonl(f"{BUCKET}/w/none.jsonl"))

  with io_utils.local_file(path) as local:  # for readers of local files only
    assert not io_utils.is_remote(local) and json.load(open(local)) == {"a": 3}
  assert not os.path.exists(local)
  assert io_utils.local_dir(f"{BUCKET}/w/data") == os.path.join(
      os.environ[io_utils.CACHE_ENV], "gs", "bucket", "w", "data")
  assert io_utils.absolute(f"{BUCKET}/w") == f"{BUCKET}/w"


def test_local_copy_of_a_path_with_dot_parts_is_refused(monkeypatch, tmp_path):
  """gs://bucket/../../x names an object "../../x"; its local copy went two levels up from the
  cache's gs/bucket, and gs://bucket/./x shared the copy of gs://bucket/x."""
  monkeypatch.setenv(io_utils.CACHE_ENV, str(tmp_path / "cache"))
  for path, part in [("gs://bucket/../../x", ".."), ("gs://bucket/w/./data", "."),
                     ("gs://bucket/w/..", ".."), ("gs://../etc", "..")]:
    with pytest.raises(ValueError, match=rf"The remote path {re.escape(path)} has a '{part}' part"):
      io_utils.local_dir(path)
  assert io_utils.local_dir("gs://bucket/w/x..y/") == str(tmp_path / "cache/gs/bucket/w/x..y")
  assert io_utils.local_dir("../w") == "../w"  # a local path is the user's to resolve


def test_json_errors_name_file_line_and_column(tmp_path):
  meta = tmp_path / "meta.json"
  meta.write_text('{"a": 1,\n "b": ,\n "c": 3}\n')
  message = rf"^{re.escape(str(meta))}:2:7: not valid JSON \(Expecting value\)\.$"
  with pytest.raises(json.JSONDecodeError, match=message) as e:
    io_utils.read_json(meta)
  assert (e.value.msg, e.value.lineno, e.value.colno) == ("Expecting value", 2, 7)  # for callers
  rows = tmp_path / "rows.jsonl"
  rows.write_text('{"a": 1}\n\n{"b": 2,, "c": 3}\n')
  with pytest.raises(ValueError, match=rf"^{re.escape(str(rows))}:3:9: not valid JSON \(Expecting "
                                       r"property name enclosed in double quotes\)\.$"):
    list(io_utils.iter_jsonl(rows))
  rows.write_text('{"a": 1}\n{"b": \n')  # cut short: the error is at the end of line 2, not on 3
  with pytest.raises(ValueError, match=rf"^{re.escape(str(rows))}:2:7: not valid JSON"):
    list(io_utils.iter_jsonl(rows))


def test_directory_upload_puts_the_marker_last_and_download_mirrors_it(gcs, tmp_path,
                                                                        monkeypatch):
  uploaded = []
  close = _Upload.close
  monkeypatch.setattr(_Upload, "close", lambda f: (uploaded.append(f._key), close(f)))

  def write(tmp):
    os.makedirs(os.path.join(tmp, "sub"))
    for name in ("b.bin", "manifest.json", "a.bin", "sub/c.bin"):
      with open(os.path.join(tmp, name), "w") as f:
        f.write(name)

  io_utils.atomic_write_dir(f"{BUCKET}/w/d", write, marker="manifest.json")
  assert uploaded[-1] == "bucket/w/d/manifest.json"
  assert _keys(gcs, "bucket/w/d/") == ["a.bin", "b.bin", "manifest.json", "sub/c.bin"]

  local = str(tmp_path / "mirror")
  assert io_utils.download_dir(f"{BUCKET}/w/d", local, marker="manifest.json")
  assert sorted(io_utils.list_files(local)) == ["a.bin", "b.bin", "manifest.json", "sub/c.bin"]
  assert open(os.path.join(local, "sub", "c.bin")).read() == "sub/c.bin"
  # Without its marker a remote directory is not complete: nothing to download.
  del gcs["bucket/w/d/manifest.json"]
  assert not io_utils.download_dir(f"{BUCKET}/w/d", str(tmp_path / "other"), marker="manifest.json")
  assert not os.path.exists(tmp_path / "other")
  io_utils.upload_dir(local, f"{BUCKET}/w/d", marker="manifest.json")
  assert gcs["bucket/w/d/manifest.json"] == b"manifest.json"


def test_index_publish_latest_load_round_trip(gcs, monkeypatch):
  rng = np.random.default_rng(0)
  emb = rng.normal(size=(20, 8)).astype(np.float32)
  ids = rng.choice(2**40, 20, replace=False).astype(np.int64)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  index = DocIndex(emb, ids, mesh=mesh)
  root = f"{BUCKET}/w/index"
  assert latest_index_dir(root) is None
  path = publish_index(root, index, 3, model_fingerprint="m", corpus_fingerprint="c")
  assert path == f"{root}/index-00000003"
  assert _keys(gcs, "bucket/w/index/") == ["LATEST", "index-00000003/index.safetensors",
                                           "index-00000003/manifest.json"]
  assert latest_index_dir(root) == path and read_manifest(path)["step"] == 3

  loaded = DocIndex.load(path, expected_dim=8, expected_corpus_fingerprint="c", mesh=mesh)
  np.testing.assert_array_equal(loaded.embeddings(), emb)
  np.testing.assert_array_equal(loaded.block_ids, ids)
  q = rng.normal(size=(4, 8)).astype(np.float32)
  for a, b in zip(loaded.search(q, 5), index.search(q, 5)):
    np.testing.assert_array_equal(a, b)

  # An upload cut short (arrays there, manifest not yet) is never returned, with or without LATEST.
  publish_index(root, index, 5, model_fingerprint="m", corpus_fingerprint="c")
  del gcs["bucket/w/index/index-00000005/manifest.json"]
  assert latest_index_dir(root) == path
  del gcs["bucket/w/index/LATEST"]
  assert latest_index_dir(root) == path
  # Republishing a step replaces it: the old manifest goes first, the new one comes last.
  publish_index(root, index, 5, model_fingerprint="m", corpus_fingerprint="c")
  manifest = "bucket/w/index/index-00000005/manifest.json"
  seen = []
  close = _Upload.close
  monkeypatch.setattr(_Upload, "close",
                      lambda f: (seen.append((f._key, manifest in gcs)), close(f)))
  publish_index(root, index, 5, model_fingerprint="m2", corpus_fingerprint="c")
  assert ("bucket/w/index/index-00000005/index.safetensors", False) in seen
  assert latest_index_dir(root) == f"{root}/index-00000005"
  assert read_manifest(f"{root}/index-00000005")["model_fingerprint"] == "m2"


def test_async_watcher_looks_at_a_gs_root_every_few_seconds(gcs, monkeypatch):
  from realm_jax.train import refresh
  looks = []
  monkeypatch.setattr(refresh, "latest_index_dir", looks.append)  # finds nothing, each time
  for root, expected in ((f"{BUCKET}/w/index", 1), ("work/index", 5)):
    looks.clear()
    watcher = refresh.AsyncIndexWatcher(root, None, 8, {}, None)
    assert [watcher.poll() for _ in range(5)] == [None] * 5
    assert len(looks) == expected, root
    watcher.close()


def _tb_scalars(data: bytes):
  """(tag, step, value) of a TensorBoard event file's scalars."""
  from tensorboardX.proto import event_pb2
  out, pos = [], 0
  while pos < len(data):
    (length,) = struct.unpack("Q", data[pos:pos + 8])
    event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
    pos += 12 + length + 4
    out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
  return out


def test_metrics_writer_rewrites_instead_of_appending_and_resumes(gcs):
  from realm_jax.train.metrics_writer import MetricsWriter
  workdir = f"{BUCKET}/run"
  writer = MetricsWriter(workdir)
  writer.write(1, {"loss": 2.0}, "train")
  writer.write(2, {"loss": 1.5}, "train")
  writer.close()
  resumed = MetricsWriter(workdir)  # a resumed run continues the same history
  resumed.write(3, {"loss": 1.0}, "heldout")
  resumed.close()
  rows = [row for _, row in io_utils.iter_jsonl(f"{workdir}/metrics.jsonl")]
  assert rows == [{"step": 1, "split": "train", "loss": 2.0},
                  {"step": 2, "split": "train", "loss": 1.5},
                  {"step": 3, "split": "heldout", "loss": 1.0}]
  events = [k for k in gcs if k.startswith("bucket/run/tb/events.out.tfevents.")]
  assert len(events) == 2  # one file per run, as locally
  scalars = sorted(s for k in events for s in _tb_scalars(gcs[k]))
  assert scalars == [("heldout/loss", 3, 1.0), ("train/loss", 1, 2.0), ("train/loss", 2, 1.5)]
  # Resumed from step 1's checkpoint: the rows of steps 2 and 3 were logged by a run that stopped
  # before checkpointing them; this run logs step 2 again, once.
  again = MetricsWriter(workdir)
  again.resume_at(1)
  again.write(2, {"loss": 1.25}, "train")
  again.close()
  rows = [row for _, row in io_utils.iter_jsonl(f"{workdir}/metrics.jsonl")]
  assert rows == [{"step": 1, "split": "train", "loss": 2.0},
                  {"step": 2, "split": "train", "loss": 1.25}]
  # Killed before its first checkpoint, the run starts over and evaluates step 0 again: once.
  # (It was logged twice, and the rows then differed from an uninterrupted run's.)
  killed = MetricsWriter(workdir)
  killed.resume_at(0)
  for step, split in ((0, "heldout"), (1, "train")):
    killed.write(step, {"loss": 3.0}, split)
  killed.close()
  over = MetricsWriter(workdir)
  over.resume_at(0)
  over.write(0, {"loss": 3.0}, "heldout")
  over.close()
  rows = [row for _, row in io_utils.iter_jsonl(f"{workdir}/metrics.jsonl")]
  assert rows == [{"step": 0, "split": "heldout", "loss": 3.0}]


def test_tensorboard_hides_the_events_a_resumed_run_logs_again(tmp_path):
  """Read back by TensorBoard itself: after resume_at(1), the stopped run's events of steps 2-3
  are hidden and step 2 shows this run's value."""
  accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
  from realm_jax.train.metrics_writer import MetricsWriter
  first = MetricsWriter(str(tmp_path))
  for step, loss in ((1, 2.0), (2, 1.5), (3, 1.2)):
    first.write(step, {"loss": loss}, "train")
  first.close()
  # TensorBoard reads event files in name order, and names hold the second they were made in (a
  # resumed process starts seconds later at least).
  time.sleep(1.1)
  again = MetricsWriter(str(tmp_path))
  again.resume_at(1)
  again.write(2, {"loss": 1.25}, "train")
  again.close()
  events = accumulator.EventAccumulator(str(tmp_path / "tb"))
  events.Reload()
  assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.0), (2, 1.25)]


def test_plot_reads_and_writes_gs(gcs):
  pytest.importorskip("matplotlib")
  from realm_jax.train.plot import plot_metrics
  io_utils.write_text(f"{BUCKET}/run/metrics.jsonl", "".join(
      json.dumps({"step": s, "split": "train", "loss": 1.0 / s, "accuracy": 0.1 * s,
                  "null_accuracy": 0.05 * s, "retrieval_utility": 0.01 * s,
                  "retrieval_entropy": 1.0}) + "\n" for s in (1, 2, 3)))
  assert plot_metrics(f"{BUCKET}/run") == f"{BUCKET}/run/curves.png"
  assert gcs["bucket/run/curves.png"].startswith(b"\x89PNG")


WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", "paris", "is", "the", "capital",
         "of", "france", "lyon", "a", "city", "in", "berlin", "germany", "river", "seine", "rhine",
         "on", "near", "and", "big"]
CITIES = [("Paris", "France", "Seine"), ("Lyon", "France", "Rhine"), ("Berlin", "Germany", "Rhine")]


def _docs(n=40):
  docs = []
  for i in range(n):
    city, country, river = CITIES[i % 3]
    other = CITIES[(i // 3) % 3]
    text = (f"The city of {city} is in {country}. A big river near {city} is the {river}. "
            f"The {other[2]} is a river in {other[1]}, near {other[0]}.")
    docs.append({"title": f"{city} {i}", "text": text})
  return docs


@pytest.fixture
def corpus_setup(gcs, tmp_path):
  """A JSONL corpus in the store and a vocabulary on the local disk (as the model's is)."""
  pytest.importorskip("tensorflow_datasets")
  vocab = tmp_path / "vocab.txt"
  vocab.write_text("\n".join(WORDS) + "\n")
  gcs["bucket/corpus/part-0.jsonl"] = "".join(json.dumps(d) + "\n" for d in _docs()).encode()
  return str(vocab)


def test_corpus_and_examples_in_a_gs_data_dir(gcs, corpus_setup, tmp_path, monkeypatch):
  from realm_jax.data.corpus import Corpus, CorpusConfig, RealmBlocks
  from realm_jax.data.pretrain import build_examples, pretrain_batches, special_ids
  from realm_jax.data.sources import jsonl_files
  from realm_jax.text import BertTokenizer
  tok = BertTokenizer(corpus_setup)
  config = CorpusConfig(source="jsonl", paths=(f"{BUCKET}/corpus",), vocab_file=corpus_setup,
                        block_length=32)
  data = f"{BUCKET}/w/data"
  assert jsonl_files([f"{BUCKET}/corpus/*.jsonl"]) == jsonl_files([f"{BUCKET}/corpus"]) == [
      f"{BUCKET}/corpus/part-0.jsonl"]
  corpus = Corpus.build(f"{data}/corpus", config)
  built = _keys(gcs, "bucket/w/data/corpus/")
  assert any(k.endswith("/dataset_info.json") for k in built)
  assert any(k.endswith("/block_ids.safetensors") for k in built)
  assert any(".array_record" in k for k in built)
  examples = f"{data}/examples"
  kw = dict(query_length=24, max_masked=4, tagger="regex", heldout_percent=50)
  manifest = build_examples(corpus, tok, examples, **kw)
  assert _keys(gcs, "bucket/w/data/examples/") == [
      "heldout.array_record", "manifest.json", "train.array_record"]
  assert manifest["examples"]["train"] >= 4

  # Another host (or a fresh VM): an empty local cache gets the work directory's copies, without
  # building anything again.
  monkeypatch.setenv(io_utils.CACHE_ENV, str(tmp_path / "cache2"))
  monkeypatch.setattr(RealmBlocks, "_generate_examples",
                      lambda self: pytest.fail("rebuilt the corpus instead of downloading it"))
  again = Corpus.build(f"{data}/corpus", config)
  assert again.data_dir.startswith(str(tmp_path / "cache2"))
  np.testing.assert_array_equal(again.block_ids, corpus.block_ids)
  assert again[3]["body"] == corpus[3]["body"]
  monkeypatch.setattr("realm_jax.data.pretrain._example",
                      lambda *a: pytest.fail("rebuilt the examples instead of downloading them"))
  assert build_examples(again, tok, examples, **kw) == manifest
  batch = next(pretrain_batches(examples, "train", batch_size=4, seed=0, query_length=24,
                                max_masked=4, tokenizer_ids=special_ids(tok)))
  assert batch["input_ids"].shape == (4, 24)


def _tiny_scorer(directory, seed=0):
  """A tiny HF REALM scorer with separate towers and a vocab.txt (what the ICT export holds),
  saved with realm_jax's own writer; returns (config, params)."""
  from realm_jax.checkpoints import save_hf_checkpoint
  from realm_jax.checkpoints.hf import abstract_params
  from realm_jax.models import tiny_config
  config = tiny_config(vocab_size=len(WORDS), num_hidden_layers=1)
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda s: rng.normal(0, 0.2, s.shape).astype(np.float32),
                        abstract_params("retriever", config, share_embedders=False))
  save_hf_checkpoint(directory, config, params, "retriever")
  io_utils.write_text(f"{directory}/vocab.txt", "\n".join(WORDS) + "\n")
  return config, params


def test_hf_checkpoint_in_gs_loads_as_the_local_one(gcs, tmp_path, monkeypatch):
  from realm_jax.checkpoints import load_hf_checkpoint
  from realm_jax.models import RealmConfig
  from realm_jax.retrieval.towers import load_towers
  from realm_jax.text import BertTokenizer
  remote, local = f"{BUCKET}/models/ict", str(tmp_path / "ict")
  uploads = []
  close = _Upload.close
  monkeypatch.setattr(_Upload, "close", lambda f: (uploads.append(f._key), close(f)))
  config, params = _tiny_scorer(remote)
  assert uploads[:2] == ["bucket/models/ict/model.safetensors", "bucket/models/ict/config.json"]
  assert _keys(gcs, "bucket/models/ict/") == ["config.json", "model.safetensors", "vocab.txt"]
  _tiny_scorer(local)

  want = load_hf_checkpoint(local)
  got = load_hf_checkpoint(remote)
  assert got[0] == want[0] == config
  chex.assert_trees_all_equal(got[1:], want[1:])
  chex.assert_trees_all_equal(got[1], params)
  cached = io_utils.local_dir(remote)
  assert sorted(os.listdir(cached)) == [".realm_jax_source.json", "config.json",
                                        "model.safetensors", "vocab.txt"]
  assert RealmConfig.from_json_file(f"{remote}/config.json") == config
  assert BertTokenizer(f"{remote}/vocab.txt").encode("paris is in france") == [7, 8, 16, 12]
  batch = dict(input_ids=np.array([[2, 7, 8, 3]], np.int32),
               attention_mask=np.ones((1, 4), np.int32), token_type_ids=np.zeros((1, 4), np.int32))
  for which in ("query", "document"):
    np.testing.assert_array_equal(load_towers(remote)[which].embed(batch),
                                  load_towers(local)[which].embed(batch))

  # The copy in the cache is used while the remote files stay the same...
  with monkeypatch.context() as m:
    m.setattr(io_utils, "download_dir", lambda *a, **k: pytest.fail("downloaded again"))
    chex.assert_trees_all_equal(load_hf_checkpoint(remote)[1], params)
  # ... and replaced when new weights come, though config.json has the same bytes.
  config_json = gcs["bucket/models/ict/config.json"]
  _, new = _tiny_scorer(remote, seed=1)
  assert gcs["bucket/models/ict/config.json"] == config_json
  chex.assert_trees_all_equal(load_hf_checkpoint(remote)[1], new)

  # Errors name the gs:// path and say what is wrong.
  with pytest.raises(FileNotFoundError, match="gs://bucket/models/none does not exist"):
    load_hf_checkpoint(f"{BUCKET}/models/none")
  io_utils.write_text(f"{BUCKET}/models/half/model.safetensors", "x")
  with pytest.raises(FileNotFoundError, match="gs://bucket/models/half has no config.json"):
    load_hf_checkpoint(f"{BUCKET}/models/half")
  io_utils.write_text(f"{BUCKET}/models/pt/pytorch_model.bin", "x")
  io_utils.write_text(f"{BUCKET}/models/pt/config.json", "{}")
  with pytest.raises(FileNotFoundError, match=r"No model.safetensors in gs://bucket/models/pt\. "
                     "It has pytorch_model.bin, a pickle"):
    load_hf_checkpoint(f"{BUCKET}/models/pt")


def test_corpus_embedding_in_gs_matches_the_local_one_and_resumes(gcs, corpus_setup, tmp_path,
                                                                   monkeypatch):
  from realm_jax.data.corpus import Corpus, CorpusConfig
  from realm_jax.retrieval.embed import embed_corpus
  from realm_jax.retrieval.towers import load_towers
  _tiny_scorer(str(tmp_path / "ict"))
  tower = load_towers(str(tmp_path / "ict"))["document"]
  corpus = Corpus.build(str(tmp_path / "data"), CorpusConfig(
      source="jsonl", paths=(f"{BUCKET}/corpus",), vocab_file=corpus_setup, block_length=32))
  shard_size = -(-len(corpus) // 3)  # 3 shards
  kw = dict(max_length=48, shard_size=shard_size, batch_size=8, fingerprint="f")
  want = embed_corpus(corpus, tower.embed, tower.tokenizer, str(tmp_path / "emb"), **kw)
  remote, prefix = f"{BUCKET}/w/embeddings/f", "bucket/w/embeddings/f/"
  shards = [f"shard-0000{s}-of-00003.safetensors" for s in range(3)]
  got = embed_corpus(corpus, tower.embed, tower.tokenizer, remote, **kw)
  np.testing.assert_array_equal(got, want)
  assert _keys(gcs, prefix) == ["embedding.json"] + shards
  for name in shards:  # the same files as locally
    assert gcs[prefix + name] == (tmp_path / "emb" / name).read_bytes()

  # A second run reads the shards back: nothing embedded or uploaded again...
  uploads = []
  close = _Upload.close
  monkeypatch.setattr(_Upload, "close", lambda f: (uploads.append(f._key), close(f)))
  no_embed = lambda b: pytest.fail("embedded again instead of resuming")
  np.testing.assert_array_equal(embed_corpus(corpus, no_embed, tower.tokenizer, remote, **kw), want)
  assert uploads == []
  # ... and a run cut short after some shards embeds only the missing one.
  del gcs[prefix + shards[1]]
  rows = []
  counted = lambda b: (rows.append(int(b["attention_mask"].any(-1).sum())), tower.embed(b))[1]
  np.testing.assert_array_equal(embed_corpus(corpus, counted, tower.tokenizer, remote, **kw), want)
  assert uploads == [prefix + shards[1]]
  assert sum(rows) == min(len(corpus), 2 * shard_size) - shard_size


@pytest.mark.slow
def test_pretraining_starts_from_hf_weights_in_gs(gcs, tmp_path):
  from realm_jax.checkpoints import save_hf_checkpoint
  from realm_jax.configs.pretrain import get_config
  from realm_jax.train import memory
  from realm_jax.train.init import build_models, init_params
  out = {}
  for root in (f"{BUCKET}/models", str(tmp_path / "models")):
    model_config, params = _tiny_scorer(f"{root}/ict")
    save_hf_checkpoint(f"{root}/bert", model_config, params["embedder"]["realm"], "bert")
    config = get_config("tiny")
    config.init, config.share_embedders = "hf", False
    config.retriever_weights, config.encoder_weights = f"{root}/ict", f"{root}/bert"
    models, got_config, vocab = build_models(config)
    assert got_config == model_config and vocab == f"{root}/ict/vocab.txt"
    assert memory.model_config(config) == model_config  # the memory estimate reads it too
    out[root] = init_params(config, models, got_config, jax.random.key(0))
  remote, local = out.values()
  chex.assert_trees_all_equal(remote, local)
  chex.assert_trees_all_equal(remote["retriever"], params)
  chex.assert_trees_all_equal(remote["encoder"]["realm"]["encoder"],
                              params["embedder"]["realm"]["encoder"])


def test_ict_export_to_gs_lands_whole_and_replaces_the_old_one(gcs, tmp_path, monkeypatch):
  from realm_jax.checkpoints import load_hf_checkpoint
  from realm_jax.train.ict import export_retriever
  config, params = _tiny_scorer(str(tmp_path / "start"))
  io_utils.write_text(f"{BUCKET}/vocab.txt", "\n".join(WORDS) + "\n")  # the vocab may be remote
  export = f"{BUCKET}/w/export"
  export_retriever(export, config, params, f"{BUCKET}/vocab.txt")
  assert _keys(gcs, "bucket/w/export/") == ["config.json", "model.safetensors", "vocab.txt"]
  assert gcs["bucket/w/export/vocab.txt"] == gcs["bucket/vocab.txt"]
  chex.assert_trees_all_equal(load_hf_checkpoint(export)[1], params)

  # A later export (more steps: the same config.json) is uploaded again, config.json last.
  new = jax.tree.map(lambda p: p + 1, params)
  seen = []
  close = _Upload.close
  marker = "bucket/w/export/config.json"
  monkeypatch.setattr(_Upload, "close", lambda f: (seen.append((f._key, marker in gcs)), close(f)))
  export_retriever(export, config, new, f"{BUCKET}/vocab.txt")
  assert seen[-1] == (marker, False) and sorted(seen[:-1]) == [
      ("bucket/w/export/model.safetensors", False), ("bucket/w/export/vocab.txt", False)]
  chex.assert_trees_all_equal(load_hf_checkpoint(export)[1], new)


class _LocalTfBackend(epath_backend._TfBackend):
  """epath's tf.io.gfile backend with gs://bucket/... mapped to a local folder: TensorFlow's file
  API (lazy errors, `open` as a context manager) without a network; not GCS's semantics."""

  def __init__(self, root: str):
    self._root = root

  def _map(self, path, write=False):
    path = os.fspath(path)
    if not path.startswith("gs://"):
      return path
    local = os.path.join(self._root, path[len("gs://"):])
    if write:  # objects need no parent directories
      os.makedirs(os.path.dirname(local), exist_ok=True)
    return local

  def open(self, path, mode):
    return super().open(self._map(path, write="r" not in mode), mode)

  def exists(self, path):
    return super().exists(self._map(path))

  def isdir(self, path):
    return super().isdir(self._map(path))

  def listdir(self, path):
    return super().listdir(self._map(path))

  def glob(self, path):
    return ["gs://" + os.path.relpath(p, self._root) for p in super().glob(self._map(path))]

  def makedirs(self, path, **kwargs):
    return super().makedirs(self._map(path), **kwargs)

  def mkdir(self, path, **kwargs):
    return super().mkdir(self._map(path), **kwargs)

  def rmtree(self, path):
    return super().rmtree(self._map(path))

  def remove(self, path):
    return super().remove(self._map(path))

  def rename(self, path, dst):
    raise AssertionError(f"rename {path} -> {dst}: on GCS a rename is a copy, not atomic.")

  replace = rename

  def copy(self, path, dst, overwrite):
    return super().copy(self._map(path), self._map(dst, write=True), overwrite)

  def stat(self, path):
    return super().stat(self._map(path))


def test_tf_gfile_backend(monkeypatch, tmp_path):
  """The same round trips through epath's TensorFlow backend (used when TensorFlow is installed)."""
  pytest.importorskip("tensorflow")
  root = tmp_path / "tf-gs"
  fake = _LocalTfBackend(str(root))
  monkeypatch.delenv("EPATH_USE_TF", raising=False)
  monkeypatch.setattr(epath_backend, "tf_backend", fake)
  monkeypatch.setattr(gpath, "_GCS_BACKENDS", frozenset({fake, epath_backend.fsspec_backend}))
  monkeypatch.setenv(io_utils.CACHE_ENV, str(tmp_path / "cache"))
  (tmp_path / "cwd").mkdir()
  monkeypatch.chdir(tmp_path / "cwd")
  _clear_backend_caches()
  try:
    io_utils.write_text(f"{BUCKET}/w/rows.jsonl", '{"x": 1}\n')
    assert (root / "bucket/w/rows.jsonl").read_text() == '{"x": 1}\n'
    assert list(io_utils.iter_jsonl(f"{BUCKET}/w/rows.jsonl")) == [(1, {"x": 1})]
    with pytest.raises(FileNotFoundError, match="gs://bucket/w/none.jsonl does not exist"):
      list(io_utils.iter_jsonl(f"{BUCKET}/w/none.jsonl"))

    emb = np.arange(24, dtype=np.float32).reshape(6, 4)
    index = DocIndex(emb, np.arange(6) * 7, mesh=jax.sharding.Mesh(np.array(jax.devices()[:2]),
                                                                   ("data",)))
    path = publish_index(f"{BUCKET}/w/index", index, 2, model_fingerprint="m",
                         corpus_fingerprint="c")
    assert latest_index_dir(f"{BUCKET}/w/index") == path
    np.testing.assert_array_equal(DocIndex.load(path).embeddings(), emb)
    assert io_utils.download_dir(path, str(tmp_path / "copy"), marker="manifest.json")
    assert sorted(os.listdir(tmp_path / "copy")) == ["index.safetensors", "manifest.json"]

    from realm_jax.train.metrics_writer import MetricsWriter
    for step in (1, 2):
      writer = MetricsWriter(f"{BUCKET}/run")
      writer.write(step, {"loss": 1.0 / step}, "train")
      writer.close()
    assert [r["step"] for _, r in io_utils.iter_jsonl(f"{BUCKET}/run/metrics.jsonl")] == [1, 2]
    assert len(os.listdir(root / "bucket/run/tb")) == 2
  finally:
    _clear_backend_caches()
  assert os.listdir(tmp_path / "cwd") == []


def test_missing_gs_backend_is_a_clear_error(monkeypatch):
  monkeypatch.setenv("EPATH_USE_TF", "false")

  def no_gcsfs(protocol):
    raise ImportError("Install gcsfs to access Google Storage")

  monkeypatch.setattr(fsspec, "get_filesystem_class", no_gcsfs)
  _clear_backend_caches()
  try:
    with pytest.raises(ImportError, match=r"pip install 'realm-jax\[gcs\]'"):
      io_utils.read_json("gs://bucket/w/config.json")
    with pytest.raises(ImportError, match=r"realm-jax\[gcs\]"):
      latest_index_dir("gs://bucket/w/index")
    assert io_utils.as_path("work/local") == epath.Path("work/local")  # local paths need nothing
  finally:
    _clear_backend_caches()
