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

# pysbd's time grows with the square of the length of a line (each abbreviation it finds rewrites
# the whole line; each sentence is looked for from the start of the text): a line of 100,000
# characters takes 5 s, 200,000 20 s, 5 million hours. A text up to this length (a long Wikipedia
# article) still goes to pysbd whole, so that its blocks, and their ids, are those that earlier
# versions made; a longer one in pieces (`_pieces`). pysbd's answer for a whole line also depends
# on all of it ("Old St. Peter's" is cut after "St." in some texts and not in others), so no
# cutting reproduces it exactly.
_WHOLE_TEXT_CHARS = 50_000
# The pieces of a longer text: at most this many characters, so at most a few ms of pysbd each.
_PIECE_CHARS = 2_000
_LINE_BREAK = re.compile(r"[\r\n]+")
# Where pysbd nearly always ends a sentence too: . ! or ? after two lowercase letters or digits (not
# "Dr." "St." "U.S." "H. G. Wells"), closing quotes or brackets, spaces, then a capital.
_SENTENCE_END = re.compile(
    r"[a-z0-9]{2}[.!?][\"'\u2019\u201d)\]]*\s+(?=[\"'\u2018\u201c(\[]?[A-Z])")
_SPACE = re.compile(r"\s+")
# A document at least this long is named in the log as its blocks are made, which takes seconds in
# which the corpus build would seem stuck.
_LOG_CHARS = 1_000_000


def _pieces(text: str) -> Iterator[str]:
  """Consecutive pieces of `text` (joined, they are `text`) of at most `_PIECE_CHARS` characters.

  Each is cut in the back half of its window: after its last line break (pysbd ends a sentence at
  every one), else after its last sentence end (`_SENTENCE_END`), else after its last space, else
  (a run of that length without one) at the end of the window.
  """
  lo, half = 0, _PIECE_CHARS // 2
  while len(text) - lo > _PIECE_CHARS:
    window = text[lo:lo + _PIECE_CHARS]
    last_end = lambda pattern: max((m.end() for m in pattern.finditer(window, half)), default=0)
    cut = last_end(_LINE_BREAK) or last_end(_SENTENCE_END) or last_end(_SPACE) or len(window)
    yield window[:cut]
    lo += cut
  yield text[lo:]


def split_sentences(text: str) -> list[str]:
  """Sentences of `text` (whitespace-trimmed, none empty), with a real sentence splitter.

  A text longer than `_WHOLE_TEXT_CHARS` is split piece by piece (`_pieces`), in a time that grows
  with its length, not with its square (a few seconds per million characters); a sentence then
  never spans two pieces, so one longer than `_PIECE_CHARS // 2` may come out in two.
  """
  if len(text) <= _WHOLE_TEXT_CHARS:
    return _checked(text, [s.sent for s in _segmenter().segment(text)])
  return [sentence for piece in _pieces(text) for sentence in _checked(piece, _found(piece))]


def _found(piece: str) -> list[str]:
  """pysbd's sentences of `piece`, each looked for after the one before, as `segment` does; but
  without its regular expression per sentence, which pushes pysbd's own out of `re`'s cache (512
  entries), to be compiled again for each piece: that doubled the time of a long text."""
  out, pos = [], 0
  for sentence in _segmenter().processor(piece).process():
    start = piece.find(sentence, pos)
    if start >= 0:  # else pysbd changed the text: `_checked` sees that some is missing
      out.append(sentence)
      pos = start + len(sentence)
  return out


def _checked(text: str, sentences: list[str]) -> list[str]:
  """pysbd's `sentences` of `text` trimmed, without empty ones; or, when they do not cover every
  non-space character of `text`, a plain punctuation split of `text` (pysbd occasionally loses
  text: it returns nothing for "E\u266d major ... Beethoven.")."""
  out = [s.strip() for s in sentences]
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
  if len(text) >= _LOG_CHARS:
    logging.info("%s: splitting the document %r of %.1f million characters into sentences and "
                 "blocks (a few seconds per million).", where or "A document", title[:80],
                 len(text) / 1e6)
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
