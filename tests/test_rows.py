"""Host rows read in slices, and safetensors written and read a tensor chunk at a time, against
numpy slicing and the `safetensors` package itself."""

import numpy as np
import pytest
from ml_dtypes import bfloat16
from safetensors import safe_open
from safetensors.numpy import save_file

from realm_jax.retrieval import rows as rows_lib
from realm_jax.retrieval.rows import (ArrayRows, ConcatRows, FileRows, crc32_of_chunks, read_all,
                                      read_safetensors_header, safetensors_rows,
                                      write_safetensors)


def matrix(n, d, dtype=np.float32, seed=0):
  return np.random.default_rng(seed).normal(size=(n, d)).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, bfloat16])
def test_file_and_concatenated_rows_read_what_numpy_slicing_reads(tmp_path, dtype):
  parts = [matrix(n, 5, dtype, seed=n) for n in (7, 1, 12)]
  files = []
  for i, part in enumerate(parts):
    path = str(tmp_path / f"part{i}.bin")
    with open(path, "wb") as f:
      f.write(b"x" * 3)  # data at an odd offset
      f.write(part.tobytes())
    files.append(FileRows(path, 3, part.shape, dtype))
  whole = np.concatenate(parts)
  rows = ConcatRows(files)
  assert rows.shape == (20, 5) and rows.dtype == np.dtype(dtype) and len(rows) == 20
  for lo, hi in [(0, 20), (0, 7), (6, 8), (7, 8), (5, 19), (8, 8), (19, 20)]:
    np.testing.assert_array_equal(rows.read(lo, hi), whole[lo:hi])
  np.testing.assert_array_equal(read_all(rows), whole)
  seen = list(rows.chunks(3, 17, chunk_bytes=4 * 5 * np.dtype(dtype).itemsize))
  assert [lo for lo, _ in seen] == [3, 7, 11, 15] and max(len(p) for _, p in seen) == 4
  np.testing.assert_array_equal(np.concatenate([p for _, p in seen]), whole[3:17])
  with pytest.raises(IndexError):
    rows.read(5, 21)
  with pytest.raises(ValueError, match="different widths"):
    ConcatRows([files[0], ArrayRows(matrix(3, 4))])


def test_a_truncated_file_is_an_error_naming_it(tmp_path):
  path = tmp_path / "short.bin"
  path.write_bytes(matrix(3, 4).tobytes())
  with pytest.raises(ValueError, match="short.bin ends before row 4"):
    FileRows(str(path), 0, (4, 4), np.float32).read(0, 4)


@pytest.mark.parametrize("dtype", [np.float32, bfloat16])
def test_written_safetensors_are_what_the_safetensors_package_reads(tmp_path, dtype):
  emb, ids = matrix(37, 6, dtype), np.arange(37, dtype=np.int64) * 11
  path = str(tmp_path / "a.safetensors")
  write_safetensors(path, {
      "embeddings": (emb.shape, emb.dtype, lambda: (emb[i:i + 8] for i in range(0, 37, 8))),
      "block_ids": (ids.shape, ids.dtype, lambda: [ids])}, metadata={"save_id": "abc"})
  with safe_open(path, framework="numpy") as f:
    np.testing.assert_array_equal(f.get_tensor("embeddings"), emb)
    np.testing.assert_array_equal(f.get_tensor("block_ids"), ids)
    assert f.metadata() == {"save_id": "abc"}
  assert read_safetensors_header(path)[1] % 8 == 0  # data 8-byte aligned
  with pytest.raises(ValueError, match="its chunks held"):
    write_safetensors(str(tmp_path / "b.safetensors"),
                      {"embeddings": (emb.shape, emb.dtype, lambda: [emb[:5]])})


def test_safetensors_of_the_package_are_read_in_slices(tmp_path):
  emb = matrix(50, 3)
  path = str(tmp_path / "c.safetensors")
  save_file({"other": np.ones(4, np.int32), "embeddings": emb}, path)
  rows = safetensors_rows(path, "embeddings")
  assert rows.shape == (50, 3)
  np.testing.assert_array_equal(rows.read(10, 40), emb[10:40])
  with pytest.raises(ValueError, match="holds no tensor 'missing'"):
    safetensors_rows(path, "missing")
  data = open(path, "rb").read()
  (tmp_path / "cut.safetensors").write_bytes(data[:-10])
  with pytest.raises(ValueError, match="truncated or corrupt"):
    read_safetensors_header(str(tmp_path / "cut.safetensors"))
  (tmp_path / "junk.safetensors").write_bytes(b"\x05" + b"\x00" * 7 + b"hello")
  with pytest.raises(ValueError, match="not JSON"):
    read_safetensors_header(str(tmp_path / "junk.safetensors"))


def test_crc_of_chunks_is_the_crc_of_the_whole():
  import zlib
  a = matrix(30, 4)
  assert crc32_of_chunks([a[:7], a[7:8], a[8:]]) == zlib.crc32(a.tobytes())


def test_default_chunk_follows_the_module_setting(monkeypatch):
  monkeypatch.setattr(rows_lib, "CHUNK_BYTES", 3 * 4 * 4)
  assert ArrayRows(matrix(10, 4)).chunk_rows() == 3
