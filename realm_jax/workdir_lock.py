"""One run per work directory: the lock a run holds on `<workdir>/<name>.lock` while it writes there.

    with workdir_lock.hold(workdir):           # RUN: pre-training, ICT, fine-tuning, build_index
      Trainer(config, workdir).run()
    with workdir_lock.hold(workdir, REFRESHER):  # the index refresher, beside the trainer
      ...
    with workdir_lock.hold(db_dir, DATABASE):    # a RETRO chunk database while it is built
      ...

Two trainers on one work directory would interleave their checkpoints, metrics.jsonl and
config.json; the second is refused with `WorkdirInUseError` (an OSError: the entry points print it
as one `error:` line) naming the holder: its process id, host, start time and command line.

On a local (or NFS) filesystem the lock is `fcntl.flock` on the open lock file: the kernel releases
it when the process ends, however it ends, so a run killed with SIGKILL leaves nothing to clean
up. The file's contents (the holder, written once the lock is held) serve only the error message.
A run refused (its block raised) in a directory that `hold` created leaves nothing there: the lock
file goes, and the directory when nothing else was written to it. A run that gets the lock checks
that its file is still the one at the path (else it takes the lock again), so that a lock file
deleted while another process opened it never lets two processes hold two files of one name.

An object store (gs://) has no locks. There the file is a lease: the holder writes it, checks
after `settle_s` that its own copy is the one that stayed (of two runs that start together, the
later writer wins), then rewrites it every `beat_s` from a background thread, and deletes it when
done. A new run that finds a lease watches it for up to `expire_s`: renewed, its holder is alive
and the new run is refused (within about one beat); not renewed, its holder died (SIGKILL, a
preempted VM) and the lease is taken over with a warning. Liveness is judged by renewal seen
here, not by comparing clocks across machines; the price is that a run restarted on gs:// right
after its predecessor was killed waits up to `expire_s` (90 s) before it starts.

In a multi-host run only process 0 takes the lock (all processes are one run); the others learn
whether it got it, so that every process stops together when it did not.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import jax
import numpy as np

from realm_jax import distributed
from realm_jax.io_utils import as_path, is_remote, write_text

RUN = "run"               # everything that writes a work directory's checkpoints, config or index
REFRESHER = "refresher"   # experiments/refresh_index.py, which runs beside the trainer
DATABASE = "build"        # the build of a RETRO chunk database (retrieval/chunk_db.py)

BEAT_S = 30.0
EXPIRE_S = 90.0
SETTLE_S = 5.0


class WorkdirInUseError(OSError):
  """Another process holds the lock of a work directory."""


def lock_path(workdir: str, name: str = RUN) -> str:
  return os.path.join(workdir, f"{name}.lock")


def holder_info(name: str) -> dict:
  """Who this process is, as the lock file records it for the error another run prints."""
  return {"lock": name, "pid": os.getpid(), "host": socket.gethostname(),
          "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
          "command": " ".join(sys.argv), "token": uuid.uuid4().hex}


# Each lock's holder, what a second one would break, and the flag that names another directory.
_WHO = {RUN: ("run", "two runs on one work directory would mix their checkpoints, metrics and "
              "config", "--workdir"),
        REFRESHER: ("index refresher", "two refreshers would publish the same indexes over each "
                    "other", "--workdir"),
        DATABASE: ("build of its chunk database", "two builds would write the database's files "
                   "over each other", "--config.db.dir")}


def in_use_error(workdir: str, name: str, holder: dict | None) -> WorkdirInUseError:
  if holder:
    who = (f"process {holder.get('pid')} on {holder.get('host')}, started "
           f"{holder.get('started')}: {holder.get('command')}")
  else:
    who = "a process that has not written its name yet"
  what, why, flag = _WHO.get(name, ("process", "it holds the lock", "--workdir"))
  return WorkdirInUseError(
      f"{workdir} is in use by another {what} ({who}; lock file {lock_path(workdir, name)}): "
      f"{why}. Wait for it to end or stop it, or pass another {flag}.")


class FileLock:
  """`fcntl.flock` on a local lock file, held from `acquire` until `release` or process exit."""

  def __init__(self, workdir: str, name: str = RUN):
    self.workdir, self.name, self.path = workdir, name, lock_path(workdir, name)
    self._fd = None

  def acquire(self) -> None:
    os.makedirs(self.workdir, exist_ok=True)
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = self._read_holder(fd)
        os.close(fd)
        raise in_use_error(self.workdir, self.name, holder) from None
      except BaseException:
        os.close(fd)
        raise
      if self._is_at_path(fd):
        break
      os.close(fd)  # its holder deleted it (see `remove`) after this process opened it: again
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder_info(self.name)).encode(), 0)
    self._fd = fd

  @staticmethod
  def _read_holder(fd: int) -> dict | None:
    # The holder writes its name just after it gets the lock: give it a moment.
    for _ in range(20):
      raw = os.pread(fd, 1 << 16, 0)
      try:
        return json.loads(raw)
      except ValueError:
        time.sleep(0.05)
    return None

  def _is_at_path(self, fd: int) -> bool:
    try:
      return os.stat(self.path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
      return False

  def release(self) -> None:
    if self._fd is not None:
      # Emptied, not deleted: the lock file of a work directory stays for the next run.
      os.ftruncate(self._fd, 0)
      os.close(self._fd)
      self._fd = None

  def remove(self) -> None:
    """Releases the lock, deleting its file (while it is still held: a process that opened the
    file meanwhile is refused now, or finds it gone once it gets it, and opens a new one)."""
    if self._fd is not None:
      os.unlink(self.path)
      os.close(self._fd)
      self._fd = None


class Lease:
  """The lock of a gs:// work directory: a lease file renewed every `beat_s` (see the module
  docstring). Works on any path (the tests use a local one)."""

  def __init__(self, workdir: str, name: str = RUN, *, beat_s: float = BEAT_S,
               expire_s: float = EXPIRE_S, settle_s: float = SETTLE_S):
    self.workdir, self.name, self.path = workdir, name, lock_path(workdir, name)
    self.beat_s, self.expire_s, self.settle_s = beat_s, expire_s, settle_s
    self.me = holder_info(name)
    self._stop = threading.Event()
    self._thread = None

  def _read(self) -> dict | None:
    try:
      return json.loads(as_path(self.path).read_text())
    except FileNotFoundError:
      return None
    except ValueError:  # not one of ours: treated as a holder that never renews
      return {}

  def _write(self, beat: int) -> None:
    write_text(self.path, json.dumps({**self.me, "beat": beat}))

  def acquire(self) -> None:
    seen = self._read()
    if seen is not None:
      deadline = time.monotonic() + self.expire_s
      while seen is not None and time.monotonic() < deadline:
        time.sleep(min(self.beat_s / 3, max(deadline - time.monotonic(), 0)))
        now = self._read()
        if now is not None and now != seen:  # renewed (or taken by a third run): alive
          raise in_use_error(self.workdir, self.name, now)
        seen = now  # None: released, it is free
      if seen is not None:
        logging.warning("The lease %s of %s was not renewed for %.0f s: its holder is gone; "
                        "taking it over.", self.path, seen, self.expire_s)
    self._write(0)
    time.sleep(self.settle_s)
    now = self._read()
    if not now or now.get("token") != self.me["token"]:  # another run wrote after us
      raise in_use_error(self.workdir, self.name, now)
    self._thread = threading.Thread(target=self._renew, name=f"lease {self.path}", daemon=True)
    self._thread.start()

  def _renew(self) -> None:
    beat = 0
    while not self._stop.wait(self.beat_s):
      try:
        now = self._read()
        if not now or now.get("token") != self.me["token"]:
          logging.error("The lease %s was taken over by %s (this process did not renew it for "
                        "%.0f s): two runs now write %s. Stop one of them.", self.path, now,
                        self.expire_s, self.workdir)
          return
        beat += 1
        self._write(beat)
      except OSError as e:  # a failed renewal is retried at the next beat
        logging.warning("Could not renew the lease %s: %s", self.path, e)

  def release(self) -> None:
    if self._thread is None:
      return
    self._stop.set()
    self._thread.join()
    self._thread = None
    now = self._read()
    if now and now.get("token") == self.me["token"]:
      as_path(self.path).unlink(missing_ok=True)


def _agreed(ok: bool) -> bool:
  """Whether every process of a multi-host run says `ok` (one collective)."""
  return bool(distributed.allgather_rows(np.array([ok], np.int8)).all())


@contextlib.contextmanager
def hold(workdir: str, name: str = RUN) -> Iterator[None]:
  """Holds the `name` lock of `workdir` (created if missing) while the block runs.

  Raises WorkdirInUseError, naming the holder, when another process holds it. Only process 0 of a
  multi-host run takes it; every process raises when it could not. When the block raises in a
  directory this call created, the lock file is deleted, and the directory if it is then empty:
  a refused run leaves nothing behind.
  """
  lock, created = None, False
  if jax.process_index() == 0:
    created = not is_remote(workdir) and not os.path.exists(workdir)
    lock = Lease(workdir, name) if is_remote(workdir) else FileLock(workdir, name)
    try:
      lock.acquire()
    except OSError:
      _agreed(False)
      raise
  if not _agreed(True):
    raise WorkdirInUseError(f"Process 0 could not take the lock of {workdir}: its error says why.")
  try:
    yield
  except BaseException:
    if created:
      lock.remove()
      with contextlib.suppress(OSError):  # not empty: what the run wrote stays
        os.rmdir(workdir)
    raise
  finally:
    if lock is not None:
      lock.release()
