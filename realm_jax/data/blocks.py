"""REALM blocks: documents split into sentences and packed greedily into fixed word-piece budgets.

A block is `[CLS] title [SEP] body [SEP]` of at most `block_length` word pieces (288 in REALM): the
body is as many whole consecutive sentences as fit; a single sentence longer than the budget is cut
between words into pieces that fit (inside a word only where one word alone is longer), each piece
keeping its own text. A title so long that it leaves fewer than `MIN_BODY_PIECES` for text is cut,
with a warning. Each block has a stable id, the SHA-1 of title and body (as in the released REALM
code), truncated to a positive int64.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
from collections.abc import Iterator

import numpy as np

from realm_jax.text import BertTokenizer

BLOCKINGS = ("sentences", "article")
# Part of every corpus fingerprint: bump it when blocks come out differently, so that corpora built
# by older code are rebuilt rather than reused. 3: a sentence longer than a block is cut between
# words and keeps its own text (2 cut anywhere and kept the decoded word pieces).
BLOCKING_VERSION = 3
# Word pieces of text a block keeps at least, however long its title.
MIN_BODY_PIECES = 8


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


def cut_text(text: str, tokenizer: BertTokenizer, length: int) -> list[tuple[str, list[int]]]:
  """`text` cut into pieces of at most `length` word pieces: [(its substring of `text`, ids)].

  Each piece ends before a space if one is in reach, else before the start of a word (a word
  piece that is not "##..."), else inside a word (only where one word alone is longer); a cut
  keeps at least half of `length`, so that a long run without spaces (Chinese, a URL) after a
  short lead-in does not leave a block of a word or two.
  """
  ((ids, offsets),) = tokenizer.encode_batch_with_offsets([text])
  starts_word = ~tokenizer.continuation[np.asarray(ids, np.int64)]  # [n] bool
  pieces, lo = [], 0
  while lo < len(ids):
    hi = min(lo + length, len(ids))
    if hi < len(ids):
      ends = range(hi, lo + max(1, length // 2) - 1, -1)
      hi = next((h for h in ends if starts_word[h] and offsets[h][0] > offsets[h - 1][1]),
                next((h for h in ends if starts_word[h]), hi))
    pieces.append((text[offsets[lo][0]:offsets[hi - 1][1]], ids[lo:hi]))
    lo = hi
  return pieces


def pack_blocks(title: str, text: str, tokenizer: BertTokenizer, block_length: int = 288,
                blocking: str = "sentences", where: str = "") -> Iterator[dict]:
  """Yields the blocks of one document.

  Each block: `block_id`, `title`, `body` (its sentences joined by spaces), `title_token_ids`,
  `token_ids` (body word pieces), `sentence_starts` (offset of each sentence in `token_ids`).
  With blocking="article" the whole document is one block, untruncated (for article-level
  retrieval such as the MiniLM baseline; truncation then happens when it is embedded).
  `where` names the document in warnings (e.g. "docs.jsonl:12").
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
  elif budget < MIN_BODY_PIECES:
    most = block_length - 3 - MIN_BODY_PIECES
    if most < 1:
      raise ValueError(
          f"block_length={block_length} leaves fewer than {MIN_BODY_PIECES} word pieces for text "
          f"after [CLS] title [SEP] ... [SEP]: use block_length >= {MIN_BODY_PIECES + 4}.")
    cut, cut_ids = cut_text(title, tokenizer, most)[0]
    logging.warning(
        "%s: the title %r has %d word pieces, which leaves fewer than %d for text in a block of "
        "block_length=%d; it is cut to its first %d.", where or "A document", title[:80],
        len(title_ids), MIN_BODY_PIECES, block_length, len(cut_ids))
    title, title_ids = cut, cut_ids
    budget = block_length - 3 - len(title_ids)

  pieces: list[tuple[str, list[int]]] = []
  for sent, ids in zip(sentences, sent_ids):
    if not ids:  # e.g. only format characters (a BOM, zero-width spaces): nothing to keep
      continue
    if len(ids) <= budget:
      pieces.append((sent, ids))
    else:  # a sentence longer than a whole block
      pieces += cut_text(sent, tokenizer, budget)

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
