"""Runs entry points as `python experiments/<script>.py <args>` runs them, each case in a child
forked from this process after the imports at the top of the scripts: the ~1 s that every run of
a script spends starting Python and importing JAX is paid once, not once per case
(tests/test_cli.py, whose cases fail before any expensive work).

  python tests/cli_forks.py [children at a time] < cases.json > answers.json

cases.json: [[script, [arg, ...]], ...]; answers.json: [[returncode, stdout, stderr], ...], in
the same order. Run it from the repository root, in the environment the scripts should see; from
a test, `run_forked(cases, env)` does.
"""

import ast
import atexit
import gc
import json
import os
import runpy
import subprocess
import sys
import tempfile
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARALLEL = 2  # children at a time (the cores of the machine the suite is sized for)


def collect_less_often() -> None:
  """Python's cyclic garbage collector set for a process that imports JAX and then traces many
  programs: the young generations collected ~30x less often. Call it before the imports, and
  `freeze_imports` after them. tests/test_retro_model.py under `perf`: the collector's share of
  the CPU 1.7% instead of 5.8%; collecting the suite's tests 4.6-4.8 instead of 6.8 CPU-seconds
  (docs/notes.md, 2026-12-01)."""
  gc.set_threshold(20000, 20, 20)


def freeze_imports() -> None:
  """What the imports made, never traversed by the collector again."""
  gc.collect()
  gc.freeze()


def _script(name: str) -> str:
  return os.path.join(ROOT, "experiments", f"{name}.py")


def import_what_scripts_import(names) -> None:
  """Runs the module-level import statements of each script (those it runs first anyway)."""
  for name in sorted(set(names)):
    with open(_script(name)) as f:
      tree = ast.parse(f.read())
    imports = [s for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom))]
    exec(compile(ast.Module(body=imports, type_ignores=[]), _script(name), "exec"), {})


def _exit_status(e: SystemExit) -> int:
  """The status the interpreter exits with for an uncaught SystemExit."""
  if e.code is None or isinstance(e.code, int):
    return e.code or 0
  print(e.code, file=sys.stderr)
  return 1


def run_in_child(name: str, argv: list[str], out: int, err: int) -> None:
  """In a forked child: runs experiments/<name>.py as __main__ with `argv`, its stdin empty and
  its output going to the file descriptors `out` and `err`, then exits as the interpreter would
  (a traceback and status 1 for an uncaught exception)."""
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  os.dup2(out, 1)
  os.dup2(err, 2)
  sys.argv = argv
  sys.path[0] = os.path.dirname(_script(name))
  status = 0
  try:
    runpy.run_path(_script(name), run_name="__main__")
  except SystemExit as e:
    status = _exit_status(e)
  except BaseException:  # noqa: BLE001 (what the interpreter prints for it)
    traceback.print_exc()
    status = 1
  try:
    atexit._run_exitfuncs()  # pylint: disable=protected-access
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_cases(cases, parallel: int = PARALLEL) -> list:
  """[(returncode, stdout, stderr)] of each (script, args), `parallel` children at a time."""
  files = [(tempfile.TemporaryFile(), tempfile.TemporaryFile()) for _ in cases]
  running, statuses = {}, [None] * len(cases)

  def reap():
    pid, wait_status = os.wait()
    statuses[running.pop(pid)] = os.waitstatus_to_exitcode(wait_status)

  for i, (name, args) in enumerate(cases):
    while len(running) >= parallel:
      reap()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      run_in_child(name, [os.path.join("experiments", f"{name}.py"), *args],
                   files[i][0].fileno(), files[i][1].fileno())
    running[pid] = i
  while running:
    reap()
  answers = []
  for status, (out, err) in zip(statuses, files):
    out.seek(0)
    err.seek(0)
    answers.append((status, out.read().decode(errors="replace"),
                    err.read().decode(errors="replace")))
  return answers


def run_forked(cases, env: dict, parallel: int = PARALLEL) -> list:
  """[CompletedProcess] of each (script, args), run by this file in one process started with
  `env` (cases that must not overlap, such as two runs on one work directory: parallel=1)."""
  got = subprocess.run([sys.executable, __file__, str(parallel)], input=json.dumps(cases),
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert got.returncode == 0, got.stderr[-5000:]
  return [subprocess.CompletedProcess([script, *args], *answer)
          for (script, args), answer in zip(cases, json.loads(got.stdout))]


if __name__ == "__main__":
  todo = json.load(sys.stdin)
  import_what_scripts_import(name for name, _ in todo)
  json.dump(run_cases(todo, int(sys.argv[1]) if len(sys.argv) > 1 else PARALLEL), sys.stdout)
