"""Sampling from a trained RETRO decoder with retrieval (experiments/retro_sample.py, the
notebook): each time the text completes a chunk of m tokens, the chunk is embedded by the frozen
key BERT and its neighbours are searched in the database's index; the tokens that follow read
them through CCA. Every neighbour used is returned as evidence.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from realm_jax.checkpoints import retro_export
from realm_jax.models.retro import RetroModel


@dataclasses.dataclass
class Evidence:
  chunk: int                 # the chunk of the text that retrieved them (0-based)
  chunk_text: str
  neighbours: list[dict]     # {"chunk_id", "score", "title", "text": neighbour + continuation}


class RetroLm:
  """A RETRO (or baseline) export with the chunk database it was trained with."""

  def __init__(self, export_dir: str, db, searcher: str | None = None, flag: str = "--model"):
    self.config, params, meta = retro_export.load(export_dir, flag=flag)
    db.check_export(self.config, meta)
    self.db, self.params = db, jax.device_put(params)
    self.index = db.load_index(searcher) if self.config.retrieval else None
    m = self.config.chunk_length
    # The padded context every call runs on: the sequences it was trained on (a pre-trained
    # decoder's own context, 8,192 tokens for SmolLM2, would make every step cost that much).
    self.length = min(self.config.max_length, db.chunk_length * db.seq_chunks) // m * m
    module = RetroModel(self.config)
    self._logits = jax.jit(lambda p, t, n, i: module.apply({"params": p}, t, n)[0, i])

  def _retrieve(self, chunk: np.ndarray) -> tuple[np.ndarray, list[dict]]:
    """Neighbours [K, R] of one complete chunk [m], and what each is (Evidence.neighbours)."""
    k = self.config.num_neighbours
    scores, ids = self.index.search(self.db.embed_keys(chunk[None]), k)
    values = self.db.values(ids[0])                                 # [K, R]
    tok = self.db.tokenizer
    found = [{"chunk_id": int(i), "score": float(s), "title": self.db.chunk_title(int(i)),
              "text": tok.decode(v)}
             for i, s, v in zip(ids[0], scores[0], values)]
    return values, found

  def generate(self, prompt: str, max_new_tokens: int = 64, temperature: float = 1.0,
               top_k: int = 0, seed: int = 0, retrieval: bool = True
               ) -> tuple[str, list[Evidence]]:
    """(the continuation of `prompt`, the neighbours each completed chunk retrieved). Sampling
    stops at the end-of-document token, after `max_new_tokens`, or at the end of the context.
    temperature 0 is greedy; top_k > 0 samples among the k likeliest tokens."""
    tok, c = self.db.tokenizer, self.config
    ids = [tok.eos_id] + tok.encode_batch([prompt])[0]
    if len(ids) >= self.length:
      raise ValueError(f"--prompt is {len(ids)} tokens long (with the leading separator); the "
                       f"model's context is {self.length} tokens: shorten the prompt.")
    if temperature < 0 or top_k < 0 or max_new_tokens < 0:
      raise ValueError(f"--temperature={temperature}, --top_k={top_k} and --max_new_tokens="
                       f"{max_new_tokens} must not be negative.")
    m, k = c.chunk_length, c.num_neighbours
    use = retrieval and self.index is not None
    neighbours = np.full((1, self.length // m, k, 2 * m), tok.pad_id, np.int32)
    evidence, retrieved = [], 0
    rng = np.random.default_rng(seed)
    prompt_len = len(ids)
    while len(ids) - prompt_len < max_new_tokens and len(ids) < self.length:
      while use and (retrieved + 1) * m <= len(ids):   # a chunk completed: retrieve for it
        chunk = np.asarray(ids[retrieved * m:(retrieved + 1) * m])
        neighbours[0, retrieved], found = self._retrieve(chunk)
        evidence.append(Evidence(retrieved, tok.decode(chunk.tolist()), found))
        retrieved += 1
      tokens = np.full((1, self.length), tok.pad_id, np.int32)
      tokens[0, :len(ids)] = ids
      logits = np.asarray(self._logits(self.params, tokens, neighbours if use else None,
                                       len(ids) - 1), np.float64)
      nxt = _sample(logits, temperature, top_k, rng)
      if nxt == tok.eos_id:
        break
      ids.append(nxt)
    return tok.decode(ids[prompt_len:]), evidence


def _sample(logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator) -> int:
  if temperature == 0:
    return int(np.argmax(logits))
  logits = logits / temperature
  if top_k:
    cut = np.partition(logits, -top_k)[-top_k]
    logits = np.where(logits >= cut, logits, -np.inf)
  p = np.exp(logits - logits.max())
  return int(rng.choice(len(p), p=p / p.sum()))

