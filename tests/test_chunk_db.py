"""RETRO's chunk database: the token stream and its chunks, the neighbours (against a numpy search
written here), the records, a build killed and resumed, refused settings, and the grain pipeline."""

import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from realm_jax.data.chunks import (chunk_documents, chunk_values, excluded_chunk_ranges,
                                   is_heldout)
from realm_jax.data.retro_batches import retro_batches
from realm_jax.data.sources import documents
from realm_jax.retrieval.chunk_db import MANIFEST, RetroDb, build_database
from realm_jax.retrieval.neighbours import brute_force_neighbours
from realm_jax.text.lm_tokenizer import key_inputs, load_lm_tokenizer, shares_vocab

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M, N, K = 16, 4, 2        # chunk length, chunks per sequence, neighbours
L = M * N
SETTINGS = dict(max_docs=48, chunk_length=M, seq_chunks=N, num_neighbours=K, key_length=32,
                shard_size=128)


def _config(**overrides):
  from realm_jax.configs.retro import database_config
  db = database_config()
  db.update({**SETTINGS, **overrides})
  return db


@pytest.fixture(scope="module")
def db(tmp_path_factory):
  from realm_jax.checkpoints import minilm_dir
  try:
    minilm_dir()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  return build_database(_config(), str(tmp_path_factory.mktemp("retro") / "db"))


def test_stream_is_eos_and_documents_and_split_is_stable(db):
  tok = db.tokenizer
  docs = list(documents("wiki_vital", max_docs=SETTINGS["max_docs"]))
  sides = {"train": [], "heldout": []}
  for d in docs:  # the hash written out again: SHA-256 of title \0 where, per ten thousand
    h = int.from_bytes(hashlib.sha256(f"{d['title']}\0{d['where']}".encode()).digest()[:8], "big")
    sides["heldout" if h % 10_000 < 1000 else "train"].append(d)
  assert sides["train"] and sides["heldout"]
  for split, split_docs in sides.items():
    ids = tok.encode_batch([d["text"] for d in split_docs])
    want = [tok.eos_id] + [t for x in ids for t in x + [tok.eos_id]]
    want_docs = [-1] + [i for i, x in enumerate(ids) for _ in range(len(x) + 1)]
    stream, doc_of = db.array(split, "stream"), db.array(split, "docs")
    sequences = -(-(len(want) - 1) // L)
    assert len(stream) == len(doc_of) == sequences * L + 1 == db.num_sequences(split) * L + 1
    # The chunks, end to end, are the stream; then padding only.
    chunks = stream[:db.num_chunks(split) * M].reshape(-1, M)
    np.testing.assert_array_equal(np.concatenate([chunks.ravel(), stream[-1:]])[:len(want)], want)
    assert (stream[len(want):] == tok.pad_id).all()
    np.testing.assert_array_equal(doc_of[:len(want)], want_docs)
    assert (doc_of[len(want):] == -1).all()
    meta = db.documents(split)
    assert [(x["title"], x["where"]) for x in meta] == [(d["title"], d["where"])
                                                        for d in split_docs]
    assert [m["bytes"] for m in meta] == [len(d["text"].encode()) + 1 for d in split_docs]
    assert [m["tokens"] for m in meta] == [len(x) + 1 for x in ids]
  # Disjoint, and each document's side depends on itself only: not on order, nor on max_docs.
  assert not {d["where"] for d in sides["train"]} & {d["where"] for d in sides["heldout"]}
  assert all(is_heldout(d["title"], d["where"], 10) == (d in sides["heldout"]) for d in docs)
  fewer, _ = chunk_documents(reversed(docs[:30]), tok, M, N, 10)
  for split in sides:
    assert ({d["where"] for d in fewer[split].documents}
            == {d["where"] for d in sides[split] if d in docs[:30]})


def test_small_stream_by_hand(db):
  """Three documents (one without text), m = 2, 2 chunks per sequence, all in train."""
  tok = db.tokenizer
  texts = ["paris is big", "", "rome"]
  ids = tok.encode_batch(texts)
  assert [len(x) for x in ids] == [3, 0, 1]
  docs = [{"title": t, "text": x, "where": f"doc {i}"}
          for i, (t, x) in enumerate(zip("ABC", texts))]
  splits, stats = chunk_documents(docs, tok, 2, 2, heldout_percent=0)
  e, p = tok.eos_id, tok.pad_id
  s = splits["train"]
  np.testing.assert_array_equal(s.stream, [e, *ids[0], e, *ids[2], e, p, p])
  np.testing.assert_array_equal(s.docs, [-1, 0, 0, 0, 0, 1, 1, -1, -1])
  assert [(d["title"], d["bytes"], d["tokens"]) for d in s.documents] == [("A", 13, 4), ("C", 5, 2)]
  assert stats["skipped"] == 1 and stats["skipped_examples"] == ["doc 1"]
  assert len(splits["heldout"].stream) == 1 and (s.num_sequences, s.num_chunks) == (2, 4)
  # Sequence 0 reads doc A only (chunks 0-2 hold it); sequence 1 reads A and C (chunks 0-3).
  np.testing.assert_array_equal(excluded_chunk_ranges(s.docs, 2, 2),
                                [[0, 2], [0, 2], [0, 3], [0, 3]])
  np.testing.assert_array_equal(chunk_values(s.stream, [[1, 3, -1]], 2, 4, p),
                                [[[ids[0][1], ids[0][2], e, ids[2][0]], [e, p, p, p], [p] * 4]])


def _reference_neighbours(keys, queries, query_docs, key_docs, k):
  """Top-k by inner product over the keys, leaving out every key chunk that holds a token of one
  of its query's documents: (scores, ids) [Q, k] and every score [Q, N] (-inf: left out)."""
  scores = queries.astype(np.float64) @ keys.astype(np.float64).T
  for q, barred in enumerate(query_docs):
    for j, kd in enumerate(key_docs):
      if barred & kd:
        scores[q, j] = -np.inf
  ids = np.argsort(-scores, axis=1, kind="stable")[:, :k]
  return np.take_along_axis(scores, ids, 1), ids, scores


def test_neighbours_are_the_exact_search_without_own_documents(db):
  train_keys, stream = np.asarray(db.array("train", "keys")), db.array("train", "stream")
  train_docs = db.array("train", "docs")
  indexed = np.flatnonzero((stream[:db.num_chunks("train") * M].reshape(-1, M)
                            != db.tokenizer.pad_id).any(1))  # every chunk with text
  assert len(indexed) == db.manifest["counts"]["indexed_chunks"] < db.num_chunks("train")
  key_docs = [set(train_docs[j * M:(j + 1) * M].tolist()) - {-1} for j in indexed]
  for split in ("train", "heldout"):
    queries, found = np.asarray(db.array(split, "keys")), np.asarray(db.array(split, "neighbours"))
    assert found.shape == (db.num_chunks(split), K) and found.dtype == np.int64
    if split == "train":  # the documents sequence c // N reads or predicts
      own = [set(train_docs[c // N * L:c // N * L + L + 1].tolist()) - {-1}
             for c in range(len(queries))]
    else:
      own = [set()] * len(queries)
    ref_scores, ref_rows, every = _reference_neighbours(train_keys[indexed], queries, own,
                                                        key_docs, K)
    got_scores = np.einsum("qd,qkd->qk", queries.astype(np.float64), train_keys[found])
    np.testing.assert_allclose(got_scores, ref_scores, atol=1e-5)
    # Ids must agree, but where another candidate scores the same (float32 may order those apart).
    tied = (np.abs(every[:, None, :] - ref_scores[:, :, None]) < 1e-5).sum(-1) > 1  # [Q, k]
    assert (found == indexed[ref_rows])[~tied].all() and (~tied).mean() > 0.9
    for c, ids in enumerate(found):  # no neighbour shares a document with its query's sequence
      for j in ids:
        assert not own[c] & set(train_docs[j * M:(j + 1) * M].tolist())
    # The module's own numpy search agrees.
    ranges = (excluded_chunk_ranges(train_docs, M, N) if split == "train"
              else np.full((len(queries), 2), -1))
    bf_scores, _ = brute_force_neighbours(train_keys[indexed], queries, K, ranges, ids=indexed)
    np.testing.assert_allclose(bf_scores, ref_scores, atol=1e-5)


def test_records_are_stream_slices_and_neighbour_values(db):
  train_stream, pad = np.asarray(db.train_stream), db.tokenizer.pad_id
  n_train = db.num_chunks("train")

  def value(i):  # the chunk and the next one of the train stream
    nxt = train_stream[(i + 1) * M:(i + 2) * M] if i + 1 < n_train else np.full(M, pad)
    return np.concatenate([train_stream[i * M:(i + 1) * M], nxt])

  for split in ("train", "heldout"):
    stream, docs = db.array(split, "stream"), db.array(split, "docs")
    neighbours = db.array(split, "neighbours")
    for s in range(db.num_sequences(split)):
      r = db.read_sequence(split, s)
      np.testing.assert_array_equal(r["inputs"], stream[s * L:s * L + L])
      np.testing.assert_array_equal(r["targets"], stream[s * L + 1:s * L + L + 1])
      np.testing.assert_array_equal(r["target_docs"], docs[s * L + 1:s * L + L + 1])
      np.testing.assert_array_equal(r["neighbour_ids"], neighbours[s * N:(s + 1) * N])
      want = np.stack([np.stack([value(i) for i in row]) for row in r["neighbour_ids"]])
      np.testing.assert_array_equal(r["neighbours"], want)
      np.testing.assert_array_equal(db.values(r["neighbour_ids"]), want)
  assert (db.values(np.array([-1, -1])) == pad).all() and db.values(np.array(3)).shape == (2 * M,)
  assert db.manifest["layout"]["fields"][3] == ["neighbours", [N, K, 2 * M]]


def test_keys_embed_the_chunk_text_as_the_build(db, tmp_path):
  tower = db.key_tower()
  assert shares_vocab(db.tokenizer, tower.tokenizer)
  chunks = np.asarray(db.array("train", "stream"))[:20 * M].reshape(20, M)
  np.testing.assert_allclose(db.embed_keys(chunks), db.array("train", "keys")[:20], atol=2e-5)
  # The same vocab: the chunk's word pieces themselves, without eos and pad.
  inputs = key_inputs(chunks[:1], db.tokenizer, tower.tokenizer, 32, True)
  body = [t for t in chunks[0] if t not in (db.tokenizer.eos_id, db.tokenizer.pad_id)]
  np.testing.assert_array_equal(inputs["input_ids"][0, :len(body) + 2],
                                [tower.tokenizer.cls_id, *body, tower.tokenizer.sep_id])
  # Another tokenizer: its text decoded, then BERT word pieces.
  other = load_lm_tokenizer(_word_level(tmp_path), "")
  assert not shares_vocab(other, tower.tokenizer)
  ids = other.encode_batch(["the cat sat"])[0] + [other.eos_id, other.pad_id]
  inputs = key_inputs(np.array([ids]), other, tower.tokenizer, 8, False)
  want = [tower.tokenizer.cls_id, *tower.tokenizer.encode("the cat sat"), tower.tokenizer.sep_id]
  np.testing.assert_array_equal(inputs["input_ids"][0], want + [tower.tokenizer.pad_id] * 3)
  np.testing.assert_array_equal(inputs["attention_mask"][0], [1] * 5 + [0] * 3)


def _word_level(tmp_path, eos="<|endoftext|>"):
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", eos, "the", "cat", "sat"])}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens([eos, "<pad>"])
  path = str(tmp_path / f"tokenizer-{len(eos)}.json")
  tok.save(path)
  return path


def test_lm_tokenizer_files(tmp_path):
  tok = load_lm_tokenizer(_word_level(tmp_path), "")
  assert (tok.eos_id, tok.pad_id, tok.vocab_size, tok.bert_vocab) == (2, 1, 6, None)
  assert tok.name.startswith("tokenizer.json:") and tok.decode([3, 4, 2, 1]) == "the cat"
  assert load_lm_tokenizer(_word_level(tmp_path, "</s>"), "").eos_id == 2
  with pytest.raises(ValueError, match=r"--config.db.tokenizer_file=.*none of the end-of-text"):
    load_lm_tokenizer(_word_level(tmp_path, "<end>"), "")
  with pytest.raises(ValueError, match=r"tokenizer_file=/no/such.json: the file cannot be read"):
    load_lm_tokenizer("/no/such.json", "")
  with pytest.raises(ValueError, match=r"--config.db.tokenizer_file='' tokenizes with .*/no/vocab"):
    load_lm_tokenizer("", "/no/vocab.txt")


def test_refused_settings_and_models(db, tmp_path):
  with pytest.raises(ValueError, match=r"--config.db.chunk_length=16 \(now 8\).*delete"):
    build_database(_config(chunk_length=8), db.directory)
  with pytest.raises(ValueError, match=r"--config.db.num_neighbours=100000: .* at most \d+"):
    build_database(_config(num_neighbours=100_000), str(tmp_path / "big_k"))
  assert not os.path.exists(tmp_path / "big_k" / MANIFEST)
  # The text read stays: another k reuses it; another chunk length is refused.
  with pytest.raises(ValueError, match=r"--config.db.num_neighbours=100001: "):
    build_database(_config(num_neighbours=100_001), str(tmp_path / "big_k"))
  with pytest.raises(ValueError, match=r"--config.db.chunk_length=16 \(now 8\)"):
    build_database(_config(chunk_length=8, num_neighbours=100_001), str(tmp_path / "big_k"))
  with pytest.raises(ValueError, match=r"--config.db.seq_chunks=0"):
    build_database(_config(seq_chunks=0), str(tmp_path / "bad"))
  # A model of another tokenizer or other key weights.
  other = load_lm_tokenizer(_word_level(tmp_path), "").name
  with pytest.raises(ValueError, match=rf"tokenizer_file giving {other}.* {db.tokenizer.name}"):
    db.check_compatible(tokenizer_name=other)
  with pytest.raises(ValueError, match=rf"key_weights giving 0123.* with {db.key_fingerprint}"):
    db.check_compatible(key_fingerprint="0123")
  db.check_compatible(db.tokenizer.name, db.key_fingerprint)
  moved = RetroDb(db.directory, {**db.manifest, "key_fingerprint": "0123"}, db.tokenizer)
  with pytest.raises(ValueError, match=rf"key_weights=minilm now .*{db.key_fingerprint}.*0123"):
    moved.key_tower()
  # A damaged file is named on open.
  copy = str(tmp_path / "copy")
  shutil.copytree(db.directory, copy)
  with open(os.path.join(copy, "train.neighbours.npy"), "r+b") as f:
    f.seek(-1, 2)
    f.write(b"\x7f")
  with pytest.raises(ValueError, match="train.neighbours.npy is corrupt"):
    RetroDb.open(copy)


def _batches(db, **kw):
  args = dict(batch_size=4, seed=3)
  return retro_batches(db, "train", **{**args, **kw})


def test_batches_host_slices_state_and_evaluation(db):
  one = _batches(db, batch_size=6, num_epochs=1)
  hosts = [_batches(db, batch_size=3, num_epochs=1, shard_index=h, shard_count=2) for h in (0, 1)]
  count = 0
  for whole, a, b in zip(one, *hosts):
    for key in whole:
      np.testing.assert_array_equal(whole[key], np.concatenate([a[key], b[key]]))
    count += 1
  assert count == db.num_sequences("train") // 6
  b = next(_batches(db, num_neighbours=1))
  assert b["inputs"].shape == (4, L) and b["neighbours"].shape == (4, N, 1, 2 * M)
  assert b["neighbour_ids"].shape == (4, N, 1) and b["loss_mask"].dtype == np.float32
  np.testing.assert_array_equal(b["loss_mask"], b["target_docs"] >= 0)
  first = db.read_sequence("train", 0)  # the stored first neighbour of each chunk
  ex = next(_batches(db, shuffle=False, num_neighbours=1))
  np.testing.assert_array_equal(ex["neighbours"][0], first["neighbours"][:, :1])
  # get_state / set_state: a fresh iterator resumes exactly, past an epoch.
  it = _batches(db)
  for _ in range(db.num_sequences("train") // 4 + 2):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  want = [next(it) for _ in range(3)]
  resumed = _batches(db)
  resumed.set_state(state)
  for w, g in zip(want, [next(resumed) for _ in range(3)]):
    assert all((w[k] == g[k]).all() for k in w)
  # Evaluation: every held-out sequence once, in order; the last batch filled with unscored rows.
  seqs = db.num_sequences("heldout")
  rows = [r for batch in retro_batches(db.directory, "heldout", batch_size=5, seed=0,
                                       shuffle=False, num_epochs=1)
          for r in zip(batch["inputs"], batch["loss_mask"])]
  assert len(rows) == -(-seqs // 5) * 5
  for s in range(seqs):
    np.testing.assert_array_equal(rows[s][0], db.read_sequence("heldout", s)["inputs"])
  assert all(not mask.any() for _, mask in rows[seqs:])
  few = list(retro_batches(db, "heldout", batch_size=2, seed=0, shuffle=False, num_epochs=1,
                           limit=3))
  assert len(few) == 2 and few[1]["loss_mask"][1].sum() == 0 < few[1]["loss_mask"][0].sum()
  np.testing.assert_array_equal(few[1]["inputs"][0], db.read_sequence("heldout", 2)["inputs"])
  with pytest.raises(ValueError, match="num_neighbours=3: .* stores 2"):
    _batches(db, num_neighbours=3)


_BUILD = """
import json, logging, sys
logging.basicConfig(level=logging.INFO)
from realm_jax.configs.retro import database_config
from realm_jax.retrieval.chunk_db import build_database
db = database_config()
db.update(json.loads(sys.argv[2]))
build_database(db, sys.argv[1])
"""


@pytest.mark.slow
def test_killed_build_resumes_to_the_same_database(db, tmp_path):
  out = str(tmp_path / "db")
  cmd = [sys.executable, "-c", _BUILD, out, json.dumps(SETTINGS)]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  deadline = time.time() + 120
  while not glob.glob(os.path.join(out, "keys-train.shards-*", "shard-00000-*")):
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    assert time.time() < deadline
    time.sleep(0.02)
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  proc.stderr.close()
  assert not os.path.exists(os.path.join(out, MANIFEST))
  assert not os.path.exists(os.path.join(out, "stage-keys.json"))
  got = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert got.returncode == 0, got.stderr[-2000:]
  assert re.search(r"Resuming: [1-9]\d* of \d+ shards", got.stderr), got.stderr[-2000:]
  resumed = RetroDb.open(out)
  assert resumed.fingerprint == db.fingerprint
  for split in ("train", "heldout"):
    for name in ("stream", "docs", "keys", "neighbours"):
      np.testing.assert_array_equal(resumed.array(split, name), db.array(split, name))
    for s in range(db.num_sequences(split)):
      a, b = resumed.read_sequence(split, s), db.read_sequence(split, s)
      assert all((a[k] == b[k]).all() for k in a)
  np.testing.assert_array_equal(resumed.load_index().embeddings(), db.load_index().embeddings())
  assert not glob.glob(os.path.join(out, "*.shards-*")) + glob.glob(os.path.join(out, ".tmp-*"))
