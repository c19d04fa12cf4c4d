"""Where documents come from: the embedded corpus, the user's JSONL files, or TFDS Wikipedia.

Every source yields `{"title": str, "text": str}` documents in a deterministic order.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator, Sequence

from realm_jax import io_utils
from realm_jax.data import wiki_vital

SOURCES = ("wiki_vital", "jsonl", "tfds_wikipedia")


def _remote_jsonl_files(p: str) -> list[str]:
  """`jsonl_files` of one gs:// path."""
  path = io_utils.as_path(p)
  if path.is_dir():
    return sorted(f"{p.rstrip('/')}/{rel}" for rel in io_utils.list_files(p)
                  if rel.endswith(".jsonl"))
  if any(ch in p for ch in "*?["):
    return sorted(str(f) for f in path.parent.glob(path.name))
  return [p] if path.exists() else []


def jsonl_files(paths: Sequence[str]) -> list[str]:
  """Expands files, folders (every *.jsonl inside, sorted) and globs into a sorted file list;
  local or gs:// (a gs:// glob only in the last part of the path)."""
  files = []
  for p in paths:
    if io_utils.is_remote(p):
      found = _remote_jsonl_files(p)
      if not found:
        raise FileNotFoundError(f"Corpus path {p} does not exist, or holds no *.jsonl file.")
      files += found
    elif os.path.isdir(p):
      found = sorted(glob.glob(os.path.join(p, "**", "*.jsonl"), recursive=True))
      if not found:
        raise FileNotFoundError(f"Folder {p} holds no *.jsonl file.")
      files += found
    elif any(ch in p for ch in "*?["):
      found = sorted(glob.glob(p))
      if not found:
        raise FileNotFoundError(f"No file matches {p}.")
      files += found
    elif os.path.isfile(p):
      files.append(p)
    else:
      raise FileNotFoundError(f"Corpus file {p} does not exist.")
  return files


def read_jsonl(path: str) -> Iterator[dict[str, str]]:
  """Documents of one JSONL file, one `{"title", "text"}` object per line (title optional).

  Raises ValueError naming the file and line for invalid UTF-8, invalid JSON or a missing `text`.
  """
  for lineno, doc in io_utils.iter_jsonl(path, "corpus file"):
    if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
      raise ValueError(
          f'{path}:{lineno}: each line must be an object with a "text" string '
          '(and optionally "title"), e.g. {"title": "Paris", "text": "Paris is ..."}.')
    title = doc.get("title") or ""
    if not isinstance(title, str):
      raise ValueError(f'{path}:{lineno}: "title" must be a string.')
    yield {"title": title.strip(), "text": doc["text"]}


def documents(source: str, paths: Sequence[str] = (), tfds_name: str = "wikipedia/20230601.en",
              max_docs: int | None = None) -> Iterator[dict[str, str]]:
  """Documents of a source, in a deterministic order."""
  if source == "wiki_vital":
    it = iter(wiki_vital.load_articles())
  elif source == "jsonl":
    if not paths:
      raise ValueError("source='jsonl' needs paths: JSONL files or folders of them.")
    it = (doc for path in jsonl_files(paths) for doc in read_jsonl(path))
  elif source == "tfds_wikipedia":
    it = _tfds_wikipedia(tfds_name)
  else:
    raise ValueError(f"source={source!r}: use one of {SOURCES}.")
  for i, doc in enumerate(it):
    if max_docs is not None and i >= max_docs:
      return
    yield doc


def _tfds_wikipedia(name: str) -> Iterator[dict[str, str]]:
  """English Wikipedia from TFDS (full scale: ~6M articles -> ~13M blocks).

  Needs the prepared TFDS `wikipedia` dataset (`tfds build wikipedia/20230601.en`, which downloads
  the dump and needs TensorFlow and Apache Beam) in TFDS_DATA_DIR. Not exercised by the tests.
  """
  import tensorflow_datasets as tfds
  ds = tfds.load(name, split="train", shuffle_files=False)
  for ex in tfds.as_numpy(ds):
    yield {"title": ex["title"].decode("utf-8"), "text": ex["text"].decode("utf-8")}
