"""The README and docs/*.md stay a short, correct map of the project: the README is short and free
of commit hashes (history lives in docs/notes.md), every relative link (and its #anchor) resolves,
and every script, flagfile and config a command names exists (configs: `get_config(variant)`
returns). Reads files only; a second or two.
"""

import importlib.util
import re
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
_CONFIG = re.compile(r"--config=(realm_jax/configs/[\w]+\.py)(?::([\w]+))?")


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
