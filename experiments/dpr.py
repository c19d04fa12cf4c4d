"""DPR retriever training (question and passage towers, in-batch negatives + one BM25 hard
negative), resuming from --workdir; exports a HF REALM scorer to <workdir>/export for
build_index.py, fine-tuning, evaluate.py and ask.py.

  python experiments/dpr.py --flagfile=experiments/flags/dpr_wiki_vital.flags
  python experiments/dpr.py --config=realm_jax/configs/dpr.py:tiny --workdir=work/dpr_tiny \
      --config.data.local_dir=../shared/data/nq_open
"""

from absl import flags, logging

from realm_jax import cli
from realm_jax.train import dpr

_CONFIG = cli.define_config("config", None, "Config file (realm_jax/configs/dpr.py:<variant>).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Work directory: corpus, mined examples, BM25, checkpoints, TensorBoard, export.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  dpr.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  cli.run(main)
