"""The README and docs/*.md stay a short, correct map of the project: the README is short and free
of commit hashes (history lives in docs/notes.md), every relative link (and its #anchor) resolves,
every script, flagfile and config a command names exists (configs: `get_config(variant)`
returns), and every `python experiments/<x>.py ...` (or benchmarks/) command of a ```bash block
parses: its script reads its flags as it would for the user, up to where its main would start
(`python tests/test_docs.py < commands.json` is that dry run): one process, each script in a
child forked after the imports they share.
"""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted([README, *(ROOT / "docs").glob("*.md")])
README_MAX_LINES = 220

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HASH = re.compile(r"\b[0-9a-f]{7,40}\b")
_SCRIPT = re.compile(r"\b((?:experiments|benchmarks)/[\w./-]*?\.py)\b")
_FLAGFILE = re.compile(r"\b(experiments/flags/[\w.-]+\.flags)\b")
_CONFIG = re.compile(r"--config=(realm_jax/configs/[\w]+\.py)(?::(\w+(?:\.\w+)*))?")


def _rel(path: Path) -> str:
  return str(path.relative_to(ROOT))


def _outside_code(text: str) -> str:
  """The text without its fenced code blocks (links and headings there are not markdown)."""
  lines, fenced = [], False
  for line in text.splitlines():
    if _FENCE.match(line.strip()):
      fenced = not fenced
      continue
    if not fenced:
      lines.append(line)
  return "\n".join(lines)


def _slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
  text = re.sub(r"`|\*\*|__", "", heading.strip().lower())
  kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
  return kept.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
  seen: dict[str, int] = {}
  anchors = set()
  for line in _outside_code(path.read_text(encoding="utf-8")).splitlines():
    m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
    if not m:
      continue
    slug = _slug(m.group(1))
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    anchors.add(slug if n == 0 else f"{slug}-{n}")
  return anchors


def _commit_hashes(text: str) -> list[str]:
  """As `grep -oE '\\b[0-9a-f]{7,40}\\b' | grep -E '[a-f]' | grep -E '[0-9]'`."""
  return [w for w in _HASH.findall(text) if re.search("[a-f]", w) and re.search("[0-9]", w)]


def test_hash_check_itself():
  assert _commit_hashes("at 2e172ea and deadbeef1, not 1234567 or abcdefa") == [
      "2e172ea", "deadbeef1"]
  assert _slug("Your own corpus, and retrieval recall") == "your-own-corpus-and-retrieval-recall"
  assert _slug("Top-k search: numpy vs realm_jax exact / approx vs ScaNN") == (
      "top-k-search-numpy-vs-realm_jax-exact--approx-vs-scann")


def test_readme_is_short_and_has_no_commit_hashes():
  text = README.read_text(encoding="utf-8")
  n = len(text.splitlines())
  assert n <= README_MAX_LINES, (
      f"README.md has {n} lines (at most {README_MAX_LINES}): move detail to docs/")
  assert _commit_hashes(text) == [], "README.md names commits: history goes to docs/notes.md"


def test_readme_starts_with_the_two_commands():
  """.ci/run and users copy the first bash block: two `python3 -m venv .venv && ...` lines."""
  lines = README.read_text(encoding="utf-8").splitlines()
  assert lines[0].startswith("# ")
  assert lines[2] == "```bash" and lines[5] == "```"
  prefix = "python3 -m venv .venv && .venv/bin/pip install -e '.["
  assert all(line.startswith(prefix) for line in lines[3:5])
  ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
  assert lines[4] in ci.splitlines()


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_relative_links_resolve(doc):
  broken = []
  for target in _LINK.findall(_outside_code(doc.read_text(encoding="utf-8"))):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
      continue
    path_part, _, anchor = target.partition("#")
    dest = (doc.parent / path_part).resolve() if path_part else doc
    if not dest.exists():
      broken.append(f"{target}: no {dest}")
    elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
      broken.append(f"{target}: no heading #{anchor} in {_rel(dest)}")
  assert not broken, f"{_rel(doc)}: " + "; ".join(broken)


def _load_config_module(path: Path):
  spec = importlib.util.spec_from_file_location(f"_docs_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_named_scripts_flagfiles_and_configs_exist(doc):
  text = doc.read_text(encoding="utf-8")
  missing = [s for s in sorted(set(_SCRIPT.findall(text))) if not (ROOT / s).is_file()]
  flagfiles = sorted(set(_FLAGFILE.findall(text)))
  missing += [f for f in flagfiles if not (ROOT / f).is_file()]
  assert not missing, f"{_rel(doc)} names files that do not exist: {missing}"

  configs = set(_CONFIG.findall(text))
  for f in flagfiles:   # the configs the named flagfiles use
    configs |= set(_CONFIG.findall((ROOT / f).read_text(encoding="utf-8")))
  for path, variant in sorted(configs):
    assert (ROOT / path).is_file(), f"{_rel(doc)} names {path}, which does not exist"
    module = _load_config_module(ROOT / path)
    config = module.get_config(variant) if variant else module.get_config()
    assert config is not None, f"{path}:{variant}"


# ---------------------------------------------------------------------------------------------
# Every documented command parses.
# ---------------------------------------------------------------------------------------------

_ENTRY_POINT = re.compile(r"^(?:experiments|benchmarks)/\w+\.py$")
_VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)\}")
_ASSIGNMENT = re.compile(r"^([A-Za-z_]\w*)=(.*)$")
_SEPARATORS = {"&&", "||", ";", "|", "&"}


def bash_commands(text: str) -> list[tuple[int, list[str]]]:
  """[(line, argv)] for each `python <experiments|benchmarks>/<x>.py ...` in the ```bash blocks of
  a markdown text: continuation lines joined, comments dropped, `&&` chains split, and shell
  variables set earlier in the block (`F=...` alone on a line) substituted; argv[0] is the
  script."""
  found, block, pending, start = [], None, "", 0
  for number, line in enumerate(text.splitlines(), 1):
    if line.strip().startswith("```"):
      block = line.strip()[3:].strip() if block is None else None
      variables = {}
      continue
    if block != "bash":
      continue
    if not pending:
      start = number
    if line.rstrip().endswith("\\"):
      pending += line.rstrip()[:-1] + " "
      continue
    line, pending = pending + line, ""
    line = _VARIABLE.sub(lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), line)
    tokens = shlex.split(line, comments=True)
    if len(tokens) == 1 and _ASSIGNMENT.match(tokens[0]):
      name, value = _ASSIGNMENT.match(tokens[0]).groups()
      variables[name] = value
      continue
    command = []
    for token in tokens + [";"]:
      if token not in _SEPARATORS:
        command.append(token)
        continue
      for i, word in enumerate(command[1:], 1):
        if _ENTRY_POINT.match(word) and os.path.basename(command[i - 1]) in ("python", "python3"):
          found.append((start, command[i:]))
          break
      command = []
  return found


def _doc_commands() -> list[tuple[str, int, list[str]]]:
  return [(_rel(doc), line, argv) for doc in DOCS
          for line, argv in bash_commands(doc.read_text(encoding="utf-8"))]


COMMANDS = _doc_commands()
# Mistakes the check must catch (else it could pass by parsing nothing): (argv, what the error
# says).
_DEMO = ["experiments/pretrain.py", "--flagfile=experiments/flags/pretrain_demo.flags"]
MISTAKES = [
    ([*_DEMO, "--config.no_such_setting=1"], "no_such_setting"),
    ([*_DEMO, "--workdirr=work/x"], "workdirr"),
    ([*_DEMO, "--config.num_steps=many"], "invalid literal for int()"),
    ([*_DEMO, "stray words"], "unexpected arguments"),
]


def dry_run(script: str, argvs: list[list[str]]) -> None:
  """Parses each argv (argv[0] is `script`) as the script would, stopping where its main would
  start: for absl entry points, `cli.run` / `app.run` with every flag check (unknown flags,
  `--config.<key>` overrides the config lacks, values that do not parse, stray arguments); for
  argparse ones, `parse_args`. Prints one `dry-run: {"status": exit status, "output": ...}` line
  per argv. The script is loaded (its imports, its flag definitions) once; each argv is parsed in
  a forked child, since absl flags (and the `--config.*` flags ml_collections defines while
  parsing) are parsed once per process. A script with neither takes no flags: it is not run."""
  if not re.search(r"\b(cli\.run|app\.run|ArgumentParser)\(", (ROOT / script).read_text()):
    for argv in argvs:
      status, output = (0, "") if len(argv) == 1 else (2, f"{script} takes no flags: {argv[1:]}")
      print("dry-run:", json.dumps({"status": status, "output": output}), flush=True)
    return
  import argparse
  import runpy
  import tempfile
  import traceback

  from absl import app

  from realm_jax import cli

  class Parsed(Exception):
    pass

  real_app_run, real_cli_run = app.run, cli.run
  real_parse_args = argparse.ArgumentParser.parse_args
  started = []

  def parse_only(self, *args, **kwargs):
    real_parse_args(self, *args, **kwargs)
    raise Parsed

  argparse.ArgumentParser.parse_args = parse_only
  cli.run = lambda main, *a, **kw: started.append(lambda: real_cli_run(lambda argv: None, *a, **kw))
  app.run = lambda main, *a, **kw: started.append(lambda: real_app_run(lambda argv: None, *a, **kw))
  sys.argv = [script]
  try:
    runpy.run_path(script, run_name="__main__")  # defines the flags; absl parses nothing yet
  except (Parsed, SystemExit):
    pass
  app.run = real_app_run
  for argv in argvs:
    with tempfile.TemporaryFile("w+") as out:
      sys.stdout.flush()
      pid = os.fork()
      if pid == 0:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        status = 1
        try:
          sys.argv = argv
          if started:
            started[0]()
          else:
            runpy.run_path(script, run_name="__main__")
          status = 0
        except Parsed:
          status = 0
        except SystemExit as e:
          status = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:  # noqa: B036  a bug, not a user's mistake: its traceback is shown
          traceback.print_exc()
        finally:
          sys.stdout.flush()
          sys.stderr.flush()
          os._exit(status)
      _, wait = os.waitpid(pid, 0)
      out.seek(0)
      print("dry-run:", json.dumps({"status": os.waitstatus_to_exitcode(wait),
                                    "output": out.read()}), flush=True)


def dry_run_all(todo: dict[str, list[list[str]]]) -> dict[str, list[tuple[int, str]]]:
  """{script: [(exit status, output) of each argv]}: `dry_run` of each script in a child forked
  from this process, two at a time, once this process has run the scripts' module-level imports
  (JAX, Flax, TFDS, ...): starting Python and importing those (~7 s on 2 busy cores) is paid once,
  not once per script. A script that does not load gets -1 and its error for each argv."""
  import ast
  import tempfile
  for script in todo:
    try:  # (a script that is not there, or whose imports fail: its own child reports it)
      for node in ast.parse((ROOT / script).read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
          exec(compile(ast.Module(body=[node], type_ignores=[]), script, "exec"), {})
    except Exception:  # noqa: BLE001
      pass
  files = {script: tempfile.TemporaryFile() for script in todo}
  running, status = {}, {}
  for script, argvs in todo.items():
    while len(running) >= 2:
      pid, wait = os.wait()
      status[running.pop(pid)] = os.waitstatus_to_exitcode(wait)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      os.dup2(files[script].fileno(), 1)
      os.dup2(files[script].fileno(), 2)
      code = 1
      try:
        dry_run(script, argvs)
        code = 0
      except BaseException:  # noqa: B036  the script does not load: shown as its output
        import traceback
        traceback.print_exc()
      finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    running[pid] = script
  while running:
    pid, wait = os.wait()
    status[running.pop(pid)] = os.waitstatus_to_exitcode(wait)
  out = {}
  for script, argvs in todo.items():
    files[script].seek(0)
    text = files[script].read().decode(errors="replace")
    results = [json.loads(line.removeprefix("dry-run: "))
               for line in text.splitlines() if line.startswith("dry-run: ")]
    if status[script] != 0 or len(results) != len(argvs):
      out[script] = [(-1, f"the dry run of {script} failed:\n{text[-3000:]}")] * len(argvs)
    else:
      out[script] = [(r["status"], r["output"]) for r in results]
  return out


@pytest.fixture(scope="module")
def parsed() -> dict[tuple[str, ...], tuple[int, str]]:
  """{argv: (exit status, output)} for every documented command and every mistake in MISTAKES,
  all in one process (`python tests/test_docs.py < commands.json`: dry_run_all; an exit status of
  -1: the script did not load)."""
  by_script: dict[str, list[list[str]]] = {}
  for argv in [argv for _, _, argv in COMMANDS] + [argv for argv, _ in MISTAKES]:
    by_script.setdefault(argv[0], []).append(argv)
  got = subprocess.run([sys.executable, __file__], input=json.dumps(by_script), cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
  assert got.returncode == 0, got.stderr[-5000:]
  results = json.loads(got.stdout.splitlines()[-1])
  return {tuple(argv): tuple(result) for s, argvs in by_script.items()
          for argv, result in zip(argvs, results[s])}


def test_commands_are_found():
  text = "\n".join([
      "```bash",
      "F=experiments/flags/x.flags   # a flagfile",
      "python3 -m venv .venv && .venv/bin/python experiments/a.py --flagfile=$F  # comment",
      ".venv/bin/python benchmarks/b.py --n=2 \\",
      "    --q='who, then' | tail -3",
      "python experiments/c.py",
      "```",
      "python experiments/outside_a_block.py",
      "```python",
      "python experiments/not_bash.py",
      "```",
  ])
  assert bash_commands(text) == [
      (3, ["experiments/a.py", "--flagfile=experiments/flags/x.flags"]),
      (4, ["benchmarks/b.py", "--n=2", "--q=who, then"]),
      (6, ["experiments/c.py"])]
  scripts = {argv[0] for _, _, argv in COMMANDS}
  assert {"experiments/pretrain.py", "experiments/finetune.py"} <= scripts, scripts


@pytest.mark.parametrize("argv,says", MISTAKES, ids=[m[0][-1] for m in MISTAKES])
def test_the_command_check_catches_mistakes(parsed, argv, says):
  status, output = parsed[tuple(argv)]
  assert status == 2 and says in output, (status, output[-2000:])


@pytest.mark.parametrize("doc,line,argv", COMMANDS, ids=[f"{d}:{n}" for d, n, _ in COMMANDS])
def test_documented_commands_parse(parsed, doc, line, argv):
  status, output = parsed[tuple(argv)]
  assert status == 0, (
      f"{doc}:{line}: `python {shlex.join(argv)}` does not parse (exit status {status}); fix the "
      f"command or the script's flags:\n{output[-2000:]}")


if __name__ == "__main__":
  # python tests/test_docs.py < {script: [argv, ...]}.json: see dry_run_all.
  _results = dry_run_all(json.load(sys.stdin))
  print(json.dumps(_results), flush=True)
