"""End-to-end dense retrieval over the embedded Wikipedia corpus with the real MiniLM weights.

Embeds every article as the segment pair (title, text) with all-MiniLM-L6-v2 in the Flax BERT
(mean pooling, L2-normalised), caches the [N, 384] matrix in the work directory, and answers
questions by exact maximum inner product. This is the package's main job until pre-training lands.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from realm_jax.checkpoints import minilm_dir
from realm_jax.data.wiki_vital import load_articles
from realm_jax.io_utils import atomic_write, read_json, write_json
from realm_jax.retrieval.embed import embed_in_buckets
from realm_jax.retrieval.towers import Tower, load_tower
from realm_jax.text import BertTokenizer, batch_join

EMBEDDINGS = "corpus_embeddings.safetensors"


def _fingerprint(articles, max_length: int) -> str:
  h = hashlib.sha256()
  h.update(f"all-MiniLM-L6-v2|{os.path.getsize(os.path.join(minilm_dir(), 'model.safetensors'))}|"
           f"{max_length}|".encode())
  for a in articles:
    h.update(a["title"].encode() + b"\0" + a["text"].encode() + b"\1")
  return h.hexdigest()[:16]


def embed_articles(encoder: Tower, articles, workdir: str, max_length: int = 256,
                   batch_size: int = 64) -> np.ndarray:
  """[N, 384] float32 embeddings of the articles, computed once and cached in `workdir`."""
  from safetensors.numpy import load_file, save_file

  fingerprint = _fingerprint(articles, max_length)
  path = os.path.join(workdir, EMBEDDINGS)
  if os.path.exists(path) and os.path.exists(path + ".json"):
    if read_json(path + ".json").get("fingerprint") == fingerprint:
      emb = load_file(path)["embeddings"]
      logging.info("Loaded %d cached embeddings from %s", len(emb), path)
      return emb
    logging.info("%s was made from other articles or settings; re-embedding.", path)

  t0 = time.perf_counter()
  tok = encoder.tokenizer
  titles = tok.encode_batch([a["title"] for a in articles])
  texts = tok.encode_batch([a["text"] for a in articles])
  inputs = batch_join(zip(titles, texts), max_length, tok, truncate="longest")
  logging.info("Tokenised %d articles in %.1f s", len(articles), time.perf_counter() - t0)
  emb = embed_in_buckets(encoder.embed, inputs, batch_size, desc="embedding articles")
  # Data first, then the manifest that vouches for it: a run killed in between re-embeds.
  atomic_write(path, lambda p: save_file({"embeddings": emb}, p))
  write_json(path + ".json", {"fingerprint": fingerprint, "count": len(emb),
                              "max_length": max_length, "model": "all-MiniLM-L6-v2",
                              "pooling": "mean, L2-normalised"})
  return emb


def search(encoder: Tower, questions: Sequence[str], doc_emb: np.ndarray, k: int = 5,
           max_length: int = 64):
  """Top-k (scores [Q, k], indices [Q, k]) of questions against the document embeddings."""
  if not questions:
    raise ValueError("No question given: pass at least one --question.")
  for q in questions:
    if not q.strip():
      raise ValueError("Empty question: ask something, e.g. --question='who painted the Mona Lisa'.")
  tok = encoder.tokenizer
  inputs = batch_join([(ids, None) for ids in tok.encode_batch(list(questions))], max_length, tok,
                      truncate="longest")
  q = encoder.embed(inputs)
  scores, idx = jax.lax.top_k(q @ jnp.asarray(doc_emb).T, min(k, len(doc_emb)))
  return np.asarray(scores), np.asarray(idx)


def run(workdir: str, questions: Sequence[str], k: int = 5, max_length: int = 256,
        batch_size: int = 64, max_docs: int | None = None) -> list[list[tuple[str, float]]]:
  """Embeds the corpus (or loads the cache) and prints the top-k article titles per question."""
  articles = load_articles()
  if max_docs:
    articles = articles[:max_docs]
  encoder = load_tower("minilm")
  emb = embed_articles(encoder, articles, workdir, max_length, batch_size)
  scores, idx = search(encoder, questions, emb, k)
  results = []
  for question, row_s, row_i in zip(questions, scores, idx):
    hits = [(articles[i]["title"], float(s)) for s, i in zip(row_s, row_i)]
    results.append(hits)
    print(f"\nQ: {question}")
    for rank, (title, score) in enumerate(hits, 1):
      print(f"  {rank}. {score:.3f}  {title}")
  return results
