"""RETRO: the chunk database, the RETRO decoder and its baseline trained on the same batches, then
held-out bits per byte with and without retrieval (all resuming from --workdir).

  python experiments/retro_train.py --flagfile=experiments/flags/retro_demo.flags
  python experiments/retro_train.py --config=realm_jax/configs/retro.py:tiny --workdir=work/retro_tiny
  python experiments/retro_train.py --config=realm_jax/configs/retro.py:demo --workdir=work/retrofit \
      --config.init=/path/to/gpt2 --config.freeze_decoder=True \
      --config.db.tokenizer_file=/path/to/gpt2/tokenizer.json --config.models=retro,
"""

from absl import flags, logging

from realm_jax import cli
from realm_jax.train import retro

_CONFIG = cli.define_config("config", None, "Config file (realm_jax/configs/retro.py:<variant>).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Work directory: database, runs, evaluation.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  report = retro.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  print(retro.summary(report, _WORKDIR.value))


if __name__ == "__main__":
  cli.run(main)
