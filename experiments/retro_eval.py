"""Held-out bits per byte of trained RETRO / baseline decoders (retro_train.py runs it at its end):
with retrieval, with the neighbours removed, the baseline; by neighbour overlap.

  python experiments/retro_eval.py --workdir=work/retro_demo
  python experiments/retro_eval.py --db=work/retro_demo/db --models=work/retro_demo/retro/export \
      --out=work/eval
"""

import os

from absl import flags, logging

from realm_jax import cli
from realm_jax.eval import retro as retro_eval
from realm_jax.retrieval.chunk_db import RetroDb

_WORKDIR = flags.DEFINE_string("workdir", None, "A retro_train.py work directory (db/, retro/, "
                               "baseline/).")
_DB = flags.DEFINE_string("db", None, "The chunk database (default: <workdir>/db).")
_MODELS = flags.DEFINE_list("models", None, "Export directories (default: <workdir>/retro/export "
                            "and <workdir>/baseline/export, those that exist).")
_OUT = flags.DEFINE_string("out", None, "Where eval.json, eval.md, bpb.png go (default: --workdir).")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Held-out sequences per call.")
_LEAKY = flags.DEFINE_bool("heldout_in_database", False, "Also score each RETRO model with the "
                           "paper's Wikitext-103 condition: neighbours searched among the held-out "
                           "chunks too (a chunk may read the rest of its own document).")
_OTHER = flags.DEFINE_bool("other_neighbours", False, "Also score each RETRO model with every "
                           "chunk reading another document's neighbours (the control for what "
                           "the neighbours' content is worth).")


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  workdir = _WORKDIR.value
  if not workdir and not (_DB.value and _MODELS.value and _OUT.value):
    cli.fail("give --workdir (a retro_train.py work directory), or all of --db, --models, --out.")
  if _BATCH.value < 1:
    cli.fail(f"--batch_size={_BATCH.value}: give a positive number of sequences.")
  db_dir = _DB.value or os.path.join(workdir, "db")
  if _MODELS.value:
    exports = retro_eval.export_names(_MODELS.value)
  else:
    exports = {n: os.path.join(workdir, n, "export") for n in ("retro", "baseline")
               if os.path.exists(os.path.join(workdir, n, "export"))}
    if not exports:
      cli.fail(f"--workdir={workdir}: no trained model there (retro/export or baseline/export); "
               "run experiments/retro_train.py first.")
  out = _OUT.value or workdir
  retro_eval.check_out_dir(out)  # before the database opens (it reads all its files to verify them)
  db = RetroDb.open(db_dir)
  report = retro_eval.evaluate_exports(exports, db, out, _BATCH.value,
                                       heldout_in_database=_LEAKY.value,
                                       other=_OTHER.value)
  print(retro_eval.markdown(report))


if __name__ == "__main__":
  cli.run(main)
