"""Documents -> pieces -> packed sequences -> chunks: what RETRO's database is made of (no model,
no search).

Each document goes to one split, "train" (the database and the training data) or "heldout"
(evaluation), by a stable hash of its title (`is_heldout`): every passage of one title is on the
same side. A train document that nearly copies a held-out one (`NearDuplicates`: Jaccard
similarity >= 0.8 of their word 13-grams, the RETRO paper's rule) is dropped.

A document of token ids d becomes a piece `[eos] d`, padded with pad to a multiple of m (the chunk
length): the leading eos is its beginning of text (GPT-2 and SmolLM2 put <|endoftext|> between
documents), and every chunk belongs to one document. Pieces are packed, in order, into sequences
of L = seq_chunks * m tokens: a piece that does not fit in what is left of the current sequence
starts the next one (the rest is pad), unless it is longer than L: then it starts at the next chunk
and runs over as many sequences as it needs. A document that fits in a sequence is so read whole,
from its eos, in one sequence. The split's stream is its S sequences end to end and one pad token,
the last target: sequence s reads inputs stream[s*L : s*L+L] and predicts targets
stream[s*L+1 : s*L+L+1]; chunk c is stream[c*m : (c+1)*m].

Beside the stream, `docs` [T] is each token's document as an input (its index in the split: the
leading eos and the text tokens of document d -> d; pad -> -1), and `text_docs(docs)` the same for
the text tokens only (-1 for the eos and the padding): the targets scored, each text token of each
document once.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterable

import numpy as np
from tqdm.auto import tqdm

SPLITS = ("train", "heldout")
NGRAM = 13       # words per gram of the near-duplicate test
JACCARD = 0.8    # a train document this similar to a held-out one is dropped


def is_heldout(key: str, heldout_percent: float) -> bool:
  """Whether a document is held out: SHA-256 of `key` (its title; an untitled document's place),
  first 8 bytes big-endian mod 10,000, below round(100 * heldout_percent) (as
  data/qa.split_by_hash). The same on every machine, whatever the other documents."""
  digest = hashlib.sha256(key.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") % 10_000 < round(100 * heldout_percent)


def split_key(doc: dict) -> str:
  """What `is_heldout` hashes: the title, so that the passages of one title (JSONL lines of one
  article) land on one side; an untitled document is a group of its own (its `where`)."""
  return doc["title"] or f"\0{doc['where']}"


# Odd 64-bit multipliers of the gram hash, one per word position and one for the gram's length.
_GRAM_MULTIPLIERS = np.array(
    [int.from_bytes(hashlib.sha256(f"retro gram {j}".encode()).digest()[:8], "big") | 1
     for j in range(NGRAM + 1)], np.uint64)


def _grams(ids: np.ndarray) -> np.ndarray:
  """[G, n] the word-id grams of a document: its NGRAM-word windows, or (fewer words) the whole
  sequence as one gram; [0, 0] for no word."""
  if len(ids) < NGRAM:
    return ids[None] if len(ids) else np.zeros((0, 0), ids.dtype)
  return np.lib.stride_tricks.sliding_window_view(ids, NGRAM)


def _gram_hashes(ids: np.ndarray) -> np.ndarray:
  """The sorted distinct 64-bit hashes [G'] of a document's grams (word ids [W] int64): a linear
  hash with odd multipliers, wrapping mod 2^64; grams of different lengths never share a hash."""
  grams = _grams(ids).astype(np.uint64)                                    # [G, n] (wraps < 0)
  if not grams.size:
    return np.zeros(0, np.uint64)
  width = grams.shape[1]
  hashes = (grams * _GRAM_MULTIPLIERS[:width]).sum(1, dtype=np.uint64)
  return np.unique(hashes + _GRAM_MULTIPLIERS[NGRAM:] * np.uint64(width))


def _gram_set(ids: np.ndarray) -> set:
  return set(map(tuple, _grams(ids).tolist()))


class NearDuplicates:
  """Finds the held-out document a train document nearly copies: Jaccard similarity >= 0.8 of the
  two documents' sets of word 13-grams (words: the text lowercased, split on whitespace; a document
  of fewer than 13 words has one gram, its whole word sequence), the RETRO paper's rule.

  The held-out documents are `add`ed first. `match` looks a train document's grams up in an
  inverted index (gram hash -> held-out documents holding it), keeps the held-out documents with
  which it shares enough hashes to reach the threshold, and computes their exact Jaccard
  similarity from the words themselves. Equal grams have equal hashes, so no near-duplicate is
  missed (but for two grams of one document with one hash, ~W^2 / 2^64 for W words).
  Memory: the held-out documents' word ids and gram hashes, ~16 bytes per held-out word.
  """

  def __init__(self, threshold: float = JACCARD):
    self.threshold = threshold
    self._vocab: dict[str, int] = {}    # the held-out documents' words -> ids >= 0
    self._words: list[np.ndarray] = []  # per held-out document: its word ids [W] int32
    self._pending: list[np.ndarray] = []  # gram hashes of documents added since the index
    # The inverted index: gram hashes [H] uint64, sorted, and the held-out document of each [H];
    # and each document's number of distinct gram hashes [D].
    self._keys, self._owners = np.zeros(0, np.uint64), np.zeros(0, np.int32)
    self._sizes = np.zeros(0, np.int64)

  def __len__(self) -> int:
    return len(self._words)

  def add(self, text: str) -> None:
    """Adds a held-out document (numbered in the order added)."""
    vocab = self._vocab
    ids = np.array([vocab.setdefault(w, len(vocab)) for w in text.lower().split()], np.int64)
    self._words.append(ids.astype(np.int32))
    self._pending.append(_gram_hashes(ids))

  def _index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if self._pending:
      first = len(self._words) - len(self._pending)
      owners = np.repeat(np.arange(first, len(self._words), dtype=np.int32),
                         [len(h) for h in self._pending])
      keys = np.concatenate([self._keys, *self._pending])
      order = np.argsort(keys, kind="stable")
      self._keys, self._owners = keys[order], np.concatenate([self._owners, owners])[order]
      self._sizes = np.concatenate([self._sizes, [len(h) for h in self._pending]]).astype(np.int64)
      self._pending = []
    return self._keys, self._owners, self._sizes

  def match(self, text: str) -> tuple[int, float] | None:
    """(held-out document, Jaccard similarity) of the held-out document most similar to `text`,
    when that is >= the threshold; else None."""
    if not self._words:
      return None
    keys, owners, sizes = self._index()
    words = text.lower().split()
    ids = list(map(self._vocab.get, words))
    if None in ids:  # words of no held-out document: ids < 0, one per distinct word
      unknown: dict[str, int] = {}
      ids = [-1 - unknown.setdefault(w, len(unknown)) if i is None else i
             for i, w in zip(ids, words)]
    ids = np.array(ids, np.int64)
    mine = _gram_hashes(ids)
    lo = np.searchsorted(keys, mine)
    hit = keys[np.minimum(lo, len(keys) - 1)] == mine if len(keys) else np.zeros(len(mine), bool)
    if not hit.any():
      return None
    lo = lo[hit]
    counts = np.searchsorted(keys, mine[hit], "right") - lo
    found = owners[np.repeat(lo - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())]
    docs, shared = np.unique(found, return_counts=True)
    # J = s / (a + b - s) >= t  <=>  s (1 + t) >= t (a + b); shared hashes >= shared grams.
    t = self.threshold
    docs = docs[shared * (1 + t) >= t * (len(mine) + sizes[docs]) - 1e-9]
    best, a = None, _gram_set(ids) if len(docs) else None
    for d in docs:
      b = _gram_set(self._words[d].astype(np.int64))
      jaccard = len(a & b) / len(a | b)
      if jaccard >= t and (best is None or jaccard > best[1]):
        best = (int(d), jaccard)
    return best


@dataclasses.dataclass
class SplitStream:
  """One split's token stream.

  Attributes:
    stream: [T] int32 token ids, T = num_sequences * seq_chunks * chunk_length + 1.
    docs: [T] int32 document of each token as an input (-1: padding).
    documents: per document {title, where, bytes, tokens}: bytes = len(text.encode("utf-8")) (the
      original text), tokens = its text tokens (the targets scored; not its eos).
  """
  stream: np.ndarray
  docs: np.ndarray
  documents: list[dict]
  chunk_length: int
  seq_chunks: int

  @property
  def num_sequences(self) -> int:
    return (len(self.stream) - 1) // (self.chunk_length * self.seq_chunks)

  @property
  def num_chunks(self) -> int:
    return self.num_sequences * self.seq_chunks

  def chunks(self) -> np.ndarray:
    """[N, m] the chunks' tokens (a view of the stream)."""
    return self.stream[:self.num_chunks * self.chunk_length].reshape(-1, self.chunk_length)


def pack_pieces(pieces: list[np.ndarray], chunk_length: int, seq_chunks: int,
                pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Packs the pieces (each `[eos] + ids`) into a stream as the module docstring says:
  (stream [T] int32, docs [T] int32: piece i's tokens -> i, padding -> -1), T = S * L + 1."""
  m, length = chunk_length, chunk_length * seq_chunks
  starts, at = [], 0
  for piece in pieces:
    size = -(-len(piece) // m) * m
    left = -at % length              # what is left of the current sequence (0: at its start)
    if left and left < size <= length:
      at += left                     # it would not fit: it starts the next sequence
    starts.append(at)
    at += size
  total = -(-at // length) * length + 1
  stream, docs = np.full(total, pad_id, np.int32), np.full(total, -1, np.int32)
  for i, (start, piece) in enumerate(zip(starts, pieces)):
    stream[start:start + len(piece)], docs[start:start + len(piece)] = piece, i
  return stream, docs


def text_docs(docs: np.ndarray) -> np.ndarray:
  """[T] int32: the document of each text token, -1 for a document's leading eos and for padding
  (`docs` [T], or a window of it: its first token is then -1). A text token is the one after
  another token of its document: each piece is contiguous and starts with its eos."""
  docs = np.asarray(docs)
  out = np.full(len(docs), -1, np.int32)
  out[1:] = np.where((docs[1:] == docs[:-1]) & (docs[1:] >= 0), docs[1:], -1)
  return out


def chunk_documents(read_documents: Callable[[], Iterable[dict]], tokenizer, chunk_length: int,
                    seq_chunks: int, heldout_percent: float, batch_size: int = 512,
                    total: int | None = None) -> tuple[dict, dict]:
  """Tokenizes the documents ({title, text, where}, in order) into the streams of both splits.

  Args:
    read_documents: returns an iterable of the documents, afresh on each call: read twice when
      documents are held out (first the held-out ones, to drop the train documents copying one).
    tokenizer: an `LmTokenizer` (encode_batch, eos_id, pad_id).
    total: the number of documents, if known (progress bars).
  Returns:
    ({split: SplitStream}, stats): stats holds `documents` (read), `skipped` (documents whose text
    has no token), `skipped_examples` (their `where`, at most 5), `near_duplicates` (train documents
    dropped as near-copies of a held-out one), `near_duplicate_examples` (at most 5 {train,
    heldout, jaccard}) and `content_sha256` (of every document's title, place and text, in order:
    names the corpus as it was read).
  """
  near = NearDuplicates()
  if heldout_percent > 0:
    for doc in tqdm(read_documents(), total=total, desc="held-out documents", unit="doc"):
      if is_heldout(split_key(doc), heldout_percent):
        near.add(doc["text"])
  heldout_where = []  # of each document `near` holds, in its order
  parts = {s: ([], []) for s in SPLITS}  # split -> (pieces, documents)
  content = hashlib.sha256()
  stats = {"documents": 0, "skipped": 0, "skipped_examples": [], "near_duplicates": 0,
           "near_duplicate_examples": []}

  def flush(batch):
    for (doc, split), ids in zip(batch, tokenizer.encode_batch([d["text"] for d, _ in batch])):
      if not ids:
        stats["skipped"] += 1
        if len(stats["skipped_examples"]) < 5:
          stats["skipped_examples"].append(doc["where"])
        continue
      pieces, docs = parts[split]
      pieces.append(np.asarray([tokenizer.eos_id, *ids], np.int32))
      docs.append({"title": doc["title"], "where": doc["where"],
                   "bytes": len(doc["text"].encode("utf-8")), "tokens": len(ids)})

  batch = []
  for doc in tqdm(read_documents(), total=total, desc="tokenizing documents", unit="doc"):
    stats["documents"] += 1
    for field in ("title", "where", "text"):
      content.update(doc[field].encode("utf-8") + b"\0")
    heldout = is_heldout(split_key(doc), heldout_percent)
    if heldout:
      heldout_where.append(doc["where"])
    elif (found := near.match(doc["text"])) is not None:
      stats["near_duplicates"] += 1
      if len(stats["near_duplicate_examples"]) < 5:
        stats["near_duplicate_examples"].append(
            {"train": doc["where"], "heldout": found[0], "jaccard": round(found[1], 4)})
      continue
    batch.append((doc, "heldout" if heldout else "train"))
    if len(batch) == batch_size:
      flush(batch)
      batch = []
  flush(batch)
  if len(heldout_where) != len(near):
    raise ValueError(f"The documents were read twice and differed: {len(near)} held-out ones the "
                     f"first time, {len(heldout_where)} the second. The corpus must not change "
                     "while the database is built: build it again.")
  for example in stats["near_duplicate_examples"]:
    example["heldout"] = heldout_where[example["heldout"]]
  stats["content_sha256"] = content.hexdigest()
  out = {}
  for split, (pieces, docs) in parts.items():
    stream, doc_of = pack_pieces(pieces, chunk_length, seq_chunks, tokenizer.pad_id)
    out[split] = SplitStream(stream, doc_of, docs, chunk_length, seq_chunks)
  return out, stats


def excluded_chunk_ranges(docs: np.ndarray, chunk_length: int, seq_chunks: int) -> np.ndarray:
  """For each chunk, the range of chunks its query may not retrieve: [N, 2] int64 (lo, hi),
  inclusive, or (-1, -1) for none.

  Chunk c of sequence s = c // seq_chunks excludes every chunk of a document the sequence reads or
  predicts. Those are the documents of its inputs (a text token it predicts continues a document
  it reads; the eos it may predict last begins a document it does not read), which follow one
  another in the stream: their chunks (and padding chunks between them) are one contiguous range,
  from the first chunk of the sequence's first document to the last chunk of its last one, in
  other sequences too when a document is longer than a sequence.

  Args:
    docs: [T] int32 document of each stream token (T = S * L + 1), `SplitStream.docs`.
  """
  length = chunk_length * seq_chunks
  num_sequences = (len(docs) - 1) // length
  num_chunks = num_sequences * seq_chunks
  window = np.asarray(docs[:num_sequences * length]).reshape(num_sequences, length)  # [S, L]
  valid = window >= 0
  big = np.iinfo(np.int32).max
  first_doc = np.where(valid, window, big).min(1, initial=big)
  last_doc = window.max(1, initial=-1)
  # Tokens of document d: positions [start[d], end[d]] (documents are contiguous and in order).
  positions = np.flatnonzero(np.asarray(docs) >= 0)
  ordered = np.asarray(docs)[positions]
  has = valid.any(1)
  lo = positions[np.searchsorted(ordered, first_doc[has], "left")] // chunk_length
  hi = positions[np.searchsorted(ordered, last_doc[has], "right") - 1] // chunk_length
  ranges = np.full((num_sequences, 2), -1, np.int64)
  ranges[has, 0], ranges[has, 1] = lo, np.minimum(hi, num_chunks - 1)
  return np.repeat(ranges, seq_chunks, axis=0)


def reading_sequences(num_sequences: int, share: float) -> np.ndarray:
  """[S] bool: the training sequences whose chunks may also retrieve the other chunks of their own
  documents (`config.db.own_document_share`): a fixed draw of `share` of them (seed 0), the same
  in every build."""
  return np.random.default_rng(0).random(num_sequences) < share


def train_exclusions(docs: np.ndarray, chunk_length: int, seq_chunks: int,
                     own_document_share: float = 0.0) -> np.ndarray:
  """What each training chunk may not retrieve, [N, 2] (lo, hi) inclusive: its sequence's
  documents (`excluded_chunk_ranges`, the paper's rule), except in the `reading_sequences`,
  whose chunks give up only themselves and may read the rest of their document, the text they
  are about to predict included. That teaches the chunked cross-attention to read what a
  neighbour says (a neighbour from other documents rarely holds the next tokens); evaluation
  never retrieves held-out text."""
  ranges = excluded_chunk_ranges(docs, chunk_length, seq_chunks)
  if own_document_share > 0:
    reading = np.repeat(reading_sequences(len(ranges) // seq_chunks, own_document_share),
                        seq_chunks)
    ids = np.flatnonzero(reading)
    ranges[ids, 0] = ranges[ids, 1] = ids
  return ranges


def chunk_values(stream: np.ndarray, docs: np.ndarray, chunk_ids: np.ndarray, chunk_length: int,
                 num_chunks: int, pad_id: int) -> np.ndarray:
  """What a retrieved chunk gives the model: its m tokens and its continuation's, [..., 2m] int32
  for `chunk_ids` [...] (-1: all pad). The continuation is the next chunk of the stream when it
  belongs to the same document, else all pad: a neighbour never runs into another document.

  Args:
    stream, docs: [T] the split's tokens and their documents (`SplitStream`).
    num_chunks: the split's chunks (ids are below it).
  """
  m = chunk_length
  stream, docs = np.asarray(stream), np.asarray(docs)
  ids = np.asarray(chunk_ids, np.int64)
  valid = ids >= 0
  own = np.where(valid, ids, 0)
  nxt = np.minimum(own + 1, max(num_chunks - 1, 0))
  # Every chunk belongs to one document (-1: padding only): the one of its first token.
  follows = valid & (own + 1 < num_chunks) & (docs[nxt * m] == docs[own * m]) & (docs[own * m] >= 0)
  span = np.arange(m)
  tokens = stream[np.where(valid[..., None], own[..., None] * m + span, 0)]        # [..., m]
  after = stream[np.where(follows[..., None], nxt[..., None] * m + span, 0)]       # [..., m]
  return np.concatenate([np.where(valid[..., None], tokens, pad_id),
                         np.where(follows[..., None], after, pad_id)], axis=-1).astype(np.int32)


def record_layout(chunk_length: int, seq_chunks: int, num_neighbours: int) -> dict:
  """How a sequence's record holds its arrays: little-endian int32 fields, one after another
  (L = seq_chunks * m, n = seq_chunks, k = num_neighbours): inputs, targets [L]; input_docs [L]
  (the inputs' documents, -1 for padding: segment ids that keep attention inside a document);
  target_docs [L] (the target's document when it is a text token, the targets scored; else -1);
  neighbours [n, k, 2m] (each neighbour chunk and its continuation); neighbour_ids [n, k]."""
  m, n, k = chunk_length, seq_chunks, num_neighbours
  return {"dtype": "<i4", "fields": [
      ["inputs", [n * m]], ["targets", [n * m]], ["input_docs", [n * m]],
      ["target_docs", [n * m]], ["neighbours", [n, k, 2 * m]], ["neighbour_ids", [n, k]]]}


def encode_record(fields) -> bytes:
  """The record of a sequence's arrays, in the order of `record_layout`."""
  return np.concatenate([np.asarray(f).astype("<i4").ravel() for f in fields]).tobytes()


def decode_record(record: bytes, layout: dict) -> dict[str, np.ndarray]:
  """The int32 arrays of one sequence's record, by its `record_layout`."""
  flat, out, at = np.frombuffer(record, "<i4"), {}, 0
  for name, shape in layout["fields"]:
    size = int(np.prod(shape))
    out[name] = flat[at:at + size].reshape(shape).astype(np.int32)
    at += size
  if at != len(flat):
    raise ValueError(f"A record of {len(flat)} int32 values does not match the layout {layout}.")
  return out


def write_sequences(path: str, *, stream, docs, neighbours, train_stream, train_docs,
                    num_train: int, chunk_length: int, seq_chunks: int, pad_id: int) -> None:
  """Writes one record per sequence of a split (`record_layout`) to the array_record file `path`.

  Args:
    stream, docs: [T] the split's tokens and their documents.
    neighbours: [N, k] train chunk ids of each of the split's chunks.
    train_stream, train_docs, num_train: the train split's tokens, documents and number of chunks
      (for the values).
  """
  from array_record.python.array_record_module import ArrayRecordWriter
  m, n = chunk_length, seq_chunks
  length = n * m
  writer = ArrayRecordWriter(path, "group_size:1")
  try:
    for s in tqdm(range((len(stream) - 1) // length), desc="writing sequences", unit="sequence"):
      lo = s * length
      window = np.asarray(docs[lo:lo + length + 1])                           # [L + 1]
      ids = np.asarray(neighbours[s * n:(s + 1) * n])                        # [n, k]
      writer.write(encode_record([
          stream[lo:lo + length], stream[lo + 1:lo + length + 1], window[:-1],
          text_docs(window)[1:],
          chunk_values(train_stream, train_docs, ids, m, num_train, pad_id), ids]))
  finally:
    writer.close()
