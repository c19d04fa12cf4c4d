"""Counts, per dataset, the questions whose answer is nowhere in the corpus (they train nothing:
fine-tuning's config.data.drop_absent drops them from training; evaluation keeps them).

  python experiments/absent_answers.py --flagfile=experiments/flags/finetune_mixture.flags

Builds the corpus in --workdir if it is not there (no index), prints a markdown table and writes
<workdir>/absent_answers.json (realm_jax/eval/absent.py).
"""

from absl import flags, logging

from realm_jax import cli
from realm_jax.eval import absent

_CONFIG = cli.define_config("config", None, "Config file (realm_jax/configs/finetune.py:<variant>).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Work directory: the corpus is built there if it is missing.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  print(absent.format_table(absent.count_absent(_CONFIG.value, _WORKDIR.value)))


if __name__ == "__main__":
  cli.run(main)
