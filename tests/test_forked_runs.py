"""The tests' forked experiment runs (tests/forked_runs.py) give what subprocess gives for the same
command: exit status, standard output and error apart, the working directory and environment,
signals, and output into a file."""

import os
import signal
import subprocess
import sys
import time

import forked_runs
import pytest
from conftest import ROOT, one_device_env

ESTIMATE = "realm_jax/configs/pretrain.py:tiny"
CASES = {
    # (exit 0, the estimate on stdout)
    "prints": ["experiments/memory_estimate.py", f"--config={ESTIMATE}", "--devices=2",
               "--index_rows=100", "--capacity_gib=16"],
    # (exit 2, one error line on stderr)
    "refuses": ["experiments/memory_estimate.py", f"--config={ESTIMATE}", "--devices=-4"],
    # (exit 2, the flag named)
    "unknown flag": ["experiments/memory_estimate.py", "--no_such_flag=1"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_forked_run_gives_what_a_subprocess_gives(name):
  cmd = [sys.executable, *CASES[name]]
  forked = forked_runs.run(cmd, cwd=ROOT, env=one_device_env(), capture_output=True, text=True,
                           timeout=300)
  plain = subprocess.run(cmd, cwd=ROOT, env=one_device_env(), capture_output=True, text=True,
                         timeout=300)
  assert forked.returncode == plain.returncode, (forked.stderr[-2000:], plain.stderr[-2000:])
  assert forked.returncode == (0 if name == "prints" else 2)
  assert forked.stdout == plain.stdout
  # (what the imports log goes to a plain run's stderr only: the server made them)
  assert [l for l in forked.stderr.splitlines() if l.startswith("error:")] == [
      l for l in plain.stderr.splitlines() if l.startswith("error:")]
  if name == "prints":
    assert "total" in forked.stdout and "error" not in forked.stderr


def test_a_forked_run_has_its_cwd_and_file_and_dies_of_the_signal_sent(tmp_path):
  """The run works in the directory given, writes into the file given, and SIGKILL ends it with
  -9, as a subprocess. (The environment given, REALM_* and the fake devices of XLA_FLAGS, is
  what test_multihost.py's forked runs report: "2 local / 4 global devices".)"""
  log = tmp_path / "log.txt"
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "refresh_index.py"),
         f"--config={ROOT}/realm_jax/configs/pretrain.py:tiny", "--workdir=w", "--poll_seconds=0.1"]
  with open(log, "w") as out:
    proc = forked_runs.Popen(cmd, cwd=str(tmp_path), env=one_device_env(), stdout=out,
                             stderr=subprocess.STDOUT)
  assert not isinstance(proc, subprocess.Popen) and proc.poll() is None
  deadline = time.time() + 120
  while "waiting up to" not in log.read_text():  # for a trainer's config.json
    assert proc.poll() is None and time.time() < deadline, log.read_text()[-2000:]
    time.sleep(0.1)
  assert os.readlink(f"/proc/{proc.pid}/cwd") == str(tmp_path)
  proc.send_signal(signal.SIGKILL)
  assert proc.wait(timeout=60) == -signal.SIGKILL == proc.poll()
