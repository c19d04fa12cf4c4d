"""Writing files so that an interrupted run never leaves a half-written one behind."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
  """Calls `write(tmp_path)` on a temporary file beside `path`, then renames it to `path`."""
  path = os.fspath(path)
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path), dir=directory)
  os.close(fd)
  try:
    write(tmp)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def write_json(path: str | os.PathLike, obj: Any) -> None:
  def write(tmp):
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(obj, f, indent=2)
  atomic_write(path, write)


def read_json(path: str | os.PathLike) -> Any:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def atomic_write_dir(path: str | os.PathLike, write: Callable[[str], None]) -> None:
  """Calls `write(tmp_dir)` on a temporary directory beside `path`, then renames it to `path`.

  Readers see either no directory or a complete one. An existing `path` is replaced: it is moved
  aside first (so for a moment `path` does not exist), then deleted. A crash mid-write leaves only a
  `.tmp-<name>-*` sibling, which readers should ignore and a later run may delete.
  """
  path = os.path.abspath(os.fspath(path))
  parent, name = os.path.split(path)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=parent)
  try:
    write(tmp)
    if os.path.exists(path):
      # os.replace cannot put a directory over a non-empty one.
      old = tempfile.mkdtemp(prefix=f".old-{name}-", dir=parent)
      os.replace(path, os.path.join(old, name))
      os.replace(tmp, path)
      shutil.rmtree(old)
    else:
      os.replace(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def iter_jsonl(path: str, what: str = "file"):
  """Yields (line number, parsed object) of a JSONL file, skipping blank lines.

  Raises errors that name the file and line: unreadable file, invalid UTF-8, invalid JSON.
  """
  try:
    f = open(path, "rb")
  except FileNotFoundError:
    raise FileNotFoundError(f"{what.capitalize()} {path} does not exist.") from None
  except OSError as e:
    raise OSError(f"Cannot read {what} {path}: {e.strerror}.") from None
  with f:
    for lineno, raw in enumerate(f, 1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}:{lineno}: not valid UTF-8 (byte {e.start}); convert the file to UTF-8.") from None
      if not line.strip():
        continue
      try:
        yield lineno, json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}).") from None
