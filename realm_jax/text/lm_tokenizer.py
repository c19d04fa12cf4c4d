"""The decoder's tokenizer (RETRO): a BERT WordPiece vocab or a Hugging Face tokenizer.json.

    tok = load_lm_tokenizer("", bert_vocab="…/vocab.txt")     # WordPiece, eos = [SEP]
    tok = load_lm_tokenizer("gpt2/tokenizer.json", "")         # eos = <|endoftext|>
    tok.encode_batch(["Paris is ..."])   # [[ids]], no special tokens
    tok.name                             # "wordpiece:<16 hex>": names the vocab in databases

`name` is the kind and the SHA-256 of the file's bytes: a database or a model made with one
tokenizer refuses another (`RetroDb.check_compatible`). `key_inputs` turns chunks of these tokens
into the inputs of the BERT that keys the chunk database.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from realm_jax.io_utils import as_path
from realm_jax.text.tokenizer import BertTokenizer, checkpoint_normalization

# What ends a document in a tokenizer.json, first match wins.
EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")
PAD_TOKENS = ("<pad>", "[PAD]")


def _sha16(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()[:16]


def wordpiece_name(vocab_file: str) -> str:
  """The `LmTokenizer.name` of a BERT WordPiece vocab: its bytes, and its case handling when not
  the default (uncased)."""
  data = as_path(vocab_file).read_bytes()
  lowercase, strip_accents = checkpoint_normalization(vocab_file)
  if not lowercase or (strip_accents is not None and strip_accents != lowercase):
    data += f"|lowercase={lowercase}|strip_accents={strip_accents}".encode()
  return f"wordpiece:{_sha16(data)}"


class LmTokenizer:
  """Text <-> token ids of the decoder.

  Attributes:
    name: "wordpiece:<sha>" or "tokenizer.json:<sha>" (16 hex digits of the file's SHA-256).
    vocab_size: ids are in [0, vocab_size).
    eos_id: ends every document in the token stream; sampling stops at it.
    pad_id: fills the stream's last sequence; never a target (its document is -1).
    bert_vocab: the vocab.txt when this is a BERT WordPiece tokenizer, else None.
  """

  def __init__(self, name: str, vocab_size: int, eos_id: int, pad_id: int, *,
               bert: BertTokenizer | None = None, hf=None):
    self.name, self.vocab_size = name, int(vocab_size)
    self.eos_id, self.pad_id = int(eos_id), int(pad_id)
    self._bert, self._hf = bert, hf
    self.bert_vocab = bert.vocab_file if bert is not None else None

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens."""
    if self._bert is not None:
      return self._bert.encode_batch(texts)
    for i, t in enumerate(texts):
      if not isinstance(t, str):
        raise TypeError(f"text #{i} must be a str, got {type(t).__name__}.")
    return [e.ids for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Sequence[int]) -> str:
    """The text of `ids`; special tokens (eos, pad) are left out."""
    ids = [int(i) for i in ids]
    if self._bert is not None:
      return self._bert.decode(ids)
    return self._hf.decode(ids, skip_special_tokens=True)

  def __repr__(self) -> str:
    return (f"LmTokenizer({self.name}, vocab_size={self.vocab_size}, eos_id={self.eos_id}, "
            f"pad_id={self.pad_id})")


def load_lm_tokenizer(tokenizer_file: str, bert_vocab: str,
                      flag: str = "--config.db.tokenizer_file") -> LmTokenizer:
  """The decoder's tokenizer.

  Args:
    tokenizer_file: "" for BERT WordPiece over `bert_vocab` (eos = [SEP], pad = [PAD]); else a
      Hugging Face tokenizer.json, local or gs:// (eos = the first of EOS_TOKENS in its vocab, pad
      = its <pad> or [PAD], else eos).
    bert_vocab: the key weights' vocab.txt, used when `tokenizer_file` is "".
    flag: the user's flag that gave `tokenizer_file`, named by errors.

  Raises:
    ValueError naming `flag` and the file when it is missing, unreadable, or has no eos token.
  """
  if not tokenizer_file:
    try:
      bert = BertTokenizer(bert_vocab)
    except (OSError, ValueError) as e:
      raise ValueError(f"{flag}='' tokenizes with the key weights' WordPiece vocab {bert_vocab!r}, "
                       f"which cannot be used: {e}") from None
    return LmTokenizer(wordpiece_name(bert_vocab), bert.vocab_size, bert.sep_id, bert.pad_id,
                       bert=bert)
  from tokenizers import Tokenizer
  path = as_path(tokenizer_file)
  try:
    data = path.read_bytes()
  except OSError as e:
    raise ValueError(f"{flag}={tokenizer_file}: the file cannot be read ({e.strerror or e}). Give "
                     "a Hugging Face tokenizer.json, or '' for the key weights' vocab.") from None
  try:
    hf = Tokenizer.from_str(data.decode("utf-8"))
  except Exception as e:  # the Rust library raises a bare Exception
    raise ValueError(f"{flag}={tokenizer_file}: not a Hugging Face tokenizer.json ({e}). Give the "
                     "tokenizer.json of a tokenizer, or '' for the key weights' vocab.") from None
  vocab = hf.get_vocab(with_added_tokens=True)
  eos = next((t for t in EOS_TOKENS if t in vocab), None)
  if eos is None:
    raise ValueError(f"{flag}={tokenizer_file}: its vocab has none of the end-of-text tokens "
                     f"{EOS_TOKENS}, which separate documents. Add one, or use another tokenizer.")
  pad = next((t for t in PAD_TOKENS if t in vocab), eos)
  name = f"tokenizer.json:{_sha16(data)}"
  return LmTokenizer(name, hf.get_vocab_size(with_added_tokens=True), vocab[eos], vocab[pad], hf=hf)


def shares_vocab(lm_tokenizer: LmTokenizer, key_tokenizer: BertTokenizer) -> bool:
  """Whether the decoder's tokens are the key tower's word pieces (no decoding needed)."""
  return (lm_tokenizer.bert_vocab is not None
          and lm_tokenizer.name == wordpiece_name(key_tokenizer.vocab_file))


def key_inputs(chunks: np.ndarray, lm_tokenizer: LmTokenizer, key_tokenizer: BertTokenizer,
               key_length: int, same_vocab: bool) -> dict[str, np.ndarray]:
  """The key tower's inputs for chunks [R, m]: `[CLS] text [SEP]` cut to key_length, as
  input_ids, attention_mask, token_type_ids [R, key_length] int32. The text is the chunk's tokens
  without eos and pad: as they are when `same_vocab`, else decoded and tokenized again."""
  chunks = np.asarray(chunks)
  keep = (chunks != lm_tokenizer.pad_id) & (chunks != lm_tokenizer.eos_id)
  if same_vocab:
    pieces = [row[k].tolist() for row, k in zip(chunks, keep)]
  else:
    texts = [lm_tokenizer.decode(row[k]) for row, k in zip(chunks, keep)]
    pieces = key_tokenizer.encode_batch(texts)
  out = {"input_ids": np.full((len(chunks), key_length), key_tokenizer.pad_id, np.int32),
         "attention_mask": np.zeros((len(chunks), key_length), np.int32),
         "token_type_ids": np.zeros((len(chunks), key_length), np.int32)}
  for i, p in enumerate(pieces):
    ids = [key_tokenizer.cls_id, *p[:key_length - 2], key_tokenizer.sep_id]
    out["input_ids"][i, :len(ids)], out["attention_mask"][i, :len(ids)] = ids, 1
  return out
