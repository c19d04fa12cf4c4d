"""Layers import downward only (STYLE.md rule 12): text/models -> data/retrieval/systems ->
train/eval -> experiments. Every module under realm_jax/ is parsed with `ast` (imports at the top
and inside functions, `import x`, `from x import y`, relative imports) and checked against the
rules below. Reads files only; well under a second.
"""

import ast
import fnmatch
import gc
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "realm_jax"

# The trainers: one module per kind of training, each run by an entry point in experiments/. A new
# kind of training (e.g. a retro-fitting trainer, train/retro*.py) is a trainer too. A trainer never
# imports another (what two of them share lives below both), and nothing in realm_jax/ imports one:
# only experiments/, benchmarks/ and tests/ do.
TRAINERS = ("realm_jax.train.pretrain", "realm_jax.train.ict", "realm_jax.train.dpr",
            "realm_jax.train.finetune",
            "realm_jax.train.retro*")

# (importing packages, packages they may not import, the rule): a module is in a package when its
# dotted name is the package's or starts with it and a dot. A package that does not exist (yet)
# matches nothing.
_LOW = ("realm_jax.data", "realm_jax.text", "realm_jax.models", "realm_jax.retrieval",
        "realm_jax.systems")
_BOTTOM = ("realm_jax.models", "realm_jax.text")
_LAYER_RULES = (
    (_LOW, ("realm_jax.eval", "realm_jax.train"),
     "data/, text/, models/, retrieval/ and systems/ sit below eval/ and train/ and import "
     "nothing from them: move what both need down"),
    (_BOTTOM, ("realm_jax.data", "realm_jax.retrieval", "realm_jax.systems", "realm_jax.eval",
               "realm_jax.train"),
     "models/ and text/ are the bottom layer and import nothing from data/, retrieval/, systems/, "
     "eval/ or train/"),
)
_TRAINER_RULE = ("a trainer never imports another trainer: what two of them share lives below both "
                 "(realm_jax/train/<shared>.py, or data/, retrieval/, models/)")
_USER_RULE = ("nothing in realm_jax/ imports a trainer (only experiments/, benchmarks/ and tests/ "
              "may): what it needs from the trainer belongs below it")


def _module_name(path: Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def package_modules() -> dict[str, Path]:
  """{dotted module name: file} for every module under realm_jax/."""
  return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _parse(source: str) -> ast.AST:
  """ast.parse with the garbage collector held off: CPython 3.11 fails the parse with "AST
  constructor recursion depth mismatch" when a collection runs a finaliser in the middle of it
  (orbax's unawaited reads of the damaged-checkpoint tests, once, in a fresh clone)."""
  enabled = gc.isenabled()
  gc.disable()
  try:
    return ast.parse(source)
  finally:
    if enabled:
      gc.enable()


def imported_modules(source: str, module: str, is_package: bool,
                     known: set[str]) -> list[tuple[int, str]]:
  """[(line, dotted module)] for every import in `source`, the code of `module`.

  `from x import y` imports module x.y when that is a module in `known`, else module x; relative
  imports are resolved against `module`'s package (`module` itself when `is_package`).
  """
  found = []
  for node in ast.walk(_parse(source)):
    if isinstance(node, ast.Import):
      found += [(node.lineno, alias.name) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
      for alias in node.names:
        name = f"{base}.{alias.name}"
        found.append((node.lineno, name if name in known else base))
  return sorted(set(found))


def _in(module: str, packages) -> bool:
  return any(module == p or module.startswith(p + ".") for p in packages)


def _is_trainer(module: str) -> bool:
  return any(fnmatch.fnmatchcase(module, pattern) for pattern in TRAINERS)


def violations(module: str, path: str, imports: list[tuple[int, str]]) -> list[str]:
  """One message per import of `module` (file `path`) that breaks a rule: file, line, what it
  imports and the rule."""
  found = []
  for line, imported in imports:
    where = f"{path}:{line}: imports {imported}"
    for importers, forbidden, rule in _LAYER_RULES:
      if _in(module, importers) and _in(imported, forbidden):
        found.append(f"{where}: {rule}")
    if _is_trainer(imported) and imported != module:
      found.append(f"{where}: {_TRAINER_RULE if _is_trainer(module) else _USER_RULE}")
  return found


def test_layers_import_downward_only():
  modules = package_modules()
  known = set(modules)
  found = []
  for module, path in modules.items():
    imports = imported_modules(path.read_text(encoding="utf-8"), module,
                               path.name == "__init__.py", known)
    found += violations(module, str(path.relative_to(ROOT)), imports)
  if found:
    pytest.fail(f"{len(found)} imports break the layering:\n" + "\n".join(found), pytrace=False)


def test_the_trainers_exist():
  """TRAINERS names real modules (a rename would otherwise leave the trainer rules checking
  nothing)."""
  modules = package_modules()
  for pattern in TRAINERS:
    if "*" not in pattern:
      assert pattern in modules, f"TRAINERS names {pattern}, which is not a module: update it"


def test_the_checker_catches_violations():
  known = {"realm_jax.train.pretrain", "realm_jax.train.ict", "realm_jax.train.candidates",
           "realm_jax.eval", "realm_jax.eval.answers", "realm_jax.data.qa", "realm_jax.models.bert",
           "realm_jax.train.retrofit"}
  source = "\n".join([
      "import numpy as np",                                  # 1: not realm_jax
      "from realm_jax.eval.answers import normalize_answer",  # 2
      "def f():",
      "  from realm_jax.train import candidates",             # 4: inside a function
      "  import realm_jax.train.pretrain",                    # 5
      "from .. import eval",                                  # 6: relative, realm_jax.eval
      "from ..train import retrofit",                         # 7: a future trainer
      "from . import qa",                                     # 8: same layer, fine
  ])
  imports = imported_modules(source, "realm_jax.data.corpus", False, known)
  assert imports == [(1, "numpy"), (2, "realm_jax.eval.answers"), (4, "realm_jax.train.candidates"),
                     (5, "realm_jax.train.pretrain"), (6, "realm_jax.eval"),
                     (7, "realm_jax.train.retrofit"), (8, "realm_jax.data.qa")]
  found = violations("realm_jax.data.corpus", "realm_jax/data/corpus.py", imports)
  lines = [int(m.split(":")[1]) for m in found]
  assert lines == [2, 4, 5, 5, 6, 7, 7], found
  assert found[0].startswith("realm_jax/data/corpus.py:2: imports realm_jax.eval.answers: data/")
  assert "only experiments/, benchmarks/ and tests/" in found[3]

  # models/ may not import data/; a trainer may import train/ modules, but not another trainer.
  found = violations("realm_jax.models.bert", "realm_jax/models/bert.py",
                     imported_modules("from realm_jax.data import qa", "realm_jax.models.bert",
                                      False, known))
  assert len(found) == 1 and "bottom layer" in found[0], found
  found = violations("realm_jax.train.ict", "realm_jax/train/ict.py", imported_modules(
      "from realm_jax.train import pretrain, candidates\nfrom . import pretrain as p",
      "realm_jax.train.ict", False, known))
  assert [m.split(": ", 1)[0] for m in found] == ["realm_jax/train/ict.py:1",
                                                  "realm_jax/train/ict.py:2"], found
  assert all("never imports another trainer" in m for m in found)
