"""The work-directory lock: a second holder is refused, naming the first; a holder killed with
SIGKILL leaves nothing stuck; the refresher's lock is its own; the gs:// lease (on a local path,
with short beats) refuses a live holder and takes over from a dead one."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from realm_jax import workdir_lock
from realm_jax.workdir_lock import REFRESHER, Lease, WorkdirInUseError, hold

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOLDER = ("import sys, time; from realm_jax import workdir_lock; "
          "held = workdir_lock.hold(sys.argv[1]); held.__enter__(); print('held', flush=True); time.sleep(600)")


def test_a_killed_holder_leaves_no_stuck_lock(tmp_path):
  workdir = str(tmp_path / "w")
  holder = subprocess.Popen([sys.executable, "-c", HOLDER, workdir], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(WorkdirInUseError) as refused:
      with hold(workdir):
        pass
    message = str(refused.value)
    assert f"{workdir} is in use by another run (process {holder.pid} on " \
           f"{socket.gethostname()}, started " in message
    assert f": -c {workdir}; lock file {workdir}/run.lock)" in message  # its command line
    assert "another --workdir" in message
    with hold(workdir, REFRESHER):  # the refresher runs beside the trainer
      with pytest.raises(WorkdirInUseError, match=r"in use by another index refresher \(process "
                         rf"{os.getpid()} "):
        with hold(workdir, REFRESHER):  # but not beside another refresher
          pass
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  with hold(workdir):  # the kernel released the dead holder's lock
    with pytest.raises(WorkdirInUseError, match=rf"process {os.getpid()} "):
      with hold(workdir):
        pass
  with hold(workdir):  # and this process's, at the end of the block
    pass


def lease(workdir, **timing):
  return Lease(str(workdir), **{"beat_s": 0.1, "expire_s": 1.0, "settle_s": 0.05, **timing})


def test_a_lease_refuses_a_live_holder_and_is_free_once_released(tmp_path):
  first = lease(tmp_path)
  first.acquire()
  try:
    # Refused on seeing a renewal, not by waiting the holder out: after expire_s unrenewed, it
    # would take the lease over instead (no error), so a minute that no run here waits.
    second = lease(tmp_path, expire_s=60.0)
    with pytest.raises(WorkdirInUseError, match=rf"process {os.getpid()} on "):
      second.acquire()
  finally:
    first.release()
  assert not os.path.exists(workdir_lock.lock_path(str(tmp_path)))
  second.acquire()
  second.release()


def test_a_lease_nobody_renews_is_taken_over(tmp_path, caplog):
  """What a run killed on gs:// leaves: its lease, never renewed again."""
  dead = {"lock": "run", "pid": 123, "host": "gone", "started": "then", "command": "x",
          "token": "t", "beat": 7}
  path = workdir_lock.lock_path(str(tmp_path))
  with open(path, "w") as f:
    json.dump(dead, f)
  taker = lease(tmp_path, expire_s=0.5)
  start = time.monotonic()
  taker.acquire()
  try:
    assert time.monotonic() - start >= 0.5
    assert "was not renewed for" in caplog.text and "taking it over" in caplog.text
    with open(path) as f:
      assert json.load(f)["token"] == taker.me["token"]
  finally:
    taker.release()


def test_a_refused_run_leaves_nothing_in_a_directory_it_made(tmp_path):
  """A block that raises in a directory `hold` made (a run refused) leaves neither the lock file
  nor the directory, nested holds included (a work directory and its chunk database); what a
  block wrote stays, the lock file going; a directory that was there keeps its lock file."""
  workdir = tmp_path / "w"
  with pytest.raises(ValueError, match="refused"):
    with hold(str(workdir)):
      with hold(str(workdir / "db"), workdir_lock.DATABASE):
        raise ValueError("refused")
  assert not workdir.exists()
  with pytest.raises(ValueError):
    with hold(str(workdir)):
      (workdir / "config.json").write_text("{}")
      raise ValueError("refused")
  assert sorted(os.listdir(workdir)) == ["config.json"]
  with pytest.raises(ValueError):
    with hold(str(workdir)):
      raise ValueError("refused")
  assert sorted(os.listdir(workdir)) == ["config.json", "run.lock"]
  with hold(str(workdir)):  # the next run takes the lock as ever
    pass


def test_a_lock_file_deleted_while_another_process_opened_it_is_opened_again(tmp_path,
                                                                          monkeypatch):
  """The holder of a directory it made deletes its lock file when refused: a process that opened
  the file just before and gets the lock once it is released must not hold the deleted file (a
  third process would lock the new one beside it): it opens the file at the path again."""
  workdir = str(tmp_path / "w")
  os.makedirs(workdir)
  first = workdir_lock.FileLock(workdir)
  first.acquire()
  opens = []
  real_open = os.open

  def open_then_release(path, *args):
    fd = real_open(path, *args)
    opens.append(path)
    if len(opens) == 1:  # the second process opened the file; the first deletes it, done
      first.remove()
    return fd

  monkeypatch.setattr(os, "open", open_then_release)
  second = workdir_lock.FileLock(workdir)
  second.acquire()
  monkeypatch.undo()
  try:
    assert opens == [second.path, second.path]
    with pytest.raises(WorkdirInUseError, match=rf"process {os.getpid()} "):
      workdir_lock.FileLock(workdir).acquire()
  finally:
    second.release()
