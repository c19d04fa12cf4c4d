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

from realm_jax.data.chunks import (NearDuplicates, chunk_documents, chunk_values, decode_record,
                                   excluded_chunk_ranges, is_heldout, reading_sequences,
                                   record_layout, text_docs, train_exclusions, write_sequences)
from realm_jax.data.retro_batches import retro_batches
from realm_jax.data.sources import documents
from realm_jax.retrieval.chunk_db import (MANIFEST, SETTINGS as SETTINGS_FILE, RetroDb,
                                          build_database, corpus_files, db_settings)
from realm_jax.retrieval.neighbours import brute_force_neighbours
from realm_jax.text.lm_tokenizer import key_inputs, load_lm_tokenizer, shares_vocab

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M, N, K = 16, 4, 2        # chunk length, chunks per sequence, neighbours
L = M * N
# Batches of 64 keys and MiniLM's first layer as the key tower, as configs/retro.py:tiny (256 rows
# on the 8 fake devices: mostly padding).
SETTINGS = dict(max_docs=48, chunk_length=M, seq_chunks=N, num_neighbours=K, key_length=32,
                shard_size=128, key_batch_size=64, key_layers=1)


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


def _jaccard(a: str, b: str) -> float:
  """Word 13-gram Jaccard similarity, written out: lowercased words split on whitespace, a text of
  fewer than 13 words one gram of all its words."""
  def grams(text):
    w = text.lower().split()
    return {tuple(w)} if len(w) < 13 else {tuple(w[i:i + 13]) for i in range(len(w) - 12)}
  a, b = grams(a), grams(b)
  return len(a & b) / len(a | b) if a | b else 0.0


def _sides(docs, percent):
  """The split of each document, the hash written out: SHA-256 of the title, per ten thousand."""
  def held(d):
    h = int.from_bytes(hashlib.sha256(d["title"].encode()).digest()[:8], "big")
    return h % 10_000 < percent * 100
  return {"train": [d for d in docs if not held(d)], "heldout": [d for d in docs if held(d)]}


def _pieces(stream, docs, eos):
  """Each document's place, by a plain loop over the stream: [(first, last)] positions of the
  tokens of document 0, 1, ...; every other token must be padding."""
  places = {}
  for t, d in enumerate(docs.tolist()):
    if d >= 0:
      first, _ = places.get(d, (t, t))
      places[d] = (first, t)
  assert sorted(places) == list(range(len(places)))
  for first, last in places.values():  # contiguous: the eos, then the text
    assert (docs[first:last + 1] == docs[first]).all() and stream[first] == eos
  return [places[d] for d in range(len(places))]


def test_title_split_whole_documents_in_chunks_and_sequences(db):
  tok = db.tokenizer
  docs = list(documents("wiki_vital", max_docs=SETTINGS["max_docs"]))
  sides = _sides(docs, 10)
  assert sides["train"] and sides["heldout"]
  dropped = [d for d in sides["train"]
             if max(_jaccard(d["text"], h["text"]) for h in sides["heldout"]) >= 0.8]
  assert db.manifest["counts"]["near_duplicates"] == len(dropped)
  sides["train"] = [d for d in sides["train"] if d not in dropped]
  assert tok.pad_id != tok.eos_id
  seen = set()  # which rules of the packing the documents met
  for split, split_docs in sides.items():
    ids = tok.encode_batch([d["text"] for d in split_docs])
    stream, doc_of = np.asarray(db.array(split, "stream")), np.asarray(db.array(split, "docs"))
    assert len(stream) == len(doc_of) == db.num_sequences(split) * L + 1
    places = _pieces(stream, doc_of, tok.eos_id)
    assert len(places) == len(split_docs)
    end = 0  # where the previous document's last chunk ends
    for d, ((first, last), x) in enumerate(zip(places, ids)):
      np.testing.assert_array_equal(stream[first + 1:last + 1], x)    # [eos] + its text
      piece = -(-(len(x) + 1) // M) * M
      left = -end % L
      # It starts at the next chunk; the next sequence when it fits in one but not in what is left.
      assert first == (end + left if left and left < piece <= L else end), d
      if piece <= L:  # whole in one sequence, from its eos
        assert first // L == last // L
      seen.add("longer" if piece > L else "next sequence" if first > end else "after another")
      assert (stream[end:first] == tok.pad_id).all() and (doc_of[end:first] == -1).all()
      end = first + piece
    assert (stream[end:] == tok.pad_id).all() and (doc_of[end:] == -1).all()
    assert len(stream) == -(-end // L) * L + 1
    # No chunk holds tokens of two documents.
    chunks = doc_of[:db.num_chunks(split) * M].reshape(-1, M)
    assert all(len(set(c.tolist()) - {-1}) <= 1 for c in chunks)
    meta = db.documents(split)
    assert [(x["title"], x["where"]) for x in meta] == [(d["title"], d["where"])
                                                        for d in split_docs]
    assert [m["bytes"] for m in meta] == [len(d["text"].encode("utf-8")) for d in split_docs]
    assert [m["tokens"] for m in meta] == [len(x) for x in ids]
  assert seen == {"longer", "next sequence", "after another"}
  # Disjoint, and each document's side depends on its title only: not on order, nor on max_docs.
  assert not {d["title"] for d in sides["train"]} & {d["title"] for d in sides["heldout"]}
  assert all(is_heldout(d["title"], 10) == (d in sides["heldout"]) for d in docs)
  fewer, _ = chunk_documents(lambda: reversed(docs[:30]), tok, M, N, 10)
  for split in sides:
    assert ({d["where"] for d in fewer[split].documents}
            == {d["where"] for d in sides[split] if d in docs[:30]})


def test_small_stream_by_hand(tmp_path):
  """m = 2, 2 chunks per sequence (L = 4), a tokenizer of one token per word whose pad (1) is not
  its eos (2): a document that fits in a sequence, one longer than a sequence, one that does not fit
  in what is left, one without text."""
  tok = load_lm_tokenizer(_word_level(tmp_path), "")
  e, p, the, cat, sat = 2, 1, 3, 4, 5
  assert (tok.eos_id, tok.pad_id) == (e, p)
  texts = ["the", "the cat sat the cat sat", "", "cat", "sat  the", "cat cat"]
  docs = [{"title": chr(65 + i), "text": x, "where": f"doc {i}"} for i, x in enumerate(texts)]
  splits, stats = chunk_documents(lambda: docs, tok, 2, 2, heldout_percent=0)
  s = splits["train"]
  np.testing.assert_array_equal(s.stream, [e, the, e, the,   cat, sat, the, cat,
                                           sat, p, e, cat,   e, sat, the, p,
                                           e, cat, cat, p,   p])
  np.testing.assert_array_equal(s.docs, [0, 0, 1, 1,   1, 1, 1, 1,   1, -1, 2, 2,
                                         3, 3, 3, -1,   4, 4, 4, -1,   -1])
  np.testing.assert_array_equal(text_docs(s.docs), [-1, 0, -1, 1,   1, 1, 1, 1,   1, -1, -1, 2,
                                                    -1, 3, 3, -1,   -1, 4, 4, -1,   -1])
  assert [(d["title"], d["bytes"], d["tokens"]) for d in s.documents] == [
      ("A", 3, 1), ("B", 23, 6), ("D", 3, 1), ("E", 8, 2), ("F", 7, 2)]
  assert stats["skipped"] == 1 and stats["skipped_examples"] == ["doc 2"]
  assert stats["near_duplicates"] == 0
  assert len(splits["heldout"].stream) == 1 and (s.num_sequences, s.num_chunks) == (5, 10)
  # Sequence 0 reads A and B (chunks 0-4), 1 reads B, 2 reads B and D (chunks 1-5), 3 E, 4 F.
  np.testing.assert_array_equal(excluded_chunk_ranges(s.docs, 2, 2),
                                np.repeat([[0, 4], [1, 4], [1, 5], [6, 7], [8, 9]], 2, axis=0))
  # Continuations: B's chunk 1 -> 2 (over a sequence's end); none after B's last chunk (4), after
  # D (the next chunk is E's), after F's (padding), nor after the last chunk.
  np.testing.assert_array_equal(
      chunk_values(s.stream, s.docs, [[1, 4, 5, 8, 9, -1]], 2, 10, p),
      [[[e, the, cat, sat], [sat, p, p, p], [e, cat, p, p], [e, cat, cat, p], [cat, p, p, p],
        [p] * 4]])
  # Sequence 2's record: inputs, targets, their documents.
  layout = record_layout(2, 2, 1)
  path = str(tmp_path / "train.array_record")
  write_sequences(path, stream=s.stream, docs=s.docs, neighbours=np.full((10, 1), 6),
                  train_stream=s.stream, train_docs=s.docs, num_train=10, chunk_length=2,
                  seq_chunks=2, pad_id=p)
  import grain
  r = decode_record(grain.sources.ArrayRecordDataSource(path)[2], layout)
  np.testing.assert_array_equal(r["inputs"], [sat, p, e, cat])
  np.testing.assert_array_equal(r["targets"], [p, e, cat, e])
  np.testing.assert_array_equal(r["input_docs"], [1, -1, 2, 2])
  np.testing.assert_array_equal(r["target_docs"], [-1, -1, 2, -1])
  np.testing.assert_array_equal(r["neighbours"], [[[e, sat, the, p]]] * 2)


def _titled_jsonl(path, rows):
  with open(path, "w", encoding="utf-8") as f:
    for title, text in rows:
      f.write(json.dumps({"title": title, "text": text}) + "\n")


def test_passages_of_one_title_share_a_split(tmp_path):
  tok = load_lm_tokenizer(_word_level(tmp_path), "")
  rng = np.random.default_rng(0)
  words = [f"w{i}" for i in range(50)] + ["the", "cat", "sat"]
  rows = [(f"Title {t}", " ".join(rng.choice(words, 30))) for t in range(20) for _ in range(3)]
  rng.shuffle(rows)  # passages of one title on lines far apart
  path = str(tmp_path / "passages.jsonl")
  _titled_jsonl(path, rows)
  splits, stats = chunk_documents(lambda: documents("jsonl", [path]), tok, 4, 2, 50)
  side = {}
  for split, s in splits.items():
    for d in s.documents:
      side.setdefault(d["title"], set()).add(split)
  assert stats["near_duplicates"] == 0 and sum(len(s.documents) for s in splits.values()) == 60
  assert all(len(x) == 1 for x in side.values()) and len(side) == 20
  assert {next(iter(x)) for x in side.values()} == {"train", "heldout"}
  assert all((side[t] == {"heldout"}) == is_heldout(t, 50) for t in side)
  # Untitled passages: each its own group (by its place), not all on one side.
  _titled_jsonl(path, [("", text) for _, text in rows])
  splits, _ = chunk_documents(lambda: documents("jsonl", [path]), tok, 4, 2, 50)
  assert all(len(s.documents) > 10 for s in splits.values())


def test_train_documents_nearly_copying_a_heldout_one_are_dropped(tmp_path):
  tok = load_lm_tokenizer(_word_level(tmp_path), "")
  rng = np.random.default_rng(1)
  vocab = [f"w{i}" for i in range(300)]
  held_titles = [t for t in (f"T{i}" for i in range(200)) if is_heldout(t, 50)]
  train_titles = iter(t for t in (f"T{i}" for i in range(200)) if not is_heldout(t, 50))
  heldout = [" ".join(rng.choice(vocab, 200)), "Paris is big", " ".join(rng.choice(vocab, 40))]
  words = heldout[0].split()

  def changed(n):  # heldout[0] with n words replaced, spread out
    w = list(words)
    for i in np.linspace(20, 180, n).astype(int):
      w[i] = "other"
    return " ".join(w)

  train = [changed(1),                        # Jaccard 175 / 201: dropped
           changed(3),                        # 149 / 227: kept
           "  " + heldout[0].upper().replace(" ", "\n "),   # case and whitespace: 1, dropped
           "paris IS  big",                   # under 13 words, the same words: dropped
           "paris is big today",              # another single gram: kept
           heldout[2] + " w1 w2 w3 w4",       # 28 of 32 grams: 0.875, dropped
           heldout[2] + " " + " ".join(rng.choice(vocab, 20)),   # 28 / 48: kept
           " ".join(rng.choice(vocab, 100))]  # unrelated: kept
  docs = ([{"title": t, "text": x, "where": f"held {i}"}
           for i, (t, x) in enumerate(zip(held_titles, heldout))]
          + [{"title": next(train_titles), "text": x, "where": f"train {i}"}
             for i, x in enumerate(train)])
  splits, stats = chunk_documents(lambda: docs, tok, 4, 2, 50)
  best = [max(_jaccard(x, h) for h in heldout) for x in train]
  want_dropped = [i for i, j in enumerate(best) if j >= 0.8]
  assert want_dropped == [0, 2, 3, 5]
  assert stats["near_duplicates"] == 4
  assert [d["where"] for d in splits["train"].documents] == [
      f"train {i}" for i in range(len(train)) if i not in want_dropped]
  assert stats["near_duplicate_examples"][0] == {"train": "train 0", "heldout": "held 0",
                                                 "jaccard": round(175 / 201, 4)}
  # The index's answer equals the brute force on random near-copies around the threshold.
  near = NearDuplicates()
  pool = [" ".join(rng.choice(vocab[:40], rng.integers(5, 80))) for _ in range(30)]
  for text in pool:
    near.add(text)
  for _ in range(200):
    base = pool[rng.integers(len(pool))].split()
    for i in rng.integers(0, max(len(base), 1), rng.integers(0, 4)):
      base[i] = str(rng.choice(vocab[:40]))
    text = " ".join(base + list(rng.choice(vocab[:40], rng.integers(0, 4))))
    scores = [_jaccard(text, h) for h in pool]
    got = near.match(text)
    if max(scores) >= 0.8:
      assert got is not None and got[1] == pytest.approx(max(scores))
      assert scores[got[0]] == pytest.approx(got[1])
    else:
      assert got is None


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
    if split == "train":  # the documents sequence c // N reads, or predicts text of
      predicted = np.asarray(text_docs(train_docs))
      own = [(set(train_docs[c // N * L:c // N * L + L].tolist())
              | set(predicted[c // N * L + 1:c // N * L + L + 1].tolist())) - {-1}
             for c in range(len(queries))]
    else:
      own = [set()] * len(queries)
    ref_scores, ref_rows, every = _reference_neighbours(train_keys[indexed], queries, own,
                                                        key_docs, K)
    got_scores = np.einsum("qd,qkd->qk", queries.astype(np.float64), train_keys[found])
    np.testing.assert_allclose(got_scores, ref_scores, atol=1e-5)
    # Ids must agree, but where another candidate scores the same (float32 may order those apart).
    tied = (np.abs(every[:, None, :] - ref_scores[:, :, None]) < 1e-5).sum(-1) > 1  # [Q, k]
    # (Keys of MiniLM's first layer: 5% of the train and 10% of the held-out neighbours tie.)
    assert (found == indexed[ref_rows])[~tied].all() and (~tied).mean() > 0.85
    for c, ids in enumerate(found):  # no neighbour shares a document with its query's sequence
      for j in ids:
        assert not own[c] & set(train_docs[j * M:(j + 1) * M].tolist())
    # The module's own numpy search agrees.
    ranges = (excluded_chunk_ranges(train_docs, M, N) if split == "train"
              else np.full((len(queries), 2), -1))
    bf_scores, _ = brute_force_neighbours(train_keys[indexed], queries, K, ranges, ids=indexed)
    np.testing.assert_allclose(bf_scores, ref_scores, atol=1e-5)


def _values_by_loop(db, split):
  """value(i): chunk i of a split and its continuation, from a plain loop over its documents: the
  chunks each document covers, and the next one only when it is the same document's."""
  stream, pad = np.asarray(db.array(split, "stream")), db.tokenizer.pad_id
  places = _pieces(stream, np.asarray(db.array(split, "docs")), db.tokenizer.eos_id)
  chunks_of = [set(range(first // M, last // M + 1)) for first, last in places]
  doc_of_chunk = {c: d for d, cs in enumerate(chunks_of) for c in cs}
  assert sum(len(c) for c in chunks_of) == len(doc_of_chunk)   # no chunk in two documents

  def value(i):
    same = i in doc_of_chunk and doc_of_chunk.get(i + 1) == doc_of_chunk[i]
    nxt = stream[(i + 1) * M:(i + 2) * M] if same else np.full(M, pad)
    return np.concatenate([stream[i * M:(i + 1) * M], nxt])
  return value


def test_reading_sequences_give_up_only_their_own_chunks():
  """config.db.own_document_share: the chosen sequences' chunks exclude themselves alone, the
  others their sequence's documents (the paper's rule), and the choice is the same every time."""
  docs = np.repeat(np.arange(40), 24)[:-7]                    # 40 documents of 24 tokens
  docs = np.concatenate([docs, [-1] * 8])                     # padding at the end
  paper = excluded_chunk_ranges(docs, 4, 3)
  np.testing.assert_array_equal(train_exclusions(docs, 4, 3), paper)
  np.testing.assert_array_equal(train_exclusions(docs, 4, 3, 0.0), paper)
  for share in (0.5, 1.0):
    got = train_exclusions(docs, 4, 3, share)
    chosen = reading_sequences(len(paper) // 3, share)
    np.testing.assert_array_equal(chosen, reading_sequences(len(paper) // 3, share))
    for c in range(len(paper)):
      want = [c, c] if chosen[c // 3] else paper[c]
      assert list(got[c]) == list(want), (share, c)
  assert 0 < reading_sequences(len(paper) // 3, 0.5).mean() < 1
  assert reading_sequences(len(paper) // 3, 1.0).all()


def test_own_document_share_rebuilds_the_train_neighbours_only(db, tmp_path):
  """A database whose training chunks may read their own documents: its text, keys and index are
  the paper-rule database's (reused, not rebuilt), its train neighbours the exact search leaving
  out only the query chunk, its held-out neighbours unchanged; it is another database (a model
  records which), and its neighbours are not mixed with the other rule's."""
  out = str(tmp_path / "db")
  os.makedirs(out)
  for name in os.listdir(db.directory):
    if not re.search(r"neighbours|array_record|stage-(neighbours|examples)|retro_db", name):
      src = os.path.join(db.directory, name)
      (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(out, name))
  leaky = build_database(_config(own_document_share=1.0), out)
  assert leaky.fingerprint != db.fingerprint
  assert leaky.manifest["index_fingerprint"] == db.fingerprint
  assert leaky.manifest["seconds"]["keys"] == db.manifest["seconds"]["keys"]   # not rebuilt
  for name in ("stream", "docs", "keys"):
    np.testing.assert_array_equal(leaky.array("train", name), db.array("train", name))
  np.testing.assert_array_equal(leaky.array("heldout", "neighbours"),
                                db.array("heldout", "neighbours"))
  train_keys, docs = np.asarray(db.array("train", "keys")), db.array("train", "docs")
  indexed = leaky.indexed_chunks("train")
  queries, found = np.asarray(leaky.array("train", "keys")), leaky.array("train", "neighbours")
  # Brute force written here: every indexed chunk but the query itself.
  scores = queries.astype(np.float64) @ train_keys[indexed].astype(np.float64).T
  scores[np.arange(len(queries))[:, None] == indexed[None, :]] = -np.inf
  best = -np.sort(-scores, axis=1)[:, :K]
  got = np.einsum("qd,qkd->qk", queries.astype(np.float64), train_keys[found])
  np.testing.assert_allclose(got, best, atol=1e-5)
  assert not (found == np.arange(len(found))[:, None]).any()
  first_doc = lambda c: docs[np.asarray(c) * M]
  own = first_doc(found) == first_doc(np.arange(len(found)))[:, None]
  assert own[first_doc(np.arange(len(found))) >= 0].any()   # some read their own document
  r = leaky.read_sequence("train", 0)
  assert (r["neighbours"] == leaky.values(found[:N], "train").reshape(r["neighbours"].shape)).all()
  # The other rule on this directory is refused, naming the setting.
  with pytest.raises(ValueError, match="own_document_share"):
    build_database(_config(), out)
  with pytest.raises(ValueError, match="own_document_share=2"):
    build_database(_config(own_document_share=2), str(tmp_path / "other"))


def test_records_are_stream_slices_and_neighbour_values(db):
  pad = db.tokenizer.pad_id
  value = _values_by_loop(db, "train")
  cut = 0  # neighbours whose next chunk is another document's: their continuation is pad
  for split in ("train", "heldout"):
    stream, docs = db.array(split, "stream"), db.array(split, "docs")
    neighbours = db.array(split, "neighbours")
    for s in range(db.num_sequences(split)):
      r = db.read_sequence(split, s)
      np.testing.assert_array_equal(r["inputs"], stream[s * L:s * L + L])
      np.testing.assert_array_equal(r["targets"], stream[s * L + 1:s * L + L + 1])
      np.testing.assert_array_equal(r["input_docs"], docs[s * L:s * L + L])
      # Scored: the targets that are text (not an eos, not padding), with their documents.
      text = (docs[s * L + 1:s * L + L + 1] >= 0) & (docs[s * L + 1:s * L + L + 1]
                                                      == docs[s * L:s * L + L])
      np.testing.assert_array_equal(r["target_docs"],
                                    np.where(text, docs[s * L + 1:s * L + L + 1], -1))
      np.testing.assert_array_equal(r["neighbour_ids"], neighbours[s * N:(s + 1) * N])
      want = np.stack([np.stack([value(i) for i in row]) for row in r["neighbour_ids"]])
      np.testing.assert_array_equal(r["neighbours"], want)
      np.testing.assert_array_equal(db.values(r["neighbour_ids"]), want)
      cut += int((want[..., M:] == pad).all(-1).sum())
  assert cut > 0
  assert (db.values(np.array([-1, -1])) == pad).all() and db.values(np.array(3)).shape == (2 * M,)
  assert db.manifest["layout"]["fields"][4] == ["neighbours", [N, K, 2 * M]]
  assert db.manifest["version"] == 2


def test_bits_per_byte_counts_the_original_text_and_its_tokens(db):
  """Over the held-out batches, the target bytes add up to the documents' UTF-8 text, and the
  scored targets are their text tokens, each once."""
  texts = {d["where"]: d["text"] for d in documents("wiki_vital", max_docs=SETTINGS["max_docs"])}
  docs = db.documents("heldout")
  ids = db.tokenizer.encode_batch([texts[d["where"]] for d in docs])
  nbytes = np.zeros(len(docs))
  scored = np.zeros(len(docs), np.int64)
  for batch in retro_batches(db, "heldout", batch_size=3, seed=0, shuffle=False, num_epochs=1):
    np.testing.assert_array_equal(batch["loss_mask"], batch["target_docs"] >= 0)
    keep = batch["target_docs"] >= 0
    np.add.at(nbytes, batch["target_docs"][keep], batch["target_bytes"][keep])
    np.add.at(scored, batch["target_docs"][keep], 1)
    assert (batch["target_bytes"][~keep] == 0).all()
    assert (batch["targets"][keep] != db.tokenizer.pad_id).all()
  want = [len(texts[d["where"]].encode("utf-8")) for d in docs]
  np.testing.assert_allclose(nbytes, want, rtol=1e-5)
  assert scored.tolist() == [len(x) for x in ids] == [d["tokens"] for d in docs]
  counts = db.manifest["counts"]["heldout"]
  assert (counts["bytes"], counts["tokens"]) == (sum(want), sum(len(x) for x in ids))


def test_heldout_in_database_neighbours_the_leaky_condition(db):
  """Every held-out chunk against the train and held-out chunks (exact, itself left out); values
  from each neighbour's own stream, continuations inside its document."""
  values, ids = db.heldout_in_database_neighbours(K)
  n_train, n_held = db.num_chunks("train"), db.num_chunks("heldout")
  assert values.shape == (n_held, K, 2 * M) and values.dtype == np.int32
  assert ids.shape == (n_held, K)
  train, held = db.indexed_chunks("train"), db.indexed_chunks("heldout")
  keys = np.concatenate([db.array("train", "keys")[train], db.array("heldout", "keys")[held]])
  all_ids = np.concatenate([train, n_train + held])
  queries = np.asarray(db.array("heldout", "keys"), np.float64)
  scores = queries @ keys.astype(np.float64).T
  scores[all_ids[None] == n_train + np.arange(n_held)[:, None]] = -np.inf    # not itself
  best = np.sort(scores, 1)[:, ::-1][:, :K]
  every = np.concatenate([db.array("train", "keys"), db.array("heldout", "keys")])  # by id
  got = np.einsum("qd,qkd->qk", queries, every[ids].astype(np.float64))
  np.testing.assert_allclose(got, best, atol=1e-5)
  assert (ids != n_train + np.arange(n_held)[:, None]).all()
  assert (ids >= n_train).any()  # held-out chunks are found (e.g. their own document's)
  by_loop = {"train": _values_by_loop(db, "train"), "heldout": _values_by_loop(db, "heldout")}
  for q in range(n_held):
    for j, i in enumerate(ids[q]):
      split, c = ("heldout", i - n_train) if i >= n_train else ("train", i)
      np.testing.assert_array_equal(values[q, j], by_loop[split](c))


def test_other_neighbours_give_each_chunk_another_documents(db):
  """The control of retro_eval.py --other_neighbours: the same neighbour rows, moved (a
  permutation of the chunks that have any), each chunk reading those of a chunk of another
  held-out document; a chunk without neighbours keeps none."""
  from realm_jax.eval.retro import other_neighbours
  own = np.concatenate([b["neighbours"] for b in retro_batches(
      db, "heldout", batch_size=4, seed=0, shuffle=False, num_epochs=1, num_neighbours=K)])
  own = own[:db.num_sequences("heldout")]
  got = other_neighbours(db, K)
  assert got.shape == own.shape
  pad = db.tokenizer.pad_id
  own_rows, got_rows = own.reshape(-1, K, 2 * M), got.reshape(-1, K, 2 * M)
  docs = np.asarray(db.array("heldout", "docs"))
  moved = 0
  for r in range(len(own_rows)):
    if (own_rows[r] == pad).all():
      assert (got_rows[r] == pad).all()
      continue
    sources = [q for q in range(len(own_rows)) if (own_rows[q] == got_rows[r]).all()]
    assert sources, r  # one of the records' own rows
    moved += all(docs[q * M] != docs[r * M] for q in sources)
  real = sum(not (row == pad).all() for row in own_rows)
  assert moved == real  # every chunk reads another document's neighbours
  assert sorted(map(bytes, own_rows)) == sorted(map(bytes, got_rows))  # the same rows, moved


def test_keys_embed_the_chunk_text_as_the_build(db, tmp_path):
  tower = db.key_tower()
  assert shares_vocab(db.tokenizer, tower.tokenizer)
  chunks = np.asarray(db.array("train", "stream"))[:20 * M].reshape(20, M)
  np.testing.assert_allclose(db.embed_keys(chunks), db.array("train", "keys")[:20], atol=2e-5)
  # The keys are those of MiniLM's first layer (config.db.key_layers=1): transformers' BertModel
  # cut to one layer, mean-pooled over the word pieces and L2-normalised.
  import torch
  import transformers
  from realm_jax.checkpoints import minilm_dir
  hf = transformers.BertModel.from_pretrained(minilm_dir(), num_hidden_layers=1,
                                              add_pooling_layer=False).eval()
  assert len(hf.encoder.layer) == 1
  batch = key_inputs(chunks, db.tokenizer, tower.tokenizer, 32, True)
  with torch.no_grad():
    states = hf(**{k: torch.as_tensor(np.asarray(v)) for k, v in batch.items()}).last_hidden_state
  mask = torch.as_tensor(np.asarray(batch["attention_mask"]), dtype=torch.float32)[..., None]
  mean = (states * mask).sum(1) / mask.sum(1)
  want = torch.nn.functional.normalize(mean, dim=-1).numpy()
  np.testing.assert_allclose(db.array("train", "keys")[:20], want, atol=2e-5)
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
  # Llama 3's tokenizer.json: <|begin_of_text|>, <|end_of_text|>, <|eot_id|>, ... and no <pad>:
  # documents end with <|end_of_text|>; padding is the first other special token.
  from tokenizers import Tokenizer, models
  names = ["the", "cat", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
  llama3 = Tokenizer(models.WordLevel({w: i for i, w in enumerate(names)}, unk_token="the"))
  llama3.add_special_tokens(names[2:])
  llama3.save(str(tmp_path / "llama3.json"))
  tok = load_lm_tokenizer(str(tmp_path / "llama3.json"), "")
  assert (tok.eos_id, tok.pad_id) == (3, 2)
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
  # The key tower's layers: MiniLM has 6; other keys than the built database's are refused.
  with pytest.raises(ValueError, match=r"--config.db.key_layers=7: .* has 6 transformer layers"):
    build_database(_config(key_layers=7), str(tmp_path / "deep"))
  assert not os.path.exists(tmp_path / "deep")
  with pytest.raises(ValueError, match=r"--config.db.key_layers=1 \(now 2\).*delete"):
    build_database(_config(key_layers=2), db.directory)
  # A model of another tokenizer or other key weights.
  other = load_lm_tokenizer(_word_level(tmp_path), "").name
  with pytest.raises(ValueError, match=rf"tokenizer_file giving {other}.* {db.tokenizer.name}"):
    db.check_compatible(tokenizer_name=other)
  with pytest.raises(ValueError, match=rf"key_weights giving 0123.* with {db.key_fingerprint}"):
    db.check_compatible(key_fingerprint="0123")
  with pytest.raises(ValueError, match=rf"chunk_length giving 8, but the chunk database in "
                     rf"{db.directory} with 16: use the database built with the model's"):
    db.check_compatible(chunk_length=8)  # a RETRO model of other chunks
  db.check_compatible(db.tokenizer.name, db.key_fingerprint, db.chunk_length)
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
  # A damaged index says to build this database again (not REALM's build_index.py).
  arrays = os.path.join(copy, "index", "index.safetensors")
  data = open(arrays, "rb").read()
  with open(arrays, "wb") as f:
    f.write(data[:-8] + bytes(b ^ 0xFF for b in data[-8:]))
  with pytest.raises(ValueError, match=rf"Delete {re.escape(copy)} and build the database again"
                     ) as e:
    RetroDb.open(copy, verify=False).load_index()
  assert "build_index" not in str(e.value)
  # A build begun by another version of the code is refused, not mixed with this one's.
  os.remove(os.path.join(copy, MANIFEST))
  record = json.load(open(os.path.join(copy, "stage-chunks.json")))
  with open(os.path.join(copy, "stage-chunks.json"), "w") as f:
    json.dump({**record, "version": 1}, f)
  with pytest.raises(ValueError, match=r"stages chunks\) made by another version.*delete"):
    build_database(_config(), copy)


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
  assert b["segments"].shape == (4, L) and b["segments"].dtype == np.int32
  assert "input_docs" not in b
  first = db.read_sequence("train", 0)  # the stored first neighbour of each chunk
  ex = next(_batches(db, shuffle=False, num_neighbours=1))
  np.testing.assert_array_equal(ex["neighbours"][0], first["neighbours"][:, :1])
  np.testing.assert_array_equal(ex["segments"][0], first["input_docs"])
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


def test_a_damaged_stage_is_built_again_when_a_build_resumes(db, tmp_path, caplog):
  """A build killed after its neighbours stage, then train.neighbours.npy damaged: the build that
  resumes checks the CRC-32 each finished stage recorded, warns, searches the neighbours again and
  builds the stages after them: the same database as one never damaged (it used to write the
  damaged neighbours into the records, and the models trained on them). Any stage is checked so
  (the issue's was the keys: 64 bytes of train.keys.npy)."""
  copy = str(tmp_path / "db")
  shutil.copytree(db.directory, copy)
  for name in (MANIFEST, "stage-examples.json"):
    os.remove(os.path.join(copy, name))
  damaged = os.path.join(copy, "train.neighbours.npy")
  with open(damaged, "r+b") as f:
    f.seek(-64, 2)
    f.write(bytes(64))
  caplog.set_level("INFO")
  got = build_database(_config(), copy)
  assert re.search(rf"RETRO database, neighbours: {damaged} is corrupt: its CRC-32 is "
                   r"[0-9a-f]{8}, the build recorded [0-9a-f]{8}; building it again, and the "
                   r"stages after it\.", caplog.text), caplog.text
  assert "RETRO database, keys: done before, reusing it." in caplog.text
  assert got.files_fingerprint == db.files_fingerprint
  np.testing.assert_array_equal(got.array("train", "neighbours"), db.array("train", "neighbours"))


def _wiki_jsonl(path, docs):
  with open(path, "w", encoding="utf-8") as f:
    for d in docs:
      f.write(json.dumps({"title": d["title"], "text": d["text"]}) + "\n")


def test_a_jsonl_corpus_changed_since_the_build_is_refused_naming_the_change(db, tmp_path):
  """Documents removed and texts rewritten in the JSONL files of a database: the next build
  (a complete database, or one that resumes after its text was read) is refused naming the file
  and what to do, instead of going on with the old text as if it were the new. A file touched
  but of the same text is no change."""
  corpus = tmp_path / "corpus.jsonl"
  docs = list(documents("wiki_vital", max_docs=30))
  _wiki_jsonl(corpus, docs)
  config = _config(source="jsonl", paths=(str(corpus),), max_docs=0)
  # A complete database built from it (the fixture's, its settings and corpus made so).
  complete = str(tmp_path / "complete")
  shutil.copytree(db.directory, complete)
  manifest = json.load(open(os.path.join(complete, MANIFEST)))
  manifest.update(settings=db_settings(config), corpus=corpus_files(config))
  for name, record in ((MANIFEST, manifest), (SETTINGS_FILE, db_settings(config))):
    with open(os.path.join(complete, name), "w") as f:
      json.dump(record, f)
  assert build_database(config, complete).directory == complete
  # A database whose text was read, then refused (too many neighbours): it resumes from there.
  partial = str(tmp_path / "partial")
  big_k = _config(source="jsonl", paths=(str(corpus),), max_docs=0, num_neighbours=100_000)
  with pytest.raises(ValueError, match="num_neighbours=100000"):
    build_database(big_k, partial)
  stat = os.stat(corpus)
  os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched, the same text
  with pytest.raises(ValueError, match="num_neighbours=100000"):
    build_database(big_k, partial)
  assert build_database(config, complete).directory == complete
  size = stat.st_size
  _wiki_jsonl(corpus, [{**d, "text": d["text"].upper()} for d in docs[:20]])
  for directory, settings in ((complete, config), (partial, big_k)):
    with pytest.raises(ValueError, match=re.escape(
        f"--config.db.paths: the corpus changed since the chunk database in {directory} was "
        f"built from it ({corpus}: other text ({size:,} bytes then, {os.path.getsize(corpus):,} "
        f"now)), and the database holds the old text. To train on the new text, delete "
        f"{directory} (and the runs trained on it) or give another --config.db.dir and "
        "--workdir; to go on with the database as it is, restore the corpus.")):
      build_database(settings, directory)
  os.remove(corpus)
  with pytest.raises(FileNotFoundError, match=rf"--config.db.paths: Corpus file {corpus} does "
                     "not exist"):
    build_database(config, complete)
  # A corpus refused before anything was built leaves no directory behind.
  corpus.write_text('{"title": "A", "text": "a"}\nnot json\n')
  with pytest.raises(ValueError, match=rf"{corpus}:2"):
    build_database(config, str(tmp_path / "new"))
  assert not (tmp_path / "new").exists()


def test_a_database_being_built_is_refused_to_another_build(db, tmp_path):
  """Two runs given one --config.db.dir would write its files over each other: while one builds
  it (holding its lock), another build is refused naming the holder; a complete database is
  opened by any number of runs at once."""
  from realm_jax import workdir_lock
  building = str(tmp_path / "db")
  with workdir_lock.hold(building, workdir_lock.DATABASE):
    with pytest.raises(workdir_lock.WorkdirInUseError, match=re.escape(
        f"{building} is in use by another build of its chunk database (process {os.getpid()} ")
        + r".*two builds would write the database's files over each other\. Wait for it to end "
        r"or stop it, or pass another --config\.db\.dir\."):
      build_database(_config(num_neighbours=100_000), building)
    assert sorted(os.listdir(building)) == ["build.lock"]  # nothing was written
  with workdir_lock.hold(db.directory, workdir_lock.DATABASE):
    assert build_database(_config(), db.directory).directory == db.directory
