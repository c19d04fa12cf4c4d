"""kNN-LM (Khandelwal et al. 2020) over trained RETRO / baseline decoders: each decoder's datastore
of its train-split contexts, then held-out bits per byte and perplexity alone and interpolated,
lambda tuned on half of the held-out documents (docs/knnlm.md).

  python experiments/knnlm_eval.py --flagfile=experiments/flags/knnlm_demo.flags
  python experiments/knnlm_eval.py --db=work/retro_demo/db \
      --models=work/retro_demo/baseline/export --out=work/knnlm --k=256 --lambda=0.25
"""

import os

from absl import flags, logging

from realm_jax import cli
from realm_jax.eval import knnlm
from realm_jax.retrieval.chunk_db import RetroDb

_WORKDIR = flags.DEFINE_string("workdir", None, "A retro_train.py work directory (db/, retro/, "
                               "baseline/).")
_DB = flags.DEFINE_string("db", None, "The chunk database (default: <workdir>/db).")
_MODELS = flags.DEFINE_list("models", None, "Export directories (default: <workdir>/retro/export "
                            "and <workdir>/baseline/export, those that exist).")
_OUT = flags.DEFINE_string("out", None, "Where knnlm.json and knnlm.md go (default: --workdir).")
_K = flags.DEFINE_integer("k", 1024, "Neighbours per token (the paper: 1024).")
_LAMBDAS = flags.DEFINE_list("lambdas", [str(x) for x in knnlm.LAMBDAS],
                             "kNN weights tried on the dev half; the best is reported.")
_LAMBDA = flags.DEFINE_float("lambda", None, "One kNN weight, not tuned (overrides --lambdas).")
_TEMPERATURE = flags.DEFINE_list("temperature", ["1"], "Softmax temperature of the negative "
                                 "distances; several: tuned on the dev half with lambda.")
_SEARCHER = flags.DEFINE_string("searcher", "exact", "exact | approx | scann "
                                "(realm_jax/retrieval/searcher.py).")
_SEARCHER_OPTIONS = flags.DEFINE_list(
    "searcher_options", [], "The searcher's own whole-number settings as key=value, e.g. "
    "reorder_num_neighbors=4096,dims_per_block=1 for ScaNN (retrieval/scann_searcher.py).")
_DATASTORE_DIR = flags.DEFINE_list("datastore_dir", None, "One datastore directory per model "
                                   "(default: <out>/datastore-<model name>); built, resumed or "
                                   "reused.")
_KEY_DTYPE = flags.DEFINE_string("key_dtype", "float32", "Storage of the keys: float32 | bfloat16.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Sequences per decoder call.")
_DECODER_MEMORY = flags.DEFINE_bool(
    "decoder_memory", False, "A RETRO model's datastore holds its decoder's states without the "
    "neighbours (CCA skipped), and the model is reported twice over it: without neighbours (for "
    "a RETROfit with a frozen decoder: the pre-trained decoder) and with them.")


def _floats(flag, values):
  try:
    return tuple(float(v) for v in values)
  except ValueError:
    cli.fail(f"--{flag}={','.join(values)}: give numbers separated by commas.")


def _options(values) -> dict:
  options = {}
  for item in values:
    key, _, value = item.partition("=")
    try:
      options[key.strip()] = int(value)
    except ValueError:
      cli.fail(f"--searcher_options={','.join(values)}: give key=whole number pairs separated "
               f"by commas (not {item!r}).")
  return options


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  workdir = _WORKDIR.value
  if not workdir and not (_DB.value and _MODELS.value and _OUT.value):
    cli.fail("give --workdir (a retro_train.py work directory), or all of --db, --models, --out.")
  lambdas = (_LAMBDA.value,) if _LAMBDA.value is not None else _floats("lambdas", _LAMBDAS.value)
  temperatures = _floats("temperature", _TEMPERATURE.value)
  options = _options(_SEARCHER_OPTIONS.value)
  knnlm.check_settings(k=_K.value, lambdas=lambdas, temperatures=temperatures,
                       searcher=_SEARCHER.value, batch_size=_BATCH.value, dtype=_KEY_DTYPE.value,
                       searcher_options=options)
  if workdir and not os.path.isdir(workdir):
    cli.fail(f"--workdir={workdir}: no such directory; give a retro_train.py work directory.")
  if _MODELS.value:
    exports = {os.path.basename(os.path.dirname(p.rstrip("/"))) or p: p for p in _MODELS.value}
    if len(exports) < len(_MODELS.value):
      cli.fail(f"--models={','.join(_MODELS.value)}: two exports with the same name (the "
               "directory above export/); give them one at a time with their own --out.")
  else:
    exports = {n: os.path.join(workdir, n, "export") for n in ("retro", "baseline")
               if os.path.exists(os.path.join(workdir, n, "export"))}
    if not exports:
      cli.fail(f"--workdir={workdir}: no trained model there (retro/export or baseline/export); "
               "run experiments/retro_train.py first.")
  out = _OUT.value or workdir
  dirs = _DATASTORE_DIR.value or [os.path.join(out, f"datastore-{n}") for n in exports]
  if len(dirs) != len(exports):
    cli.fail(f"--datastore_dir={','.join(dirs)}: give one directory per model "
             f"({', '.join(exports)}), in that order.")
  db = RetroDb.open(_DB.value or os.path.join(workdir, "db"))
  report = knnlm.evaluate_knnlm(exports, db, out, datastore_dirs=dict(zip(exports, dirs)),
                                k=_K.value, lambdas=lambdas, temperatures=temperatures,
                                searcher=_SEARCHER.value, batch_size=_BATCH.value,
                                dtype=_KEY_DTYPE.value,
                                searcher_options=options,
                                decoder_memory=_DECODER_MEMORY.value)
  print(knnlm.markdown(report))
  print(f"Written to {os.path.join(out, 'knnlm.md')} and knnlm.json.")


if __name__ == "__main__":
  cli.run(main)
