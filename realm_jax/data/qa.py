"""Open-domain QA questions: JSONL `{"question": str, "answer": [str, ...]}` (NQ-Open format)."""

from __future__ import annotations

import json


def load_qa_jsonl(path: str, limit: int | None = None) -> list[dict]:
  """Questions of a NQ-Open style JSONL file; errors name the file and line."""
  out = []
  try:
    f = open(path, encoding="utf-8")
  except FileNotFoundError:
    raise FileNotFoundError(f"Question file {path} does not exist.") from None
  with f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        ex = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}).") from None
      answers = ex.get("answer")
      if not isinstance(ex.get("question"), str) or not isinstance(answers, list) or not answers:
        raise ValueError(f'{path}:{lineno}: expected {{"question": str, "answer": [str, ...]}}.')
      out.append({"question": ex["question"], "answer": [str(a) for a in answers]})
      if limit is not None and len(out) >= limit:
        break
  if not out:
    raise ValueError(f"{path} holds no question.")
  return out
