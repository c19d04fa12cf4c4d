"""Documents -> token stream -> chunks: what RETRO's database is made of (no model, no search).

Each document goes to one split, "train" (the database and the training data) or "heldout"
(evaluation), by a stable hash of its title and place (`is_heldout`). A split's stream is

    [eos] d0 [eos] d1 [eos] ... dN [eos] [pad] ... [pad]

with a leading eos so that every document token is a target. It is padded to S whole sequences
of L = seq_chunks * m tokens plus one token, the last target: sequence s reads inputs
stream[s*L : s*L+L] and predicts targets stream[s*L+1 : s*L+L+1]; chunk c is stream[c*m:(c+1)*m].
Beside the stream, `docs` gives each token's document (its index in the split): a document's text
tokens and its trailing eos are its own; the leading eos and the padding belong to none (-1).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable

import numpy as np
from tqdm.auto import tqdm

SPLITS = ("train", "heldout")


def is_heldout(title: str, where: str, heldout_percent: float) -> bool:
  """Whether a document is held out: SHA-256 of `title + "\\0" + where`, first 8 bytes big-endian
  mod 10,000, below round(100 * heldout_percent) (as data/qa.split_by_hash). The same on every
  machine, whatever the other documents."""
  digest = hashlib.sha256(f"{title}\0{where}".encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") % 10_000 < round(100 * heldout_percent)


@dataclasses.dataclass
class SplitStream:
  """One split's token stream.

  Attributes:
    stream: [T] int32 token ids, T = num_sequences * seq_chunks * chunk_length + 1.
    docs: [T] int32 document of each token (-1: the leading eos and the padding).
    documents: per document {title, where, bytes, tokens}: bytes = its UTF-8 text + 1 (the eos
      counts as one byte), tokens = its stream tokens, the eos included.
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


def pad_stream(pieces: list[np.ndarray], doc_pieces: list[np.ndarray], eos_id: int, pad_id: int,
               sequence_length: int) -> tuple[np.ndarray, np.ndarray]:
  """[eos] + the pieces, padded to a whole number of sequences + 1: (stream [T], docs [T])."""
  stream = np.concatenate([np.array([eos_id], np.int32), *pieces]).astype(np.int32)
  docs = np.concatenate([np.array([-1], np.int32), *doc_pieces]).astype(np.int32)
  num_sequences = -(-(len(stream) - 1) // sequence_length)
  total = num_sequences * sequence_length + 1
  stream = np.concatenate([stream, np.full(total - len(stream), pad_id, np.int32)])
  docs = np.concatenate([docs, np.full(total - len(docs), -1, np.int32)])
  return stream, docs


def chunk_documents(documents: Iterable[dict], tokenizer, chunk_length: int, seq_chunks: int,
                    heldout_percent: float, batch_size: int = 512) -> tuple[dict, dict]:
  """Tokenizes `documents` ({title, text, where}, in order) into the streams of both splits.

  Args:
    tokenizer: an `LmTokenizer` (encode_batch, eos_id, pad_id).
  Returns:
    ({split: SplitStream}, stats): stats holds `documents` (read), `skipped` (documents whose text
    has no token), `skipped_examples` (their `where`, at most 5) and `content_sha256` (of every
    document's title, place and text, in order: names the corpus as it was read).
  """
  parts = {s: ([], [], []) for s in SPLITS}  # split -> (token pieces, doc pieces, documents)
  content = hashlib.sha256()
  stats = {"documents": 0, "skipped": 0, "skipped_examples": []}

  def flush(batch):
    for doc, ids in zip(batch, tokenizer.encode_batch([d["text"] for d in batch])):
      if not ids:
        stats["skipped"] += 1
        if len(stats["skipped_examples"]) < 5:
          stats["skipped_examples"].append(doc["where"])
        continue
      pieces, doc_pieces, docs = parts["heldout" if is_heldout(
          doc["title"], doc["where"], heldout_percent) else "train"]
      pieces.append(np.asarray(ids + [tokenizer.eos_id], np.int32))
      doc_pieces.append(np.full(len(ids) + 1, len(docs), np.int32))
      docs.append({"title": doc["title"], "where": doc["where"],
                   "bytes": len(doc["text"].encode("utf-8")) + 1, "tokens": len(ids) + 1})

  batch = []
  for doc in documents:
    stats["documents"] += 1
    for field in ("title", "where", "text"):
      content.update(doc[field].encode("utf-8") + b"\0")
    batch.append(doc)
    if len(batch) == batch_size:
      flush(batch)
      batch = []
  flush(batch)
  stats["content_sha256"] = content.hexdigest()
  out = {}
  for split, (pieces, doc_pieces, docs) in parts.items():
    stream, doc_of = pad_stream(pieces, doc_pieces, tokenizer.eos_id, tokenizer.pad_id,
                                chunk_length * seq_chunks)
    out[split] = SplitStream(stream, doc_of, docs, chunk_length, seq_chunks)
  return out, stats


def excluded_chunk_ranges(docs: np.ndarray, chunk_length: int, seq_chunks: int) -> np.ndarray:
  """For each chunk, the range of chunks its query may not retrieve: [N, 2] int64 (lo, hi),
  inclusive, or (-1, -1) for none.

  Chunk c of sequence s = c // seq_chunks excludes every chunk that holds a token of a document
  the sequence reads or predicts (stream[s*L : s*L+L+1]): as documents follow one another in the
  stream, those chunks are one contiguous range, from the first chunk of the sequence's first
  document to the last chunk of its last one.

  Args:
    docs: [T] int32 document of each stream token (T = S * L + 1), `SplitStream.docs`.
  """
  length = chunk_length * seq_chunks
  num_sequences = (len(docs) - 1) // length
  num_chunks = num_sequences * seq_chunks
  window = np.concatenate([docs[:num_sequences * length].reshape(num_sequences, length),
                           docs[length::length][:num_sequences, None]], axis=1)  # [S, L + 1]
  valid = window >= 0
  first_doc = np.where(valid, window, np.iinfo(np.int32).max).min(1, initial=np.iinfo(np.int32).max)
  last_doc = window.max(1, initial=-1)
  # Tokens of document d: positions [start[d], end[d]] (documents are contiguous and in order).
  positions = np.flatnonzero(docs >= 0)
  ordered = docs[positions]
  has = valid.any(1)
  lo = positions[np.searchsorted(ordered, first_doc[has], "left")] // chunk_length
  hi = positions[np.searchsorted(ordered, last_doc[has], "right") - 1] // chunk_length
  ranges = np.full((num_sequences, 2), -1, np.int64)
  ranges[has, 0], ranges[has, 1] = lo, np.minimum(hi, num_chunks - 1)
  return np.repeat(ranges, seq_chunks, axis=0)


def chunk_values(stream: np.ndarray, chunk_ids: np.ndarray, chunk_length: int, num_chunks: int,
                 pad_id: int) -> np.ndarray:
  """What a retrieved chunk gives the model: its m tokens and its continuation's (the next chunk of
  the stream; pad after the last chunk), [..., 2m] int32 for `chunk_ids` [...] (-1: all pad)."""
  ids = np.asarray(chunk_ids, np.int64)
  positions = ids[..., None] * chunk_length + np.arange(2 * chunk_length)  # [..., 2m]
  valid = (ids[..., None] >= 0) & (positions < num_chunks * chunk_length)
  tokens = np.asarray(stream)[np.where(valid, positions, 0)]
  return np.where(valid, tokens, pad_id).astype(np.int32)


def record_layout(chunk_length: int, seq_chunks: int, num_neighbours: int) -> dict:
  """How a sequence's record holds its arrays: little-endian int32 fields, one after another
  (L = seq_chunks * m, n = seq_chunks, k = num_neighbours): inputs, targets, target_docs [L];
  neighbours [n, k, 2m] (each neighbour chunk and its continuation); neighbour_ids [n, k]."""
  m, n, k = chunk_length, seq_chunks, num_neighbours
  return {"dtype": "<i4", "fields": [
      ["inputs", [n * m]], ["targets", [n * m]], ["target_docs", [n * m]],
      ["neighbours", [n, k, 2 * m]], ["neighbour_ids", [n, k]]]}


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


def write_sequences(path: str, *, stream, docs, neighbours, train_stream, num_train: int,
                    chunk_length: int, seq_chunks: int, pad_id: int) -> None:
  """Writes one record per sequence of a split (`record_layout`) to the array_record file `path`.

  Args:
    stream, docs: [T] the split's tokens and their documents.
    neighbours: [N, k] train chunk ids of each of the split's chunks.
    train_stream, num_train: the train split's tokens and number of chunks (for the values).
  """
  from array_record.python.array_record_module import ArrayRecordWriter
  m, n = chunk_length, seq_chunks
  length = n * m
  writer = ArrayRecordWriter(path, "group_size:1")
  try:
    for s in tqdm(range((len(stream) - 1) // length), desc="writing sequences", unit="sequence"):
      lo = s * length
      ids = np.asarray(neighbours[s * n:(s + 1) * n])                        # [n, k]
      writer.write(encode_record([
          stream[lo:lo + length], stream[lo + 1:lo + length + 1], docs[lo + 1:lo + length + 1],
          chunk_values(train_stream, ids, m, num_train, pad_id), ids]))
  finally:
    writer.close()
