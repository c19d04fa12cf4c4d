"""The [N, D] rows of an index on the host, read and written a slice at a time.

A paper-scale index (REALM's 13.35M blocks x 128) is 6.8 GB in float32: holding it twice (a file's
copy and the device's, or the device's and a save buffer) does not fit a 16-24 GB machine beside
a model. `HostRows` is a matrix that is read in slices: from memory (`ArrayRows`), from a region
of a local file with plain reads (`FileRows`: no memory map, so rows read once do not stay in the
process's memory), or from several of them one after another (`ConcatRows`: the embedding shards
of a corpus). `ExactSearcher` fills each device's shard from one a chunk at a time, and
`write_safetensors` writes arrays given as chunks, so building, saving and loading an index each
hold it once.

`safetensors_rows` and `write_safetensors` read and write the safetensors format
(https://huggingface.co/docs/safetensors: an 8-byte little-endian header length, a JSON header of
dtypes, shapes and byte offsets, then the raw little-endian tensors in C order); files written here
are read by `safetensors.safe_open`, and files it writes are read here.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from ml_dtypes import bfloat16

CHUNK_BYTES = 64 << 20  # a slice read or written at a time

_SAFETENSORS_DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(bfloat16),
                       "F16": np.dtype(np.float16), "F64": np.dtype(np.float64),
                       "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
                       "U8": np.dtype(np.uint8)}
_DTYPE_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


class HostRows:
  """An [N, D] matrix read in row slices: `shape`, `dtype`, `read(lo, hi)`."""

  shape: tuple[int, int]
  dtype: np.dtype

  def __len__(self) -> int:
    return self.shape[0]

  @property
  def nbytes(self) -> int:
    return self.shape[0] * self.shape[1] * self.dtype.itemsize

  def read(self, lo: int, hi: int) -> np.ndarray:
    """Rows [lo, hi) as a [hi - lo, D] array of `dtype` (a view or a new array: do not write)."""
    raise NotImplementedError

  def chunk_rows(self, chunk_bytes: int | None = None) -> int:
    """Rows in a slice of about `chunk_bytes` (default `CHUNK_BYTES`)."""
    row_bytes = max(1, self.shape[1] * self.dtype.itemsize)
    return max(1, (chunk_bytes or CHUNK_BYTES) // row_bytes)

  def chunks(self, lo: int = 0, hi: int | None = None,
             chunk_bytes: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """(start, rows) of consecutive slices of about `chunk_bytes` (default `CHUNK_BYTES`)
    covering rows [lo, hi)."""
    hi = len(self) if hi is None else hi
    step = self.chunk_rows(chunk_bytes)
    for start in range(lo, hi, step):
      yield start, self.read(start, min(start + step, hi))

  def _check(self, lo: int, hi: int) -> None:
    if not 0 <= lo <= hi <= len(self):
      raise IndexError(f"rows [{lo}, {hi}) are outside [0, {len(self)}).")


class ArrayRows(HostRows):
  """Rows of an array already in memory (slices are views)."""

  def __init__(self, array: np.ndarray):
    array = np.asarray(array)
    if array.ndim != 2:
      raise ValueError(f"rows must be [N, D]; got shape {array.shape}.")
    self.array, self.shape, self.dtype = array, array.shape, array.dtype

  def read(self, lo: int, hi: int) -> np.ndarray:
    self._check(lo, hi)
    return self.array[lo:hi]


class FileRows(HostRows):
  """Rows stored in C order from byte `offset` of the local file `path` (little-endian)."""

  def __init__(self, path: str, offset: int, shape: tuple[int, int], dtype):
    self.path, self.offset = os.fspath(path), int(offset)
    self.shape, self.dtype = (int(shape[0]), int(shape[1])), np.dtype(dtype)

  def read(self, lo: int, hi: int) -> np.ndarray:
    self._check(lo, hi)
    out = np.empty((hi - lo, self.shape[1]), self.dtype)
    view = memoryview(out.reshape(-1).view(np.uint8))
    with open(self.path, "rb") as f:
      f.seek(self.offset + lo * self.shape[1] * self.dtype.itemsize)
      done = 0
      while done < len(view):
        got = f.readinto(view[done:])
        if not got:
          raise ValueError(f"{self.path} ends before row {hi} of its [{self.shape[0]}, "
                           f"{self.shape[1]}] {self.dtype.name} rows: the file is truncated.")
        done += got
    return out


class ConcatRows(HostRows):
  """Several `HostRows` of the same width and dtype, one after another (a slice may span two)."""

  def __init__(self, parts: Sequence[HostRows]):
    if not parts:
      raise ValueError("ConcatRows needs at least one part.")
    dims, dtypes = {p.shape[1] for p in parts}, {p.dtype for p in parts}
    if len(dims) != 1 or len(dtypes) != 1:
      raise ValueError(f"parts of different widths or dtypes: {sorted(dims)}, "
                       f"{sorted(d.name for d in dtypes)}.")
    self.parts = list(parts)
    self.starts = np.cumsum([0] + [len(p) for p in parts])  # [P + 1]
    self.shape, self.dtype = (int(self.starts[-1]), dims.pop()), dtypes.pop()

  def read(self, lo: int, hi: int) -> np.ndarray:
    self._check(lo, hi)
    first = int(np.searchsorted(self.starts, lo, side="right")) - 1
    pieces, at, p = [], lo, first
    while at < hi:
      start = int(self.starts[p])
      stop = min(hi, int(self.starts[p + 1]))
      if stop > at:
        pieces.append(self.parts[p].read(at - start, stop - start))
      at, p = max(at, stop), p + 1
    if len(pieces) == 1:
      return pieces[0]
    return np.concatenate(pieces) if pieces else np.empty((0, self.shape[1]), self.dtype)


def as_rows(rows) -> HostRows:
  """`rows` as `HostRows` (an array is wrapped without a copy)."""
  return rows if isinstance(rows, HostRows) else ArrayRows(rows)


def read_all(rows: HostRows | np.ndarray) -> np.ndarray:
  """The whole matrix in memory (an array is returned as it is)."""
  if not isinstance(rows, HostRows):
    return np.asarray(rows)
  if isinstance(rows, ArrayRows):
    return rows.array
  out = np.empty(rows.shape, rows.dtype)
  for lo, part in rows.chunks():
    out[lo:lo + len(part)] = part
  return out


def crc32_of_chunks(chunks, crc: int = 0) -> int:
  """CRC-32 of the bytes of arrays given one after another (C order), continuing from `crc`."""
  for part in chunks:
    crc = zlib.crc32(np.ascontiguousarray(part).reshape(-1).view(np.uint8), crc)
  return crc


# ---------------------------------------------------------------------------------------------
# safetensors, a tensor at a time.


def read_safetensors_header(path: str) -> tuple[dict, int]:
  """(header, byte offset of the data) of the local safetensors file `path`; ValueError for a
  file that is not one (truncated, or another format)."""
  with open(path, "rb") as f:
    size_bytes = f.read(8)
    if len(size_bytes) < 8:
      raise ValueError(f"{path} is not a safetensors file: shorter than its header length.")
    (size,) = struct.unpack("<Q", size_bytes)
    file_size = os.fstat(f.fileno()).st_size
    if size > file_size - 8:
      raise ValueError(f"{path} is not a whole safetensors file: its header says {size} bytes, "
                       f"the file has {file_size - 8} after the length.")
    try:
      header = json.loads(f.read(size))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise ValueError(f"{path} is not a safetensors file: its header is not JSON ({e}).") from e
  if not isinstance(header, dict):
    raise ValueError(f"{path} is not a safetensors file: its header is not a JSON object.")
  data_start = 8 + size
  for name, info in header.items():
    if name == "__metadata__":
      continue
    begin, end = info["data_offsets"]
    dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
    want = int(np.prod(info["shape"], dtype=np.int64)) * (dtype.itemsize if dtype else 0)
    if dtype is None or end - begin != want or data_start + end > file_size:
      raise ValueError(f"{path}: tensor {name!r} ({info['dtype']}, {info['shape']}) does not fit "
                       f"the file ({file_size} bytes): it is truncated or corrupt.")
  return header, data_start


def safetensors_rows(path: str, name: str, header: tuple[dict, int] | None = None) -> FileRows:
  """The 2-D tensor `name` of the local safetensors file `path`, read in slices (nothing is read
  now but the header; pass `header` = `read_safetensors_header(path)` to skip reading it again)."""
  header, data_start = header or read_safetensors_header(path)
  if name not in header:
    raise ValueError(f"{path} holds no tensor {name!r} (it has {sorted(set(header) - {'__metadata__'})}).")
  info = header[name]
  if len(info["shape"]) != 2:
    raise ValueError(f"{path}: tensor {name!r} has shape {info['shape']}, not [N, D].")
  return FileRows(path, data_start + info["data_offsets"][0], tuple(info["shape"]),
                  _SAFETENSORS_DTYPES[info["dtype"]])


def write_safetensors(path: str, tensors: dict[str, tuple[tuple[int, ...], np.dtype,
                                                          Callable[[], Iterator[np.ndarray]]]],
                      metadata: dict[str, str] | None = None) -> None:
  """Writes a safetensors file whose tensors come in chunks: {name: (shape, dtype, chunks)} with
  `chunks()` yielding the tensor's C-order pieces (e.g. row slices) one after another. Only one
  chunk is in memory at a time. Tensors are stored in the order given."""
  entries, offset = {}, 0
  for name, (shape, dtype, _) in tensors.items():
    dtype = np.dtype(dtype)
    if dtype not in _DTYPE_NAMES:
      raise ValueError(f"tensor {name!r}: dtype {dtype.name} cannot be stored in safetensors here.")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    entries[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": [int(s) for s in shape],
                     "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  header = {**({"__metadata__": dict(metadata)} if metadata else {}), **entries}
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for name, (shape, dtype, chunks) in tensors.items():
      written = 0
      for part in chunks():
        part = np.ascontiguousarray(part, dtype=dtype)
        f.write(memoryview(part.reshape(-1).view(np.uint8)))
        written += part.nbytes
      begin, end = entries[name]["data_offsets"]
      if written != end - begin:
        raise ValueError(f"tensor {name!r}: its chunks held {written} bytes, its shape {shape} "
                         f"needs {end - begin}.")
