"""Text from a trained RETRO decoder that retrieves fresh neighbours at every chunk boundary, with
the neighbours it used printed as evidence.

  python experiments/retro_sample.py --workdir=work/retro_demo --prompt="The Nile is"
  python experiments/retro_sample.py --model=work/retro_demo/retro/export --db=work/retro_demo/db \
      --prompt="..." --temperature=0.8 --top_k=40 --max_new_tokens=128
"""

import math
import os

from absl import flags, logging

from realm_jax import cli
from realm_jax.checkpoints import retro_export
from realm_jax.retrieval.chunk_db import RetroDb
from realm_jax.systems.retro_lm import RetroLm

_WORKDIR = flags.DEFINE_string("workdir", None, "A retro_train.py work directory.")
_MODEL = flags.DEFINE_string("model", None, "An export directory (default: <workdir>/retro/export).")
_DB = flags.DEFINE_string("db", None, "The chunk database (default: <workdir>/db).")
_PROMPT = flags.DEFINE_string("prompt", None, "The text to continue.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Most tokens to generate.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "> 0: sample among the k likeliest tokens.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_RETRIEVAL = flags.DEFINE_bool("retrieval", True, "--noretrieval: the same model without neighbours.")
_SEARCHER = flags.DEFINE_string("searcher", None, "exact | scann (default: the database's).")
flags.mark_flags_as_required(["prompt"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if not (_WORKDIR.value or (_MODEL.value and _DB.value)):
    cli.fail("give --workdir (a retro_train.py work directory), or both --model and --db.")
  if not _PROMPT.value.strip():
    cli.fail(f"--prompt={_PROMPT.value!r}: give the text to continue.")
  if _MAX_NEW.value < 1:
    cli.fail(f"--max_new_tokens={_MAX_NEW.value}: give at least 1.")
  if not (math.isfinite(_TEMPERATURE.value) and _TEMPERATURE.value >= 0):
    cli.fail(f"--temperature={_TEMPERATURE.value}: give 0 (greedy) or a positive number.")
  if _TOP_K.value < 0:
    cli.fail(f"--top_k={_TOP_K.value}: give 0 (every token) or a positive number.")
  model = _MODEL.value or os.path.join(_WORKDIR.value, "retro", "export")
  vocab_size = retro_export.load_config(model).vocab_size  # retro.json only
  if _TOP_K.value > vocab_size:
    cli.fail(f"--top_k={_TOP_K.value}: the model has {vocab_size:,} tokens; give at most that "
             "(0: every token).")
  db = RetroDb.open(_DB.value or os.path.join(_WORKDIR.value, "db"))
  lm = RetroLm(model, db, searcher=_SEARCHER.value)
  text, evidence = lm.generate(_PROMPT.value, _MAX_NEW.value, _TEMPERATURE.value, _TOP_K.value,
                               _SEED.value, retrieval=_RETRIEVAL.value)
  print(f"{_PROMPT.value} >>> {text}")
  for e in evidence:
    print(f"\nchunk {e.chunk}: {e.chunk_text!r}")
    for n in e.neighbours:
      print(f"  [{n['score']:.3f}] {n['title']}: {n['text']}")


if __name__ == "__main__":
  cli.run(main)
