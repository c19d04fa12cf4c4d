"""REALM's index builder: runs beside experiments/pretrain.py on the same --workdir, re-embeds the
corpus with the newest checkpoint's document tower and publishes each index atomically.

  python experiments/pretrain.py --flagfile=F --config.index.refresh=async &
  python experiments/refresh_index.py --flagfile=F
"""

import math

from absl import flags, logging

from realm_jax import cli, config_checks
from realm_jax.train import refresher

_CONFIG = cli.define_config("config", None, "The trainer's config (realm_jax/configs/pretrain.py:<variant>).")
_WORKDIR = flags.DEFINE_string("workdir", None, "The trainer's work directory (local or gs://).")
_POLL = flags.DEFINE_float("poll_seconds", 10.0, "How often to look for a new checkpoint.")
_IDLE = flags.DEFINE_float("stop_after_idle_s", None, "Stop after this long without a new checkpoint (default: never).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  # Before the wait for the trainer's config (minutes).
  config_checks.workdir(_WORKDIR.value)
  if not (math.isfinite(_POLL.value) and _POLL.value > 0):
    cli.fail(f"--poll_seconds={_POLL.value}: give a positive number of seconds.")
  if _IDLE.value is not None and not _IDLE.value >= 0:
    cli.fail(f"--stop_after_idle_s={_IDLE.value}: give a number of seconds >= 0 (or leave it out: "
             "never stop).")
  refresher.run_refresher(_CONFIG.value, _WORKDIR.value, poll_seconds=_POLL.value,
                          stop_after_idle_s=_IDLE.value)


if __name__ == "__main__":
  cli.run(main)
