"""Resumable corpus embedding: a run killed with SIGKILL resumes to the same result."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import devices_env, jit_init

SCRIPT = textwrap.dedent("""
    import os, sys, time
    import jax, numpy as np
    from realm_jax.data.corpus import Corpus, CorpusConfig
    from realm_jax.models import RealmEmbedder, tiny_config
    from realm_jax.retrieval.embed import embed_corpus
    from realm_jax.text import BertTokenizer

    docs, vocab, out, slow = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    corpus = Corpus.build(os.path.join(out, "data"), CorpusConfig(
        source="jsonl", paths=(docs,), vocab_file=vocab))
    tok = BertTokenizer(vocab)
    model = RealmEmbedder(tiny_config(vocab_size=tok.vocab_size, max_position_embeddings=64))
    x = np.ones((1, 8), np.int32)
    params = jax.jit(model.init)(jax.random.key(0), x, x, x)["params"]
    fn = jax.jit(lambda b: model.apply({"params": params}, b["input_ids"], b["attention_mask"],
                                       b["token_type_ids"]))
    def embed(b):
      time.sleep(slow)  # lets the test kill the run between shards
      return fn(b)
    emb = embed_corpus(corpus, embed, tok, os.path.join(out, "emb"), max_length=48,
                       shard_size=4, batch_size=2, fingerprint="test")
    from safetensors.numpy import save_file
    save_file({"e": emb}, os.path.join(out, "result.safetensors"))
""")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("embed")
  words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."] + [f"w{i}" for i in range(50)]
  (root / "vocab.txt").write_text("\n".join(words) + "\n")
  rng = np.random.default_rng(0)
  docs = [{"title": f"w{i % 50}", "text": " ".join(f"w{j}" for j in rng.integers(0, 50, 5 + i)) + "."}
          for i in range(30)]
  (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
  (root / "run.py").write_text(SCRIPT)
  return root


def _run(setup, out, slow, wait=True):
  cmd = [sys.executable, str(setup / "run.py"), str(setup / "docs.jsonl"), str(setup / "vocab.txt"),
         str(out), str(slow)]
  env = devices_env(2)
  if wait:
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    return None
  return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _result(out):
  from safetensors.numpy import load_file
  return load_file(str(out / "result.safetensors"))["e"]


@pytest.mark.slow
def test_sigkilled_embedding_resumes_to_the_same_result(setup, tmp_path):
  _run(setup, tmp_path / "full", slow=0.0)
  full = _result(tmp_path / "full")
  assert full.shape == (30, 16)

  out = tmp_path / "killed"
  proc = _run(setup, out, slow=0.3, wait=False)
  emb_dir = out / "emb"
  deadline = time.time() + 120
  while time.time() < deadline:
    shards = [f for f in os.listdir(emb_dir) if f.startswith("shard-")] if emb_dir.exists() else []
    if len(shards) >= 2:
      break
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  done = sorted(f for f in os.listdir(emb_dir) if f.startswith("shard-"))
  assert 2 <= len(done) < 8, done  # killed midway: 8 shards of 4 rows in all
  assert not (out / "result.safetensors").exists()

  _run(setup, out, slow=0.0)  # resumes
  np.testing.assert_array_equal(_result(out), full)
  assert len([f for f in os.listdir(emb_dir) if f.startswith("shard-")]) == 8
  assert not [f for f in os.listdir(emb_dir) if f.startswith(".tmp")]


def test_embedding_dir_of_other_settings_is_refused(setup, tmp_path):
  from realm_jax.data.corpus import Corpus, CorpusConfig
  from realm_jax.retrieval.embed import embed_corpus
  corpus = Corpus.build(str(tmp_path / "data"), CorpusConfig(
      source="jsonl", paths=(str(setup / "docs.jsonl"),), vocab_file=str(setup / "vocab.txt")))
  fake = lambda b: np.zeros((len(b["input_ids"]), 4), np.float32)
  from realm_jax.text import BertTokenizer
  tok = BertTokenizer(str(setup / "vocab.txt"))
  embed_corpus(corpus, fake, tok, str(tmp_path / "emb"), 48, shard_size=8, fingerprint="a")
  # Only the shard size differs: the directory's name comes from everything else.
  with pytest.raises(ValueError, match=(
      f"shard_size=8 \\(now 4\\). To reuse them pass --config.shard_size=8; to re-embed instead, "
      f"delete {tmp_path / 'emb'}.")):
    embed_corpus(corpus, fake, tok, str(tmp_path / "emb"), 48, shard_size=4, fingerprint="a")
  with pytest.raises(ValueError, match=(
      f"{tmp_path / 'emb'} holds embeddings made with other settings: fingerprint='a' "
      f"\\(now 'b'\\). To re-embed, delete {tmp_path / 'emb'}.")):
    embed_corpus(corpus, fake, tok, str(tmp_path / "emb"), 48, shard_size=8, fingerprint="b")
  for flag in ("shard_size", "batch_size"):
    with pytest.raises(ValueError, match=f"--config.{flag}=0: must be a positive number of rows"):
      embed_corpus(corpus, fake, tok, str(tmp_path / "emb0"), 48, **{flag: 0})
  assert not (tmp_path / "emb0").exists()


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory, setup):
  """A plain BERT checkpoint (config.json, model.safetensors, vocab.txt) of a cased tokenizer."""
  import jax
  from realm_jax.checkpoints import save_hf_checkpoint
  from realm_jax.models import BertModel, tiny_config
  path = tmp_path_factory.mktemp("bert")
  config = tiny_config(vocab_size=56, max_position_embeddings=64)
  x = np.ones((1, 8), np.int32)
  params = jit_init(BertModel(config, add_pooling_layer=True), 0, x, x, x)
  save_hf_checkpoint(str(path), config, params, kind="bert")
  (path / "vocab.txt").write_bytes((setup / "vocab.txt").read_bytes())
  (path / "tokenizer_config.json").write_text('{"do_lower_case": false}')
  return path


def test_tower_of_plain_bert_weights(bert_dir):
  from realm_jax.retrieval.towers import load_towers
  tower = load_towers(str(bert_dir))["document"]
  assert tower.dim == 32 and not tower.tokenizer.lowercase  # mean pooling; the checkpoint is cased
  with pytest.raises(ValueError, match=(
      f"--config.pooling=projected_cls needs REALM embedder or scorer weights.*; {bert_dir} is a "
      "plain BERT without it. Use --config.pooling=mean")):
    load_towers(str(bert_dir), pooling="projected_cls")
  with pytest.raises(ValueError, match="all-MiniLM-L6-v2 is a plain BERT"):
    load_towers("minilm", pooling="projected_cls")


def test_orbax_checkpoint_as_weights_says_what_to_pass(tmp_path):
  from realm_jax.retrieval.towers import load_towers
  from realm_jax.checkpoints import training as checkpoints
  workdir = tmp_path / "ict"
  manager = checkpoints.checkpoint_manager(str(workdir / "checkpoints"), asynchronous=False,
                                           data=False)
  checkpoints.save(manager, 3, {"w": np.zeros(2, np.float32)}, {"step": 3})
  manager.wait_until_finished()
  for weights in (workdir, workdir / "checkpoints", workdir / "checkpoints" / "3"):
    with pytest.raises(FileNotFoundError, match=(
        f"{weights} holds orbax checkpoints of a realm_jax training run \\(work directory "
        f"{workdir}\\).*experiments/ict.py.* pass {workdir}/export. Pre-training and fine-tuning "
        "checkpoints cannot be used directly")):
      load_towers(str(weights))


def test_resume_deletes_the_shard_a_killed_run_was_writing(setup, tmp_path):
  """A run killed while writing shard 1 leaves its temporary file (".tmp-shard-..."): the resumed
  run embeds that shard again, ends with the uninterrupted result and leaves no temporary file."""
  from realm_jax.data.corpus import Corpus, CorpusConfig
  from realm_jax.retrieval.embed import embed_corpus
  from realm_jax.text import BertTokenizer
  corpus = Corpus.build(str(tmp_path / "data"), CorpusConfig(
      source="jsonl", paths=(str(setup / "docs.jsonl"),), vocab_file=str(setup / "vocab.txt")))
  tok = BertTokenizer(str(setup / "vocab.txt"))
  # Row i's embedding: its length and first ids, so a shard put at the wrong rows would show.
  embed = lambda b: np.stack([b["attention_mask"].sum(-1), b["input_ids"][:, 1],
                              b["input_ids"][:, 2]], -1).astype(np.float32)
  full = embed_corpus(corpus, embed, tok, str(tmp_path / "full"), 48, shard_size=8,
                      fingerprint="f")
  out = tmp_path / "killed"
  embed_corpus(corpus, embed, tok, str(out), 48, shard_size=8, fingerprint="f")
  (out / "shard-00001-of-00004.safetensors").unlink()
  (out / ".tmp-shard-00001-of-00004.safetensorsk1ll3d").write_bytes(b"half a shard")
  np.testing.assert_array_equal(
      embed_corpus(corpus, embed, tok, str(out), 48, shard_size=8, fingerprint="f"), full)
  assert sorted(os.listdir(out)) == ["embedding.json"] + [
      f"shard-{s:05d}-of-00004.safetensors" for s in range(4)]


def _embedded(setup, tmp_path, out):
  """Embeds the corpus into `out` (4 shards of 8 rows): (a function that runs that again, the
  embeddings)."""
  from realm_jax.data.corpus import Corpus, CorpusConfig
  from realm_jax.retrieval.embed import embed_corpus
  from realm_jax.text import BertTokenizer
  corpus = Corpus.build(str(tmp_path / "data"), CorpusConfig(
      source="jsonl", paths=(str(setup / "docs.jsonl"),), vocab_file=str(setup / "vocab.txt")))
  tok = BertTokenizer(str(setup / "vocab.txt"))
  embed = lambda b: np.stack([b["attention_mask"].sum(-1), b["input_ids"][:, 1]],
                             -1).astype(np.float32)
  emb = embed_corpus(corpus, embed, tok, str(out), 48, shard_size=8, fingerprint="f")
  return lambda: embed_corpus(corpus, embed, tok, str(out), 48, shard_size=8, fingerprint="f"), emb


def test_shard_damaged_after_writing_is_refused(setup, tmp_path):
  """A shard whose bytes were overwritten (same size, valid header) was read back as embeddings;
  its checksum refuses it, naming it. Deleted, it is embedded again."""
  out = tmp_path / "emb"
  embed_again, full = _embedded(setup, tmp_path, out)
  shard = out / "shard-00001-of-00004.safetensors"
  data = bytearray(shard.read_bytes())
  data[-40:] = bytes(b ^ 0xFF for b in data[-40:])  # the last rows of the shard
  shard.write_bytes(bytes(data))
  with pytest.raises(ValueError, match=(
      rf"{shard} is corrupt: its CRC-32 is [0-9a-f]{{8}}, but it was saved with [0-9a-f]{{8}} "
      r".*Delete it and build the index again \(experiments/build_index.py\): only that shard")):
    embed_again()
  shard.write_bytes(bytes(data[:len(data) // 2]))
  with pytest.raises(ValueError, match=rf"{shard} cannot be read .*truncated or corrupt"):
    embed_again()
  shard.unlink()
  np.testing.assert_array_equal(embed_again(), full)


def test_shard_written_without_a_checksum_still_loads(setup, tmp_path):
  """Shards written before they held a checksum are read as before, unverified."""
  from safetensors.numpy import load_file, save_file
  out = tmp_path / "emb"
  embed_again, full = _embedded(setup, tmp_path, out)
  for shard in out.glob("shard-*"):
    save_file(load_file(str(shard)), str(shard))  # no metadata
  np.testing.assert_array_equal(embed_again(), full)
