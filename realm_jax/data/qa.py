"""Open-domain QA questions: JSONL `{"question": str, "answer": [str, ...]}` (NQ-Open format)."""

from __future__ import annotations

from realm_jax.io_utils import iter_jsonl


def load_qa_jsonl(path: str, limit: int | None = None) -> list[dict]:
  """Questions of a NQ-Open style JSONL file; errors name the file and line."""
  out = []
  for lineno, ex in iter_jsonl(path, "question file"):
    ok = (isinstance(ex, dict) and isinstance(ex.get("question"), str)
          and isinstance(ex.get("answer"), list) and len(ex["answer"]) > 0)
    if not ok:
      raise ValueError(f'{path}:{lineno}: expected {{"question": str, "answer": [str, ...]}}.')
    out.append({"question": ex["question"], "answer": [str(a) for a in ex["answer"]]})
    if limit is not None and len(out) >= limit:
      break
  if not out:
    raise ValueError(f"{path} holds no question.")
  return out
