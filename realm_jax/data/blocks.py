"""REALM blocks: documents split into sentences and packed greedily into fixed word-piece budgets.

A block is `[CLS] title [SEP] body [SEP]` of at most `block_length` word pieces (288 in REALM): the
body is as many whole consecutive sentences as fit; a single sentence longer than the budget is cut
into budget-sized pieces. Each block has a stable id, the SHA-1 of title and body (as in the
released REALM code), truncated to a positive int64.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterator

import numpy as np

from realm_jax.text import BertTokenizer

BLOCKINGS = ("sentences", "article")
# Part of every corpus fingerprint: bump it when blocks come out differently, so that corpora built
# by older code are rebuilt rather than reused.
BLOCKING_VERSION = 2


@functools.lru_cache(maxsize=1)
def _segmenter():
  import pysbd  # rule-based sentence boundary detection, no model download
  return pysbd.Segmenter(language="en", clean=False, char_span=True)


_FALLBACK_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z])")


def split_sentences(text: str) -> list[str]:
  """Sentences of `text` (whitespace-trimmed, none empty), with a real sentence splitter.

  pysbd occasionally loses text (it returns nothing for "E\u266d major ... Beethoven."); when its
  sentences do not cover every non-space character of `text`, a plain punctuation split is used.
  """
  out = [s.sent.strip() for s in _segmenter().segment(text)]
  out = [s for s in out if s]
  if "".join("".join(out).split()) != "".join(text.split()):
    out = [s.strip() for s in _FALLBACK_SPLIT.split(text) if s.strip()]
  return out


def block_id(title: str, body: str) -> int:
  """Stable 63-bit id of a block from its title and body."""
  digest = hashlib.sha1(title.encode("utf-8") + b"\x00" + body.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF


def pack_blocks(title: str, text: str, tokenizer: BertTokenizer, block_length: int = 288,
                blocking: str = "sentences") -> Iterator[dict]:
  """Yields the blocks of one document.

  Each block: `block_id`, `title`, `body` (its sentences joined by spaces), `title_token_ids`,
  `token_ids` (body word pieces), `sentence_starts` (offset of each sentence in `token_ids`).
  With blocking="article" the whole document is one block, untruncated (for article-level
  retrieval such as the MiniLM baseline; truncation then happens when it is embedded).
  """
  if blocking not in BLOCKINGS:
    raise ValueError(f"blocking={blocking!r}: use one of {BLOCKINGS}.")
  title_ids = tokenizer.encode(title)
  sentences = split_sentences(text)
  if not sentences:
    return
  sent_ids = tokenizer.encode_batch(sentences)
  budget = block_length - 3 - len(title_ids)
  if blocking == "article":
    budget = float("inf")
  elif budget < 8:
    raise ValueError(
        f"Title {title[:80]!r} has {len(title_ids)} word pieces: with block_length={block_length} "
        "that leaves fewer than 8 for text. Shorten the title or raise block_length.")

  pieces: list[tuple[str, list[int]]] = []
  for sent, ids in zip(sentences, sent_ids):
    if not ids:  # e.g. only format characters (a BOM, zero-width spaces): nothing to keep
      continue
    if len(ids) <= budget:
      pieces.append((sent, ids))
    else:  # a sentence longer than a whole block: cut it into budget-sized pieces
      for lo in range(0, len(ids), budget):
        chunk = ids[lo:lo + budget]
        pieces.append((tokenizer.decode(chunk), chunk))

  def make(group):
    body = " ".join(s for s, _ in group)
    starts = np.cumsum([0] + [len(ids) for _, ids in group[:-1]]).astype(np.int32)
    return dict(block_id=block_id(title, body), title=title, body=body,
                title_token_ids=np.asarray(title_ids, np.int32),
                token_ids=np.asarray([t for _, ids in group for t in ids], np.int32),
                sentence_starts=starts)

  group, used = [], 0
  for sent, ids in pieces:
    if group and used + len(ids) > budget:
      yield make(group)
      group, used = [], 0
    group.append((sent, ids))
    used += len(ids)
  if group:
    yield make(group)
