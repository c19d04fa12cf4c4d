"""Okapi BM25 over a list of texts: the sparse baseline for the dense retrievers.

    index = BM25Index.build([a["title"] + " " + a["text"] for a in articles])   # k1=0.9, b=0.4
    scores, rows = index.search(["who wrote hamlet"], k=20)                       # [Q, k] each
    index.save(directory); BM25Index.load(directory)

Tokens are the words of `text.answers.normalize_answer(text)`: lower-case, Unicode NFD with the
accents dropped, ASCII punctuation deleted (so "U.S." -> "us", "rock-n-roll" -> "rocknroll"), the
articles a/an/the removed, split on whitespace. No other stop words, no stemming. The same
normalisation decides whether a retrieved text holds an answer, so a query can match the answer
string token for token.

Score of document d for query q (a term counts as often as it occurs in q):

    score(q, d) = sum_{t in q} idf(t) * tf(t,d) * (k1 + 1) / (tf(t,d) + k1 * (1 - b + b |d| / avgdl))
    idf(t)      = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))

with |d| the number of tokens of d, avgdl their mean over the N documents and df(t) the number of
documents holding t. This is Lucene's BM25 (the idf never negative) times (k1 + 1), which does not
change the ranking. Like Lucene, only documents sharing a term with the query are returned.

Saved as `bm25.safetensors` (the document-term counts, CSR) + `vocab.json` + `manifest.json`,
written into a temporary directory that is renamed into place.
"""

from __future__ import annotations

import collections
import json
import logging
import os
from collections.abc import Iterable, Sequence

import numpy as np
import scipy.sparse as sp

from realm_jax.io_utils import as_path, atomic_write_dir, read_json, write_json
from realm_jax.text.answers import normalize_answer

FORMAT_VERSION = 1
TOKENIZER = "normalize_answer"
MANIFEST = "manifest.json"
ARRAYS = "bm25.safetensors"
VOCAB = "vocab.json"


def tokenize(text: str) -> list[str]:
  """The BM25 tokens of a text: the words of its normalised form (see the module docstring)."""
  return normalize_answer(text).split()


class BM25Index:
  """BM25 scores and top-k search over N documents; rows are positions in the built list."""

  def __init__(self, counts: sp.csr_matrix, vocab: Sequence[str], *, k1: float = 0.9,
               b: float = 0.4, source: str = ""):
    """counts: [N, V] term counts per document; vocab: the V terms, by column; source: what the
    documents are (e.g. a corpus fingerprint), saved with the index so a reader can check it."""
    if counts.shape[1] != len(vocab):
      raise ValueError(f"counts has {counts.shape[1]} columns, the vocabulary {len(vocab)} terms.")
    if k1 < 0 or not 0 <= b <= 1:
      raise ValueError(f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={k1}, b={b}.")
    self.counts = counts.tocsr()
    self.vocab = list(vocab)
    self.term_ids = {t: i for i, t in enumerate(self.vocab)}
    self.k1, self.b, self.source = float(k1), float(b), str(source)

    n = self.counts.shape[0]
    tf = self.counts.data.astype(np.float64)                                     # [nnz]
    doc_len = np.asarray(self.counts.sum(axis=1), np.float64).ravel()           # [N]
    avgdl = doc_len.mean() if n else 0.0
    if avgdl == 0:
      raise ValueError("The documents hold no token: nothing to index.")
    df = np.bincount(self.counts.indices, minlength=len(self.vocab))             # [V]
    self.idf = np.log1p((n - df + 0.5) / (df + 0.5))                             # [V]
    rows = np.repeat(np.arange(n), np.diff(self.counts.indptr))                  # [nnz]
    norm = self.k1 * (1 - self.b + self.b * doc_len[rows] / avgdl)
    weights = self.idf[self.counts.indices] * tf * (self.k1 + 1) / (tf + norm)
    # [V, N]: a query's term counts [Q, V] times this are its scores [Q, N].
    self._weights_t = sp.csr_matrix((weights.astype(np.float32), self.counts.indices.copy(),
                                     self.counts.indptr.copy()), shape=self.counts.shape).T.tocsr()

  @classmethod
  def build(cls, texts: Iterable[str], *, k1: float = 0.9, b: float = 0.4,
            source: str = "") -> "BM25Index":
    """Indexes the texts in order: row i of the index is the i-th text."""
    vocab: dict[str, int] = {}
    indptr, indices, counts = [0], [], []
    for text in texts:
      c = collections.Counter(vocab.setdefault(t, len(vocab)) for t in tokenize(text))
      indices += c.keys()
      counts += c.values()
      indptr.append(len(indices))
    if len(indptr) == 1:
      raise ValueError("BM25Index.build got no text.")
    m = sp.csr_matrix((np.asarray(counts, np.int32), np.asarray(indices, np.int32),
                       np.asarray(indptr, np.int64)), shape=(len(indptr) - 1, len(vocab)))
    m.sort_indices()
    return cls(m, list(vocab), k1=k1, b=b, source=source)

  def __len__(self) -> int:
    return self.counts.shape[0]

  def _query_matrix(self, queries: Sequence[str]) -> sp.csr_matrix:
    """[Q, V] counts of the known query terms."""
    if isinstance(queries, str):  # else each character would be a query
      raise TypeError(f"queries={queries!r} is one string: pass a list of queries, e.g. "
                      f"[{queries!r}].")
    indptr, indices, counts = [0], [], []
    for q in queries:
      c = collections.Counter(self.term_ids[t] for t in tokenize(q) if t in self.term_ids)
      indices += c.keys()
      counts += c.values()
      indptr.append(len(indices))
    return sp.csr_matrix((np.asarray(counts, np.float32), np.asarray(indices, np.int32),
                          np.asarray(indptr, np.int64)), shape=(len(queries), len(self.vocab)))

  def scores(self, queries: Sequence[str]) -> np.ndarray:
    """[Q, N] float32 BM25 scores of every document (0 where no term is shared)."""
    return (self._query_matrix(queries) @ self._weights_t).toarray()

  def search(self, queries: Sequence[str], k: int,
             batch_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """The k best documents of each query: scores [Q, k] float32 (descending) and rows [Q, k]
    int64; ties go to the lower row. A query sharing a term with fewer than k documents gets
    row -1 (score 0) in the remaining places."""
    if not 1 <= k <= len(self):
      raise ValueError(f"k={k}: must be between 1 and the number of documents ({len(self)}).")
    out_scores = np.zeros((len(queries), k), np.float32)
    out_rows = np.full((len(queries), k), -1, np.int64)
    for lo in range(0, len(queries), batch_size):
      s = self._query_matrix(queries[lo:lo + batch_size]) @ self._weights_t     # [B, N] sparse
      s.eliminate_zeros()
      for i in range(s.shape[0]):
        cols = s.indices[s.indptr[i]:s.indptr[i + 1]]
        vals = s.data[s.indptr[i]:s.indptr[i + 1]]
        if len(vals) > k:  # a superset of the top k (all ties at the k-th score), then sort it
          kth = np.partition(vals, len(vals) - k)[len(vals) - k]
          keep = vals >= kth
          cols, vals = cols[keep], vals[keep]
        order = np.lexsort((cols, -vals))[:k]
        out_scores[lo + i, :len(order)] = vals[order]
        out_rows[lo + i, :len(order)] = cols[order]
    return out_scores, out_rows

  def save(self, directory: str | os.PathLike) -> None:
    """Writes the index into `directory`, atomically (replacing it)."""
    from safetensors.numpy import save_file  # local: only saving and loading need it

    manifest = {"format_version": FORMAT_VERSION, "tokenizer": TOKENIZER, "k1": self.k1,
                "b": self.b, "num_docs": len(self), "vocab_size": len(self.vocab),
                "source": self.source}

    def write(tmp):
      save_file({"indptr": self.counts.indptr.astype(np.int64),
                 "indices": self.counts.indices.astype(np.int32),
                 "counts": self.counts.data.astype(np.int32)}, os.path.join(tmp, ARRAYS))
      with open(os.path.join(tmp, VOCAB), "w", encoding="utf-8") as f:
        json.dump(self.vocab, f, ensure_ascii=False)
      write_json(os.path.join(tmp, MANIFEST), manifest)

    atomic_write_dir(directory, write, marker=MANIFEST)

  @classmethod
  def load(cls, directory: str | os.PathLike, *, k1: float | None = None,
           b: float | None = None) -> "BM25Index":
    """Reads an index written by `save`; `k1` / `b` override the saved parameters."""
    from safetensors.numpy import load_file  # local: only saving and loading need it

    directory = os.fspath(directory)
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
      raise FileNotFoundError(f"{path} does not exist: {directory} is not a saved BM25 index "
                              "(write one with BM25Index.save).")
    manifest = read_json(path)
    if manifest.get("format_version") != FORMAT_VERSION or manifest.get("tokenizer") != TOKENIZER:
      raise ValueError(f"{path}: format_version {manifest.get('format_version')!r} / tokenizer "
                       f"{manifest.get('tokenizer')!r}; this realm_jax reads {FORMAT_VERSION} / "
                       f"{TOKENIZER!r}. Rebuild the index.")
    arrays = load_file(os.path.join(directory, ARRAYS))
    vocab = read_json(os.path.join(directory, VOCAB))
    n, v = manifest["num_docs"], manifest["vocab_size"]
    if len(vocab) != v or arrays["indptr"].shape != (n + 1,):
      raise ValueError(f"{directory} does not hold the {n} documents and {v} terms its manifest "
                       "promises; rebuild the index.")
    counts = sp.csr_matrix((arrays["counts"], arrays["indices"], arrays["indptr"]), shape=(n, v))
    return cls(counts, vocab, k1=manifest["k1"] if k1 is None else k1,
               b=manifest["b"] if b is None else b, source=manifest.get("source", ""))


def corpus_bm25(corpus, directory: str, text_of) -> BM25Index:
  """A BM25 index over every row of `corpus` (a `Corpus`: its fingerprint and length are read),
  document r being `text_of(r)`; saved in `directory` once and rebuilt when the corpus is another
  (its fingerprint is saved with it)."""
  source = f"corpus {corpus.fingerprint}"
  if as_path(os.path.join(directory, MANIFEST)).exists():
    index = BM25Index.load(directory)
    if index.source == source and len(index) == len(corpus):
      return index
    logging.warning("%s indexes %s (%d documents), not the %s (%d blocks): rebuilding it.",
                    directory, index.source or "an unrecorded corpus", len(index), source,
                    len(corpus))
  index = BM25Index.build((text_of(r) for r in range(len(corpus))), source=source)
  index.save(directory)
  return index
