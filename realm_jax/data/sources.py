"""Where documents come from: the embedded corpus, the user's JSONL files, or TFDS Wikipedia.

Every source yields `{"title": str, "text": str, "where": str}` documents in a deterministic
order; `where` says where a document is, for messages ("docs.jsonl:12", "wiki_vital article 3").
"""

from __future__ import annotations

import functools
import glob
import logging
import os
from collections.abc import Iterator, Sequence

from realm_jax import io_utils
from realm_jax.data import wiki_vital

SOURCES = ("wiki_vital", "jsonl", "tfds_wikipedia")
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zip")


def _is_jsonl(name: str) -> bool:
  return name.lower().endswith(".jsonl")


def _jsonl_in_folder(folder: str, names: list[str]) -> list[str]:
  """The *.jsonl (any case) of a folder's files, sorted; logs a warning naming the other files."""
  skipped = tuple(sorted(n for n in names if not _is_jsonl(n)))
  if skipped:
    _warn_skipped(folder, skipped)
  return sorted(n for n in names if _is_jsonl(n))


# Once per folder and files: the corpus fingerprint and the corpus build both list the files.
@functools.lru_cache(maxsize=64)
def _warn_skipped(folder: str, skipped: tuple[str, ...]) -> None:
  shown = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
  hint = (" (compressed files are not read: decompress them first)"
          if any(n.lower().endswith(_COMPRESSED) for n in skipped) else "")
  logging.warning("Corpus folder %s: skipped %d file(s) not named *.jsonl: %s%s.", folder,
                  len(skipped), shown, hint)


def _check_not_compressed(path: str) -> str:
  if path.lower().endswith(_COMPRESSED):
    raise ValueError(f"Corpus file {path} is compressed; compressed files are not read. Decompress "
                     "it first (e.g. `gunzip -k FILE.jsonl.gz`) and pass the .jsonl file.")
  return path


def _remote_jsonl_files(p: str) -> list[str]:
  """`jsonl_files` of one gs:// path."""
  path = io_utils.as_path(p)
  if path.is_dir():
    return [f"{p.rstrip('/')}/{rel}" for rel in _jsonl_in_folder(p, io_utils.list_files(p))]
  if any(ch in p for ch in "*?["):
    return sorted(str(f) for f in path.parent.glob(path.name))
  return [p] if path.exists() else []


def jsonl_files(paths: Sequence[str]) -> list[str]:
  """Expands files, folders (every *.jsonl inside, any case, sorted) and globs into a sorted file
  list; local or gs:// (a gs:// glob only in the last part of the path).

  Raises ValueError for a compressed file (.gz, ...), which is not read; the files of a folder not
  named *.jsonl are skipped with a logged warning.
  """
  files = []
  for p in paths:
    if io_utils.is_remote(p):
      found = _remote_jsonl_files(p)
      if not found:
        raise FileNotFoundError(f"Corpus path {p} does not exist, or holds no *.jsonl file.")
      files += found
    elif os.path.isdir(p):
      names = [os.path.relpath(f, p) for f in glob.glob(os.path.join(p, "**", "*"), recursive=True)
               if os.path.isfile(f)]
      found = [os.path.join(p, n) for n in _jsonl_in_folder(p, names)]
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
  return [_check_not_compressed(f) for f in files]


def read_jsonl(path: str) -> Iterator[dict[str, str]]:
  """Documents of one JSONL file, one `{"title", "text"}` object per line (title optional).

  Raises ValueError naming the file and line for invalid UTF-8, invalid JSON, a missing `text`, or
  a lone UTF-16 surrogate escape (valid JSON, but not text).
  """
  for lineno, doc in io_utils.iter_jsonl(path, "corpus file"):
    if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
      raise ValueError(
          f'{path}:{lineno}: each line must be an object with a "text" string '
          '(and optionally "title"), e.g. {"title": "Paris", "text": "Paris is ..."}.')
    title = doc.get("title") or ""
    if not isinstance(title, str):
      raise ValueError(f'{path}:{lineno}: "title" must be a string.')
    for field, value in (("title", title), ("text", doc["text"])):
      try:
        value.encode("utf-8")
      except UnicodeEncodeError as e:
        raise ValueError(
            f'{path}:{lineno}: "{field}" holds a lone UTF-16 surrogate '
            f"{value[e.start]!r} at character {e.start}: JSON allows the escape, but it is no "
            "text. Fix the program that wrote the file (it escaped broken text), or replace the "
            "escape with \\ufffd.") from None
    yield {"title": title.strip(), "text": doc["text"], "where": f"{path}:{lineno}"}


def documents(source: str, paths: Sequence[str] = (), tfds_name: str = "wikipedia/20230601.en",
              max_docs: int | None = None) -> Iterator[dict[str, str]]:
  """Documents of a source, in a deterministic order."""
  if source == "wiki_vital":
    it = ({**doc, "where": f"wiki_vital article {i + 1}"}
          for i, doc in enumerate(wiki_vital.load_articles()))
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
  the dump and needs TensorFlow and Apache Beam) in TFDS_DATA_DIR; never downloads it itself.
  """
  import tensorflow_datasets as tfds
  # TFDS_DATA_DIR read now, not when tensorflow_datasets was imported.
  builder = tfds.builder(name, data_dir=os.environ.get("TFDS_DATA_DIR"))
  if not builder.is_prepared():  # tfds.load would start downloading the whole dump here
    raise FileNotFoundError(
        f"The TFDS dataset {name} is not prepared in {builder.data_dir}. Build it once (it "
        f"downloads the Wikipedia dump and needs TensorFlow and Apache Beam): `tfds build {name}`, "
        f"with `--data_dir=DIR` and TFDS_DATA_DIR=DIR set here if it should live elsewhere.")
  ds = builder.as_dataset(split="train", shuffle_files=False)
  for i, ex in enumerate(tfds.as_numpy(ds)):
    yield {"title": ex["title"].decode("utf-8"), "text": ex["text"].decode("utf-8"),
           "where": f"{name} article {i + 1}"}
