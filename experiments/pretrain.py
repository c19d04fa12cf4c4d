"""REALM pre-training: salient-span masked LM over a refreshed index, resuming from --workdir.

  python experiments/pretrain.py --flagfile=experiments/flags/pretrain_demo.flags
  python experiments/pretrain.py --config=realm_jax/configs/pretrain.py:tiny --workdir=work/tiny
  python experiments/pretrain.py --config=realm_jax/configs/pretrain.py:paper --workdir=gs://... \
      --config.retriever_weights=work/ict/export --config.encoder_weights=... --config.distributed=True
"""

from absl import flags, logging

from realm_jax import cli
from realm_jax.train import pretrain

_CONFIG = cli.define_config("config", None, "Config file (realm_jax/configs/pretrain.py:<variant>).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Work directory (local or gs://): data, index, checkpoints, TensorBoard.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  pretrain.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  cli.run(main)
