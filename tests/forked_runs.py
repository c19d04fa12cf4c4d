"""Experiment runs for the tests, each forked from a server process that has already imported what
the scripts import: starting Python and importing JAX, flax, orbax, grain, TFDS and matplotlib
(~2-3 CPU-seconds) is paid once per pytest worker instead of once per run. On the ten test files
that start runs: 986 against 1,058 CPU-seconds, 531 against 554 s of wall (docs/notes.md,
2026-11-30).

    proc = forked_runs.Popen([sys.executable, "experiments/pretrain.py", ...], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

`Popen` and `run` take subprocess's arguments and give what subprocess gives (pid, poll, wait,
communicate, send_signal, kill, returncode, stdout); a command that is not
`python experiments/<script>.py ...`, or `REALM_TESTS_NO_FORK=1` in the environment, goes to
subprocess itself. The child is the process that runs: its pid is the run's, signals reach it,
its exit status is the run's (negative for a signal). It starts with the requested working
directory, environment (XLA reads XLA_FLAGS, the fake devices, only when the child first uses
it) and standard streams, and runs the script as `python` would run it.

One server per environment, not counting XLA_FLAGS, PYTEST_CURRENT_TEST and REALM_* (read by
the child, not at import); it is started on first use, forks only from its single thread, and,
told to stop or left by the process that started it (its stdin closes), takes no more runs and
exits when those it started have ended.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from cli_forks import (ROOT, collect_less_often, freeze_imports, import_what_scripts_import,
                       run_in_child)

# Read by the child only (XLA reads its flags when the child first uses it; pytest names the
# running test); and every REALM_* variable.
_CHILD_ENV = ("XLA_FLAGS", "PYTEST_CURRENT_TEST")
_MAX_SERVERS = 3
_LOCK = threading.Lock()
_SERVERS: dict = {}  # import-time environment -> (server process, socket path)
_RETIRED: list = []  # (server process, socket path) told to stop


def _script_of(cmd) -> str | None:
  """experiments/<name>.py's name when `cmd` is `python experiments/<name>.py ...`, else None."""
  if len(cmd) < 2 or cmd[0] != sys.executable:
    return None
  path = os.path.normpath(os.path.join(ROOT, cmd[1]))
  name = os.path.basename(path)
  if os.path.dirname(path) != os.path.join(ROOT, "experiments") or not name.endswith(".py"):
    return None
  return name[:-3]


def _import_env(env: dict) -> tuple:
  return tuple(sorted((k, v) for k, v in env.items()
                      if k not in _CHILD_ENV and not k.startswith("REALM_")))


def _server(env: dict) -> str:
  """The socket path of the server for `env`'s import-time variables, started if need be."""
  key = _import_env(env)
  with _LOCK:
    proc, path = _SERVERS.get(key, (None, None))
    if proc is None or proc.poll() is not None:
      while len(_SERVERS) >= _MAX_SERVERS:  # the oldest goes once its runs have ended
        _retire(*_SERVERS.pop(next(iter(_SERVERS))))
      path = os.path.join(tempfile.mkdtemp(prefix="realm_jax-forks-"), "socket")
      proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), path], cwd=ROOT,
                              env=dict(key), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
      ready = proc.stdout.readline()
      assert ready == b"ready\n", f"the fork server did not start: {ready!r}"
      _SERVERS[key] = proc, path
    return path


def _retire(proc, path: str) -> None:
  """Tells a server to stop: it takes no more runs and exits when its runs have ended."""
  proc.stdin.close()
  _RETIRED.append((proc, path))


def stop_servers() -> None:
  """Every server stopped and waited for (conftest.py, at the session's end), so that its runs'
  CPU time is counted in this process's children's, as a subprocess's is."""
  with _LOCK:
    while _SERVERS:
      _retire(*_SERVERS.pop(next(iter(_SERVERS))))
    while _RETIRED:
      proc, path = _RETIRED.pop()
      proc.wait(timeout=600)
      shutil.rmtree(os.path.dirname(path), ignore_errors=True)


class _Forked:
  """What subprocess.Popen gives, for a run forked by the server."""

  def __init__(self, args, pid: int, conn: socket.socket, stdout, stderr, text: bool):
    self.args, self.pid, self._conn, self.stdout, self.stderr = args, pid, conn, stdout, stderr
    self.returncode, self._text = None, text

  def _collect(self, timeout):
    if self.returncode is None and select.select([self._conn], [], [], timeout)[0]:
      msg = self._conn.recv(64)
      assert msg, "the fork server went away"
      self.returncode = int(msg)
      self._conn.close()
    return self.returncode

  def poll(self):
    return self._collect(0)

  def wait(self, timeout=None):
    if self._collect(timeout) is None:
      raise subprocess.TimeoutExpired(self.args, timeout)
    return self.returncode

  def communicate(self, input=None, timeout=None):  # noqa: A002 (subprocess's name)
    """(stdout, stderr) read to their ends (None where not piped), then the exit status."""
    assert input is None, "runs read no input"
    deadline = None if timeout is None else time.monotonic() + timeout
    files = [f for f in (self.stdout, self.stderr) if f is not None and not f.closed]
    pipes = {f.fileno(): f for f in files}
    got = {f: [] for f in files}
    while pipes:
      left = None if deadline is None else max(0.0, deadline - time.monotonic())
      ready = select.select(list(pipes), [], [], left)[0]
      if not ready:
        raise subprocess.TimeoutExpired(self.args, timeout)
      for fd in ready:
        chunk = os.read(fd, 1 << 16)
        if chunk:
          got[pipes[fd]].append(chunk)
        else:
          pipes.pop(fd).close()
    out = []
    for f in (self.stdout, self.stderr):
      raw = None if f is None else b"".join(got.get(f, []))
      out.append(raw.decode(errors="replace") if raw is not None and self._text else raw)
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    self.wait(left)
    return tuple(out)

  def send_signal(self, sig):
    if self.returncode is None and self.poll() is None:
      os.kill(self.pid, sig)

  def kill(self):
    self.send_signal(signal.SIGKILL)

  def terminate(self):
    self.send_signal(signal.SIGTERM)


def _fd_for(stream, inherited: int, stdout_fd: int | None = None) -> tuple:
  """(the file descriptor the child gets for `stream`: subprocess's PIPE, STDOUT, DEVNULL, None or
  a file; the read end of its pipe or None; whether this process closes it once it is sent)."""
  if stream is None:
    return inherited, None, False
  if stream == subprocess.STDOUT:
    return stdout_fd, None, False
  if stream == subprocess.DEVNULL:
    return os.open(os.devnull, os.O_WRONLY), None, True
  if stream == subprocess.PIPE:
    read_end, write_end = os.pipe()
    return write_end, read_end, True
  return stream.fileno(), None, False


def Popen(cmd, cwd=None, env=None, stdout=None, stderr=None, text=False, **kwargs):  # noqa: N802
  """subprocess.Popen(cmd, ...), the run forked by the server when `cmd` runs an experiment."""
  env = dict(os.environ if env is None else env)
  name = _script_of(cmd)
  streams = (None, subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL)
  if (name is None or kwargs or env.get("REALM_TESTS_NO_FORK") == "1"
      or not all(s in streams or hasattr(s, "fileno") for s in (stdout, stderr))):
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text,
                            **kwargs)
  out_fd, out_read, close_out = _fd_for(stdout, 1)
  err_fd, err_read, close_err = _fd_for(stderr, 2, stdout_fd=out_fd)
  conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
  try:
    conn.connect(_server(env))
    request = {"script": name, "argv": list(cmd[1:]), "cwd": os.path.abspath(cwd or os.getcwd()),
               "env": env}
    socket.send_fds(conn, [json.dumps(request).encode()], [out_fd, err_fd])
    pid = int(conn.recv(64))
  finally:
    for fd, close in ((out_fd, close_out), (err_fd, close_err)):
      if close:
        os.close(fd)
  reader = lambda fd: (None if fd is None else os.fdopen(fd, "r", errors="replace") if text
                       else os.fdopen(fd, "rb"))
  return _Forked(cmd, pid, conn, reader(out_read), reader(err_read), text)


def run(cmd, cwd=None, env=None, capture_output=False, text=False, timeout=None, check=False,
        stdout=None, stderr=None):
  """subprocess.run(cmd, ...), forked as Popen."""
  if capture_output:
    stdout, stderr = subprocess.PIPE, subprocess.PIPE
  proc = Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text)
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
    raise
  got = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
  if check:
    got.check_returncode()
  return got


# ------------------------------------------------------------------------------------ the server
def _child(request: dict, fds: list, others: list) -> None:
  """In the forked child: the run, as `python experiments/<script>.py <args>` runs it."""
  signal.signal(signal.SIGCHLD, signal.SIG_DFL)
  signal.set_wakeup_fd(-1)
  for s in others:
    s.close()
  os.chdir(request["cwd"])
  os.environ.clear()
  os.environ.update(request["env"])
  run_in_child(request["script"], request["argv"], *fds)


def _report(conn: socket.socket, wait_status: int) -> None:
  """Sends a run's exit status to the connection that started it (gone: nobody waits)."""
  try:
    conn.send(str(os.waitstatus_to_exitcode(wait_status)).encode())
  except OSError:
    pass
  conn.close()


def serve(path: str) -> None:
  """Imports what the scripts import, then forks a child per request until stdin closes."""
  collect_less_often()  # (the runs forked from here inherit it)
  import_what_scripts_import(n[:-3] for n in os.listdir(os.path.join(ROOT, "experiments"))
                             if n.endswith(".py"))
  # Imported inside the runs, not at the top of the scripts.
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot  # noqa: F401
  import orbax.checkpoint  # noqa: F401
  from jax._src import xla_bridge
  assert not xla_bridge._backends, "an import started JAX's backend: forks would share it"  # pylint: disable=protected-access
  freeze_imports()
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
  listener.bind(path)
  listener.listen(16)
  wake_r, wake_w = os.pipe()
  os.set_blocking(wake_w, False)
  signal.set_wakeup_fd(wake_w)
  signal.signal(signal.SIGCHLD, lambda *_: None)
  sys.stdout.write("ready\n")
  sys.stdout.flush()
  running: dict[int, socket.socket] = {}
  while True:
    ready = select.select([listener, wake_r, sys.stdin], [], [])[0]
    if wake_r in ready:
      os.read(wake_r, 4096)
    while running:
      pid, status = os.waitpid(-1, os.WNOHANG)
      if pid == 0:
        break
      _report(running.pop(pid), status)
    if sys.stdin in ready and not sys.stdin.buffer.read1(4096):
      for pid, conn in running.items():  # the runs still going end as they would
        _report(conn, os.waitpid(pid, 0)[1])
      return
    if listener in ready:
      conn, _ = listener.accept()
      msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
      pid = os.fork()
      if pid == 0:
        _child(json.loads(msg), fds, [listener, conn, *running.values()])
      for fd in fds:
        os.close(fd)
      conn.send(str(pid).encode())
      running[pid] = conn


if __name__ == "__main__":
  serve(sys.argv[1])
