"""Host side of a pre-training step: retrieve K - 1 blocks per masked query from the current index
(never the block the sentence came from), put the null document first, and lay out the inputs of
both towers and of the knowledge-augmented encoder.

Retrieval uses the query tower of the current parameters against the (possibly stale) index; the
train step then re-embeds the query and all K candidates with the same current parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from realm_jax.retrieval.index import DocIndex
from realm_jax.text.answers import find_subsequences


def _pad(rows: list[list[int]], length: int, types: list[list[int]] | None = None):
  n = len(rows)
  out = {"input_ids": np.zeros((n, length), np.int32),
         "attention_mask": np.zeros((n, length), np.int32),
         "token_type_ids": np.zeros((n, length), np.int32)}
  for i, ids in enumerate(rows):
    out["input_ids"][i, :len(ids)] = ids
    out["attention_mask"][i, :len(ids)] = 1
    if types is not None:
      out["token_type_ids"][i, :len(ids)] = types[i]
  return out


def masked_span(queries: dict, i: int) -> list[int]:
  """The target word pieces of example i's masked span, in order."""
  w = queries["mlm_weights"][i] > 0
  order = np.argsort(queries["mlm_positions"][i][w], kind="stable")
  return queries["mlm_targets"][i][w][order].tolist()


class CandidateBuilder:
  """Turns a batch of masked queries into a full REALM batch (see `realm_step`).

  Args:
    corpus: the indexed `Corpus` (rows give title and body word pieces).
    cls_id, sep_id: special token ids.
    num_candidates: K, including the null document.
    doc_length: Ld, `[CLS] title [SEP] body [SEP]` for the document tower (REALM: 288).
    joint_length: Le, `[CLS] x [SEP] body [SEP]` for the encoder (REALM: 384).
    null_document: False masks the null document out of p(z|x) (an ablation: the encoder must
      read a retrieved block even when none helps); it stays the candidate of a query that
      retrieved nothing, so that every query has one. The shapes do not change.
  """

  def __init__(self, corpus, cls_id: int, sep_id: int, num_candidates: int, doc_length: int,
               joint_length: int, null_document: bool = True):
    if num_candidates < 1:
      raise ValueError(f"num_candidates={num_candidates}: need at least 1 (the null document).")
    if doc_length < 3:
      raise ValueError(f"doc_length={doc_length}: need at least 3, for [CLS] title [SEP] body "
                       "[SEP].")
    self.corpus, self.cls, self.sep = corpus, cls_id, sep_id
    self.k, self.doc_length, self.joint_length = num_candidates, doc_length, joint_length
    self.null_document = null_document
    self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

  def _block(self, row: int) -> tuple[list[int], list[int]]:
    """(title ids, body ids) of a corpus row; cached, the corpus never changes under a run. The
    cache holds int32 arrays: 705 bytes per block of the demo (43 word pieces on average) against
    1,595 as lists of numpy scalars, which grow ~33 bytes a piece (~9.6 KB for 288)."""
    got = self._cache.get(row)
    if got is None:
      ex = self.corpus[row]
      got = (np.asarray(ex["title_token_ids"], np.int32), np.asarray(ex["token_ids"], np.int32))
      if len(self._cache) < 1_000_000:
        self._cache[row] = got
    return got[0].tolist(), got[1].tolist()

  def _doc(self, title, body):
    """[CLS] title [SEP] body [SEP] cut to doc_length (the body first, then a title longer than
    doc_length - 3, as ICT cuts it; an empty block is the null document [CLS] [SEP] [SEP])."""
    head = [self.cls] + title[:max(0, self.doc_length - 3)] + [self.sep]
    body = body[:max(0, self.doc_length - len(head) - 1)]
    ids = head + body + [self.sep]
    return ids, [0] * len(head) + [1] * (len(ids) - len(head))

  def build(self, queries: dict[str, np.ndarray], rows: np.ndarray) -> dict:
    """queries: the pipeline's batch ([B, Lq] query arrays, mlm_*); rows [B, K-1] corpus rows of the
    retrieved blocks (-1 = none). Returns the step's batch (numpy), with `span_found` [B]: 1 where
    the masked span's word pieces occur in the body a retrieved candidate shows the encoder (the
    evidence is there to copy; REALM's "the retriever found it" diagnostic)."""
    b, k = len(queries["input_ids"]), self.k
    q_len = queries["attention_mask"].sum(-1)
    docs, doc_types, joint, joint_types = [], [], [], []
    mask = np.zeros((b, k), np.float32)
    found = np.zeros((b,), np.float32)
    for i in range(b):
      span = masked_span(queries, i)
      x = queries["input_ids"][i, :q_len[i]].tolist()                 # [CLS] x [SEP]
      if len(x) + 1 > self.joint_length:
        raise ValueError(f"A query of {len(x)} word pieces does not fit joint_length="
                         f"{self.joint_length}: raise joint_length or lower query_length.")
      for c in range(k):
        row = -1 if c == 0 else int(rows[i, c - 1])
        title, body = ([], []) if row < 0 else self._block(row)
        mask[i, c] = 1.0 if (c == 0 or row >= 0) else 0.0
        ids, types = self._doc(title, body)
        docs.append(ids)
        doc_types.append(types)
        body = body[:self.joint_length - len(x) - 1]
        if c > 0 and not found[i] and span and find_subsequences(body, [span]):
          found[i] = 1.0
        joint.append(x + body + [self.sep])
        joint_types.append([0] * len(x) + [1] * (len(body) + 1))
      if not self.null_document and mask[i, 1:].any():
        mask[i, 0] = 0.0
    reshape = lambda d, length: {n: v.reshape(b, k, length) for n, v in d.items()}
    return {
        "query": {n: queries[n] for n in ("input_ids", "attention_mask", "token_type_ids")},
        "candidates": reshape(_pad(docs, self.doc_length, doc_types), self.doc_length),
        "joint": reshape(_pad(joint, self.joint_length, joint_types), self.joint_length),
        "candidate_mask": mask,
        "span_found": found,
        "mlm_positions": queries["mlm_positions"].astype(np.int32),
        "mlm_targets": queries["mlm_targets"].astype(np.int32),
        "mlm_weights": queries["mlm_weights"].astype(np.float32),
    }


def retrieve(index: DocIndex, corpus, query_emb: np.ndarray, exclude_block_ids: np.ndarray,
             num_retrieved: int) -> tuple[np.ndarray, np.ndarray]:
  """Top `num_retrieved` blocks per query, the query's own block excluded.

  Returns (block ids [B, R], corpus rows [B, R]); when the index holds fewer blocks than asked
  the missing slots are -1 (and become masked candidates).
  """
  b = len(query_emb)
  if num_retrieved == 0:
    return np.zeros((b, 0), np.int64), np.zeros((b, 0), np.int64)
  k = min(num_retrieved, index.count - 1)
  ids = np.full((b, num_retrieved), -1, np.int64)
  if k > 0:
    _, got = index.search(query_emb, k, exclude_ids=exclude_block_ids)
    ids[:, :k] = got
  rows = np.where(ids >= 0, corpus.rows_of(np.maximum(ids, 0)), -1)
  if (rows[ids >= 0] < 0).any():
    raise ValueError("The index returned block ids that are not in the corpus: it was built from "
                     "another corpus. Rebuild the index (or point the run at the right corpus).")
  return ids, rows


def make_batch(index: DocIndex, corpus, builder: CandidateBuilder,
               embed_queries: Callable[[dict], np.ndarray], queries: dict) -> tuple[dict, np.ndarray]:
  """Retrieval + layout for one pipeline batch; returns (step batch, retrieved block ids)."""
  q = {n: queries[n] for n in ("input_ids", "attention_mask", "token_type_ids")}
  emb = np.asarray(embed_queries(q))
  ids, rows = retrieve(index, corpus, emb, queries["block_id"], builder.k - 1)
  return builder.build(queries, rows), ids
