"""Open-QA fine-tuning: question tower + reader over a frozen index, resuming from --workdir.

  python experiments/finetune.py --flagfile=experiments/flags/finetune_wiki_vital.flags
  python experiments/finetune.py --config=realm_jax/configs/finetune.py:tiny --workdir=work/qa_tiny \
      --config.data.local_dir=../shared/data/nq_open

The index is built in the workdir first if it is not there. Then evaluate the best checkpoint with
experiments/evaluate.py and ask it questions with experiments/ask.py (same flags).
"""

from absl import flags, logging

from realm_jax import cli
from realm_jax.systems import open_qa
from realm_jax.train import finetune

_CONFIG = cli.define_config("config", None, "Config file (realm_jax/configs/finetune.py:<variant>).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Work directory: corpus, index, checkpoints, best model, TensorBoard.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  best = finetune.finetune(_CONFIG.value, _WORKDIR.value)
  print(f"Best dev EM {best['dev_em']:.2f} (recall@5 {best['dev_recall']:.2f}) at step "
        f"{best['step']}, kept in {_WORKDIR.value}/{open_qa.BEST}")


if __name__ == "__main__":
  cli.run(main)
