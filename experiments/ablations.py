"""REALM's ablations at small scale: every pre-training variant, open-QA fine-tuning from the chosen
ones and from MiniLM, one table with paired bootstrap intervals (workdir/ablations.md).

  python experiments/ablations.py --flagfile=experiments/flags/ablations_demo.flags
  python experiments/ablations.py --config=realm_jax/configs/ablations.py:tiny --workdir=work/abl_tiny \
      --config.finetune.data.local_dir=../shared/data/nq_open

Stopped and started again with the same flags, it goes on where it was (every stage resumes);
the table is rewritten after every stage, and `--table_only` writes it without running anything.
"""

from absl import flags, logging

from realm_jax import cli, config_checks, io_utils
from realm_jax.eval import ablations
from realm_jax.train import finetune, pretrain

_CONFIG = cli.define_config("config", None, "Config file (realm_jax/configs/ablations.py:<variant>).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Work directory: one pre-training and fine-tuning directory per variant, the table.")
_TABLE_ONLY = flags.DEFINE_bool("table_only", False, "Write the table from the stages that have finished, run nothing.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  config_checks.workdir(_WORKDIR.value)
  if _TABLE_ONLY.value:
    if not io_utils.as_path(_WORKDIR.value).is_dir():
      cli.fail(f"--workdir={_WORKDIR.value}: no such directory; --table_only writes the table of "
               "the stages an ablations run there has finished: run without --table_only first, "
               "or fix --workdir.")
    ablations.check_config(_CONFIG.value)
    ablations.write_table(_CONFIG.value, _WORKDIR.value)
  else:
    ablations.run(_CONFIG.value, _WORKDIR.value, pretrain=pretrain.train_and_evaluate,
                  finetune=finetune.finetune)
  print(open(f"{_WORKDIR.value}/ablations.md", encoding="utf-8").read())


if __name__ == "__main__":
  cli.run(main)
