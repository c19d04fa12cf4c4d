"""BM25: scores against the formula computed by hand, top-k against a brute-force ranking, and the
saved index."""

import math

import numpy as np
import pytest

from realm_jax.retrieval.bm25 import BM25Index, tokenize

DOCS = ["Paris is the capital of France. Paris has the Seine.",
        "Lyon is a city of France on the Rhone",
        "Berlin is the capital of Germany",
        "The Seine flows through Paris, France's capital, and Rouen."]
QUERIES = ["capital of France", "paris paris seine", "Rhône city", "berlin", "Tokyo", "of"]


def reference_scores(docs, query, k1=0.9, b=0.4):
  """Sum over the query's tokens of idf * tf (k1 + 1) / (tf + k1 (1 - b + b |d| / avgdl))."""
  toks = [tokenize(d) for d in docs]
  n, avgdl = len(docs), sum(len(t) for t in toks) / len(docs)
  out = []
  for t in toks:
    s = 0.0
    for term in tokenize(query):
      df = sum(term in other for other in toks)
      tf = t.count(term)
      if tf:
        idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
        s += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(t) / avgdl))
    out.append(s)
  return out


def reference_top_k(scores, k):
  """Rows with a positive score, best first, ties to the lower row; -1 after the matches."""
  ranked = sorted((r for r in range(len(scores)) if scores[r] > 0), key=lambda r: (-scores[r], r))
  return (ranked + [-1] * k)[:k]


def test_tokenize_is_the_answer_normalisation():
  assert tokenize("The Seine flows through Paris, France's capital.") == [
      "seine", "flows", "through", "paris", "frances", "capital"]
  assert tokenize("Rhône  U.S.A. a") == ["rhone", "usa"]


def test_scores_equal_the_formula_by_hand():
  index = BM25Index.build(DOCS)
  # One case written out: "berlin" occurs once, in doc 2 only (df = 1, N = 4).
  assert [len(tokenize(d)) for d in DOCS] == [8, 7, 5, 8]  # articles and punctuation gone
  idf = math.log(1 + (4 - 1 + 0.5) / (1 + 0.5))
  want = idf * 1 * 1.9 / (1 + 0.9 * (1 - 0.4 + 0.4 * 5 / 7))  # avgdl = 28 / 4
  np.testing.assert_allclose(index.scores(["berlin"])[0], [0, 0, want, 0], rtol=1e-6)

  got = index.scores(QUERIES)                          # [Q, N]
  assert got.shape == (len(QUERIES), len(DOCS)) and got.dtype == np.float32
  np.testing.assert_allclose(got, [reference_scores(DOCS, q) for q in QUERIES], rtol=1e-6)
  other = BM25Index.build(DOCS, k1=1.5, b=0.9)
  np.testing.assert_allclose(other.scores(QUERIES),
                             [reference_scores(DOCS, q, 1.5, 0.9) for q in QUERIES], rtol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_search_returns_the_reference_top_k(k):
  index = BM25Index.build(DOCS)
  scores, rows = index.search(QUERIES, k, batch_size=4)  # two batches
  assert scores.shape == rows.shape == (len(QUERIES), k) and rows.dtype == np.int64
  for q, query in enumerate(QUERIES):
    ref = reference_scores(DOCS, query)
    assert list(rows[q]) == reference_top_k(ref, k), query
    np.testing.assert_allclose(scores[q], [ref[r] if r >= 0 else 0 for r in rows[q]], rtol=1e-6)
  assert list(rows[4]) == [-1] * k  # "Tokyo" matches nothing


def test_search_breaks_ties_by_row():
  index = BM25Index.build(["x y", "z", "x y", "y x"])
  _, rows = index.search(["x"], 3)
  assert list(rows[0]) == [0, 2, 3]
  with pytest.raises(ValueError, match="k=5: must be between 1 and the number of documents"):
    index.search(["x"], 5)


def test_save_load_round_trip(tmp_path):
  index = BM25Index.build(DOCS)
  path = tmp_path / "bm25"
  index.save(path)
  index.save(path)  # replacing an existing index works
  loaded = BM25Index.load(path)
  assert loaded.vocab == index.vocab and (loaded.k1, loaded.b) == (0.9, 0.4)
  np.testing.assert_array_equal(loaded.scores(QUERIES), index.scores(QUERIES))
  for a, b in zip(loaded.search(QUERIES, 3), index.search(QUERIES, 3)):
    np.testing.assert_array_equal(a, b)
  tuned = BM25Index.load(path, k1=1.2, b=0.75)
  np.testing.assert_allclose(tuned.scores(QUERIES),
                             [reference_scores(DOCS, q, 1.2, 0.75) for q in QUERIES], rtol=1e-6)
  assert sorted(p.name for p in path.iterdir()) == [
      "bm25.safetensors", "manifest.json", "vocab.json"]
  BM25Index.build(DOCS, source="corpus abc").save(path)
  assert BM25Index.load(path).source == "corpus abc" and loaded.source == ""
  with pytest.raises(FileNotFoundError, match="is not a saved BM25 index"):
    BM25Index.load(tmp_path / "nothing")


def test_bad_input():
  with pytest.raises(ValueError, match="got no text"):
    BM25Index.build([])
  with pytest.raises(ValueError, match="hold no token"):
    BM25Index.build(["the", "..."])
  with pytest.raises(ValueError, match="k1 >= 0 and 0 <= b <= 1"):
    BM25Index.build(DOCS, b=2)
  index = BM25Index.build(DOCS)
  for call in (index.scores, lambda q: index.search(q, 2)):  # not 16 one-character queries
    with pytest.raises(TypeError, match="is one string: pass a list of queries"):
      call("capital of France")


def test_the_saved_index_of_a_workdir_is_rebuilt_for_another_corpus_of_the_same_size(tmp_path,
                                                                                     caplog):
  from types import SimpleNamespace

  from realm_jax.eval.report import bm25_of
  read = []

  def setup(fingerprint, docs):
    block = lambda r: read.append(r) or {"text": docs[r]}
    return SimpleNamespace(workdir=str(tmp_path), batcher=SimpleNamespace(block=block),
                           corpus=_Corpus(fingerprint, len(docs)))

  other = [d + " zebra" for d in DOCS]
  first = bm25_of(setup("aaa", DOCS))
  assert len(read) == len(DOCS)
  again = bm25_of(setup("aaa", DOCS))  # loaded: no block read
  assert len(read) == len(DOCS) and again.vocab == first.vocab
  with caplog.at_level("WARNING"):
    rebuilt = bm25_of(setup("bbb", other))
  assert "indexes corpus aaa (4 documents), not the corpus bbb (4 blocks): rebuilding" in (
      caplog.text)
  np.testing.assert_allclose(rebuilt.scores(["zebra"]), [reference_scores(other, "zebra")],
                             rtol=1e-6)


class _Corpus:
  """What bm25_of reads of a corpus: its fingerprint and size."""

  def __init__(self, fingerprint, n):
    self.fingerprint, self._n = fingerprint, n

  def __len__(self):
    return self._n
