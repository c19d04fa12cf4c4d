"""ICT warm start of REALM's retriever (Inverse Cloze Task), resuming from --workdir; exports a
HF REALM scorer to <workdir>/export for build_index.py and pre-training.

  python experiments/ict.py --flagfile=experiments/flags/ict_demo.flags
  python experiments/ict.py --config=realm_jax/configs/ict.py:tiny --workdir=work/ict_tiny
  python experiments/ict.py --config=realm_jax/configs/ict.py:paper --workdir=gs://... \
      --config.bert_weights=/path/to/bert-base-uncased --config.distributed=True
"""

from absl import flags, logging

from realm_jax import cli
from realm_jax.train import ict

_CONFIG = cli.define_config("config", None, "Config file (realm_jax/configs/ict.py:<variant>).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Work directory: corpus, checkpoints, TensorBoard, export.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  ict.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  cli.run(main)
