"""End-to-end dense retrieval over the embedded Wikipedia corpus with the real MiniLM weights.

Embeds every article as the segment pair (title, text) with all-MiniLM-L6-v2 in the Flax BERT
(mean pooling, L2-normalised), caches the [N, 384] matrix in the work directory, and answers
questions by exact maximum inner product. This is the package's main job until pre-training lands.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from realm_jax.checkpoints import load_minilm, minilm_dir
from realm_jax.checkpoints.hf import _atomic_write
from realm_jax.data.wiki_vital import load_articles
from realm_jax.models import RealmEmbedder
from realm_jax.retrieval.embed import embed_in_buckets
from realm_jax.text import BertTokenizer, batch_join

EMBEDDINGS = "corpus_embeddings.safetensors"


def _fingerprint(articles, max_length: int) -> str:
  h = hashlib.sha256()
  h.update(f"all-MiniLM-L6-v2|{os.path.getsize(os.path.join(minilm_dir(), 'model.safetensors'))}|"
           f"{max_length}|".encode())
  for a in articles:
    h.update(a["title"].encode() + b"\0" + a["text"].encode() + b"\1")
  return h.hexdigest()[:16]


def embed_articles(articles, workdir: str, max_length: int = 256, batch_size: int = 64):
  """[N, 384] float32 embeddings of the articles, computed once and cached in `workdir`."""
  from safetensors.numpy import load_file, save_file

  config, params, vocab = load_minilm()
  tok = BertTokenizer(vocab)
  fingerprint = _fingerprint(articles, max_length)
  path = os.path.join(workdir, EMBEDDINGS)
  if os.path.exists(path):
    cached = load_file(path)
    meta = json.loads(open(path + ".json", encoding="utf-8").read()) if os.path.exists(
        path + ".json") else {}
    if meta.get("fingerprint") == fingerprint:
      logging.info("Loaded %d cached embeddings from %s", len(cached["embeddings"]), path)
      return cached["embeddings"]
    logging.info("%s was made from other articles or settings; re-embedding.", path)

  t0 = time.perf_counter()
  titles = tok.encode_batch([a["title"] for a in articles])
  texts = tok.encode_batch([a["text"] for a in articles])
  inputs = batch_join(zip(titles, texts), max_length, tok, truncate="longest")
  logging.info("Tokenised %d articles in %.1f s", len(articles), time.perf_counter() - t0)

  model = RealmEmbedder(config, pooling="mean", normalize=True)
  embed = jax.jit(lambda p, b: model.apply({"params": {"realm": p}}, b["input_ids"],
                                           b["attention_mask"], b["token_type_ids"]))
  params = jax.device_put(params)
  emb = embed_in_buckets(lambda b: embed(params, b), inputs, batch_size, desc="embedding articles")

  os.makedirs(workdir, exist_ok=True)
  _atomic_write(path, lambda p: save_file({"embeddings": emb}, p))

  def write_meta(p):
    with open(p, "w", encoding="utf-8") as f:
      json.dump({"fingerprint": fingerprint, "count": len(emb), "max_length": max_length,
                 "model": "all-MiniLM-L6-v2", "pooling": "mean, L2-normalised"}, f, indent=2)
  _atomic_write(path + ".json", write_meta)
  return emb


def search(questions: Sequence[str], doc_emb: np.ndarray, k: int = 5, max_length: int = 64):
  """Top-k (scores [Q, k], indices [Q, k]) of questions against the document embeddings."""
  if not questions:
    raise ValueError("No question given: pass at least one --question.")
  for q in questions:
    if not q.strip():
      raise ValueError("Empty question: ask something, e.g. --question='who painted the Mona Lisa'.")
  config, params, vocab = load_minilm()
  tok = BertTokenizer(vocab)
  inputs = batch_join([(ids, None) for ids in tok.encode_batch(list(questions))], max_length, tok,
                      truncate="longest")
  model = RealmEmbedder(config, pooling="mean", normalize=True)
  q = model.apply({"params": {"realm": params}}, inputs["input_ids"], inputs["attention_mask"],
                  inputs["token_type_ids"])
  scores, idx = jax.lax.top_k(q @ jnp.asarray(doc_emb).T, min(k, len(doc_emb)))
  return np.asarray(scores), np.asarray(idx)


def run(workdir: str, questions: Sequence[str], k: int = 5, max_length: int = 256,
        batch_size: int = 64, max_docs: int | None = None) -> list[list[tuple[str, float]]]:
  """Embeds the corpus (or loads the cache) and prints the top-k article titles per question."""
  articles = load_articles()
  if max_docs:
    articles = articles[:max_docs]
  emb = embed_articles(articles, workdir, max_length, batch_size)
  scores, idx = search(questions, emb, k)
  results = []
  for question, row_s, row_i in zip(questions, scores, idx):
    hits = [(articles[i]["title"], float(s)) for s, i in zip(row_s, row_i)]
    results.append(hits)
    print(f"\nQ: {question}")
    for rank, (title, score) in enumerate(hits, 1):
      print(f"  {rank}. {score:.3f}  {title}")
  return results
