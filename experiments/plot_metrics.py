"""Training curves of a run as a PNG: python experiments/plot_metrics.py --workdir=work/pretrain_demo"""

from absl import flags

from realm_jax import cli
from realm_jax.train.plot import plot_metrics

_WORKDIR = flags.DEFINE_string("workdir", None, "A run's work directory (holds metrics.jsonl).")
_OUT = flags.DEFINE_string("out", None, "PNG to write (default: <workdir>/curves.png).")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  del argv
  print(plot_metrics(_WORKDIR.value, _OUT.value))


if __name__ == "__main__":
  cli.run(main)
