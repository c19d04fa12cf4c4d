"""Files on local disk or in Google Cloud Storage, written so that readers never see half of one.

Every path goes through `etils.epath.Path`: local paths use `os`; `gs://` paths use
`tf.io.gfile` when TensorFlow is installed, else fsspec's gcsfs (`pip install 'realm-jax[gcs]'`).

Writers are atomic on both. Locally a file or directory is written under a temporary name beside
its target, then renamed into place. In an object store a rename is a copy, and there are no
directories, only object names with slashes; but one object appears complete or not at all when
its upload finishes. So a remote file is written locally, then uploaded as one object, and a
remote directory is written locally, then uploaded file by file with its `marker` (a manifest)
removed first and uploaded last: a reader that checks the marker never takes a half-uploaded
directory for a complete one (with one writer at a time).

Libraries that take local paths only (array_record, safetensors' files) get a local copy:
`local_file` for one file, `local_dir` + `download_dir` / `upload_dir` for a directory mirrored
between the work directory and a local cache (REALM_JAX_CACHE, default ~/.cache/realm_jax), and
`local_copy_of_dir` for a directory that is only read (model weights).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from etils import epath

# The URI schemes that etils.epath sends to an object store rather than to `os`.
REMOTE_PREFIXES = ("gs://", "s3://", "az://", "hf://")
CACHE_ENV = "REALM_JAX_CACHE"


def is_remote(path: str | os.PathLike) -> bool:
  """True for paths in an object store (gs://...), False for local paths."""
  return os.fspath(path).startswith(REMOTE_PREFIXES)


@functools.cache
def _check_gcs_backend() -> None:
  # etils.epath reads gs:// with tf.io.gfile when TensorFlow is importable and EPATH_USE_TF is not
  # false; otherwise with fsspec, whose "gs" filesystem is gcsfs.
  use_tf = os.environ.get("EPATH_USE_TF", "").lower() not in ("false", "no", "f", "0")
  if use_tf and importlib.util.find_spec("tensorflow") is not None:
    return
  try:
    import fsspec
    import fsspec.config
    fsspec.get_filesystem_class("gs")
  except (ImportError, ValueError) as e:
    raise ImportError(
        f"gs:// paths need gcsfs (or TensorFlow), and neither is installed ({e}). Install it with "
        "pip install 'realm-jax[gcs]', or use a local directory.") from None
  # gcsfs caches directory listings, and would not see what other processes (the other hosts, the
  # index refresher) write into the work directory. Set before epath makes its filesystem.
  fsspec.config.conf.setdefault("gs", {}).setdefault("use_listings_cache", False)


def as_path(path: str | os.PathLike) -> epath.Path:
  """`path` as an `etils.epath.Path`; a clear error if it is a gs:// path without a backend."""
  path = os.fspath(path)
  if path.startswith("gs://"):
    _check_gcs_backend()
  return epath.Path(path)


def absolute(path: str | os.PathLike) -> str:
  """An absolute local path, or the remote path as it is (orbax wants absolute paths)."""
  path = os.fspath(path)
  return path if is_remote(path) else os.path.abspath(path)


def local_dir(path: str | os.PathLike) -> str:
  """Where a directory that local-only readers need is kept on this machine: `path` itself when
  local, else `$REALM_JAX_CACHE/<scheme>/<bucket>/<path>` (default cache ~/.cache/realm_jax).

  Raises ValueError for a remote `path` with a "." or ".." part: an object store takes it as part
  of a name, but its local copy would be that of another path (gs://b/./x that of gs://b/x), or
  outside the cache (gs://b/../../x).
  """
  path = os.fspath(path)
  if not is_remote(path):
    return path
  scheme, rest = path.split("://", 1)
  cache = os.path.expanduser(os.environ.get(CACHE_ENV) or os.path.join("~", ".cache", "realm_jax"))
  odd = [part for part in rest.split("/") if part in (".", "..")]
  if odd:
    raise ValueError(
        f"The remote path {path} has a {odd[0]!r} part: an object store takes it as a name, not as "
        f"a step, so its local copy in {cache} would be that of another path (or outside the "
        "cache). Write the path without '.' and '..' parts.")
  return os.path.join(cache, scheme, rest.strip("/"))


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def save_figure(fig, path: str | os.PathLike, dpi: int) -> None:
  """Lays out a matplotlib figure tightly and writes it as a PNG at `path` (atomic_write), drawn
  once: `fig.tight_layout()` leaves a placeholder layout engine on the figure, for which savefig
  would draw the whole figure a second time before the one it writes (the same pixels; a
  training run's curves 0.91-1.30 s instead of 1.28-1.39 s on 2 AMD EPYC cores, docs/notes.md,
  2026-12-02). The figure is closed."""
  import matplotlib.pyplot as plt
  fig.tight_layout()
  fig.set_layout_engine(None)
  try:
    atomic_write(path, lambda p: fig.savefig(p, dpi=dpi, format="png"))
  finally:
    plt.close(fig)


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
  """Calls `write(tmp_path)` on a temporary local file, then puts it at `path` in one piece.

  Locally the temporary file sits beside `path` and is renamed over it; for a remote `path` it is
  uploaded as one object, which becomes visible only once whole.
  """
  path = os.fspath(path)
  if is_remote(path):
    dest = as_path(path)
    with tempfile.TemporaryDirectory(prefix="realm_jax-") as tmp:
      local = os.path.join(tmp, dest.name)
      write(local)
      epath.Path(local).copy(dest, overwrite=True)
    return
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


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
  """Writes `data` to `path` atomically (see `atomic_write`)."""
  atomic_write(path, lambda tmp: epath.Path(tmp).write_bytes(data))


def write_text(path: str | os.PathLike, text: str) -> None:
  write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, obj: Any) -> None:
  write_text(path, json.dumps(obj, indent=2))


def check_writable(directory: str | os.PathLike, what: str) -> None:
  """Makes `directory` (local or gs://) and writes and deletes a file in it, so that an output
  directory that cannot be written fails before the work whose results go there, not after it.

  Raises:
    OSError "<directory> cannot be written (<reason>); <what>" (`what`: what goes there and what
    to do).
  """
  path = as_path(directory)
  probe = path / f".write-test-{uuid.uuid4().hex}"
  try:
    path.mkdir(parents=True, exist_ok=True)
    probe.write_bytes(b"")
    probe.unlink()
  except OSError as e:
    reason = "it is a file" if isinstance(e, FileExistsError) else e.strerror or e
    raise OSError(f"{os.fspath(directory)} cannot be written ({reason}); {what}") from e


class JSONFileError(json.JSONDecodeError):
  """A `json.JSONDecodeError` (its `msg`, `lineno`, `colno` kept, for callers that catch it to
  say more) whose message names the file: `path:line:column: not valid JSON (Expecting value).`"""

  def __init__(self, path: str | os.PathLike, e: json.JSONDecodeError, first_line: int = 1):
    """`e` of the text that starts at line `first_line` of the file `path`."""
    super().__init__(e.msg, e.doc, e.pos)
    self.path = os.fspath(path)
    self.lineno += first_line - 1

  def __str__(self) -> str:
    return f"{self.path}:{self.lineno}:{self.colno}: not valid JSON ({self.msg})."


def read_json(path: str | os.PathLike) -> Any:
  """The JSON value in the file `path`; a `JSONFileError` naming the file, line and column if the
  file is not JSON."""
  try:
    return json.loads(as_path(path).read_bytes())
  except json.JSONDecodeError as e:
    raise JSONFileError(path, e) from None


@contextlib.contextmanager
def local_file(path: str | os.PathLike) -> Iterator[str]:
  """A local path holding the file `path`: `path` itself when local, else a temporary download
  (deleted on exit), for readers that take local paths only (safetensors' load_file)."""
  path = os.fspath(path)
  if not is_remote(path):
    yield path
    return
  src = as_path(path)
  with tempfile.TemporaryDirectory(prefix="realm_jax-") as tmp:
    local = os.path.join(tmp, src.name)
    src.copy(local)
    yield local


def atomic_write_dir(path: str | os.PathLike, write: Callable[[str], None], *,
                     marker: str) -> None:
  """Calls `write(tmp_dir)` on a temporary local directory, then puts it at `path`.

  Locally, readers see either no directory or a complete one: the temporary directory sits beside
  `path` and is renamed over it. An existing `path` is moved aside first (so for a moment `path`
  does not exist), then deleted. A crash mid-write leaves only a `.tmp-<name>-*` sibling, which
  readers should ignore and a later run may delete. The directories and files written get the
  usual permissions (0777 / 0666 less the umask), whatever made them.

  For a remote `path` the files are uploaded with `upload_dir`: readers must treat the directory
  as complete only once `marker` (a file that `write` makes, e.g. "manifest.json") exists.
  """
  if is_remote(path):
    with tempfile.TemporaryDirectory(prefix="realm_jax-") as tmp:
      write(tmp)
      upload_dir(tmp, path, marker=marker)
    return
  path = os.path.abspath(os.fspath(path))
  parent, name = os.path.split(path)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=parent)
  try:
    write(tmp)
    # mkdtemp makes 0700, and writers such as safetensors' make their files 0600.
    umask = _umask()
    for root, _, files in os.walk(tmp):
      os.chmod(root, 0o777 & ~umask)
      for f in files:
        if not os.path.islink(os.path.join(root, f)):  # chmod would change the file it names
          os.chmod(os.path.join(root, f), 0o666 & ~umask)
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


def _read_or_none(path: epath.Path) -> bytes | None:
  try:
    return path.read_bytes()
  except FileNotFoundError:
    return None


def list_files(path: str | os.PathLike) -> list[str]:
  """Paths of the files under the directory `path` (local or remote), relative to it, recursively.
  (Not `epath.Path.walk`: on fsspec it yields the gs:// paths without their gs://.)"""
  out = []
  for child in as_path(path).iterdir():
    if child.is_dir():
      out += [f"{child.name}/{rel}" for rel in list_files(child)]
    else:
      out.append(child.name)
  return out


def upload_dir(local: str | os.PathLike, path: str | os.PathLike, *, marker: str) -> None:
  """Copies the local directory `local` to `path` (remote), `marker` last.

  Nothing is done when `path/marker` already has the same bytes as `local/marker` (a manifest
  that names the contents; delete `path/marker` first to force the upload). Otherwise
  `path/marker` is deleted first, so that from then until the upload ends readers see an
  incomplete directory; files of `path` that `local` does not have are left alone.
  """
  local, dest = os.fspath(local), as_path(path)
  files = list_files(local)
  if marker not in files:
    raise FileNotFoundError(f"{local} has no {marker}: it is not a complete directory to upload.")
  want = (epath.Path(local) / marker).read_bytes()
  if _read_or_none(dest / marker) == want:
    return
  (dest / marker).unlink(missing_ok=True)
  for rel in sorted(files, key=lambda f: f == marker):  # the marker last
    epath.Path(local, rel).copy(dest / rel, overwrite=True)


def download_dir(path: str | os.PathLike, local: str | os.PathLike, *, marker: str) -> bool:
  """Makes the local directory `local` a copy of the complete remote directory `path`.

  Returns False, doing nothing, when `path/marker` does not exist (`path` is absent or not
  complete). Nothing is copied when `local/marker` already has the same bytes. The copy replaces
  `local` atomically (`atomic_write_dir`).
  """
  src, local = as_path(path), os.fspath(local)
  want = _read_or_none(src / marker)
  if want is None:
    return False
  if _read_or_none(epath.Path(local, marker)) == want:
    return True

  def copy(tmp: str):
    for rel in list_files(src):
      if rel != marker:
        os.makedirs(os.path.dirname(os.path.join(tmp, rel)), exist_ok=True)
        (src / rel).copy(os.path.join(tmp, rel))
    # The marker read above: files uploaded before it belong to it (one writer at a time).
    epath.Path(tmp, marker).write_bytes(want)

  atomic_write_dir(local, copy, marker=marker)
  return True


# In a local copy made by `local_copy_of_dir`: what the remote files were when it was made.
_SOURCE_STAMP = ".realm_jax_source.json"


def local_copy_of_dir(path: str | os.PathLike, *, marker: str, what: str = "Directory") -> str:
  """A local directory with the files of the directory `path`, for readers of local files only.

  `path` itself when local. For a remote `path`: its copy in the local cache (`local_dir`),
  downloaded unless the copy there was made from the same remote files (names, sizes, modification
  times): a marker such as a checkpoint's config.json stays the same when new weights replace the
  old ones beside it, so the marker's bytes alone (`download_dir`) cannot tell.

  Raises:
    FileNotFoundError naming `path` (`what` says what it should be) when it does not exist or
    has no `marker`, i.e. is not complete.
  """
  path = os.fspath(path)
  if not is_remote(path):
    return path
  src = as_path(path)
  files = sorted(list_files(path)) if src.is_dir() else []
  if not files:
    raise FileNotFoundError(f"{what} {path} does not exist (or is empty): check the path.")
  if marker not in files:
    raise FileNotFoundError(
        f"{what} {path} has no {marker}, so it is not complete: an upload still under way or cut "
        f"short, or not the right directory. Upload its files with {marker} last.")
  rows = []
  for rel in files:
    st = (src / rel).stat()
    rows.append([rel, st.length, st.mtime])
  stamp = json.dumps(rows).encode()
  local = local_dir(path)
  if _read_or_none(epath.Path(local, _SOURCE_STAMP)) != stamp:
    # Without its marker the old copy is incomplete: `download_dir` replaces all of it.
    epath.Path(local, marker).unlink(missing_ok=True)
    if not download_dir(path, local, marker=marker):
      raise FileNotFoundError(f"{what} {path} lost its {marker} during the download: it is being "
                              "rewritten. Try again once that has finished.")
    epath.Path(local, _SOURCE_STAMP).write_bytes(stamp)
  return local


def iter_jsonl(path: str | os.PathLike, what: str = "file"):
  """Yields (line number, parsed object) of a JSONL file, skipping blank lines.

  Raises errors that name the file and line: unreadable file, invalid UTF-8, invalid JSON (a
  `JSONFileError`, also naming the column).
  """
  path = os.fspath(path)
  # Asked first: tf.io.gfile reports a missing file only at the first read.
  if not as_path(path).exists():
    raise FileNotFoundError(f"{what.capitalize()} {path} does not exist.")
  try:
    opened = as_path(path).open("rb")
  except OSError as e:
    raise OSError(f"Cannot read {what} {path}: {e.strerror or e}.") from None
  with opened as f:  # for tf.io.gfile, `open` gives a context manager, not the file
    for lineno, raw in enumerate(f, 1):
      if lineno == 1 and raw.startswith(b"\x1f\x8b"):
        raise ValueError(f"{path} is gzip-compressed; decompress it first (gunzip -k).")
      try:  # a byte-order mark at the start of the file is allowed
        line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}:{lineno}: not valid UTF-8 (byte {e.start}); convert the file to UTF-8.") from None
      if not line.strip():
        continue
      try:  # without its line break, after which an unfinished line's error would be placed
        yield lineno, json.loads(line.rstrip("\r\n"))
      except json.JSONDecodeError as e:
        raise JSONFileError(path, e, lineno) from None
