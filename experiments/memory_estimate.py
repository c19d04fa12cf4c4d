"""Memory per device of a pre-training or RETRO run, estimated before it starts
(realm_jax/train/memory.py).

  python experiments/memory_estimate.py --config=realm_jax/configs/pretrain.py:paper_v4_64
  python experiments/memory_estimate.py --config=realm_jax/configs/pretrain.py:paper \
      --devices=8 --capacity_gib=80 --config.batch_size=64 --config.remat=True
  python experiments/memory_estimate.py --config=realm_jax/configs/retro.py:paper_1.5b \
      --devices=64 --capacity_gib=16 --platform=tpu   # RETRO (realm_jax/configs/retro.py)

--platform: what the compiled step holds differs (train/memory.py's UPDATE_BUFFERS): XLA on the
CPU and GPU keeps a float32 gradient and an update buffer of the trained parameters that the TPU
compiler does not.
"""

import math

from absl import flags

from realm_jax import cli
from realm_jax.compile.steps import retro_model_config
from realm_jax.train import memory

_CONFIG = cli.define_config("config", None, "Config file (realm_jax/configs/pretrain.py:<variant> "
                            "or realm_jax/configs/retro.py:<variant>).")
_DEVICES = flags.DEFINE_integer("devices", 0, "Devices the batch and index are sharded over "
                                "(default: the config's slice).")
_ROWS = flags.DEFINE_integer("index_rows", 0, "Blocks in the index (default: 13,353,718 for "
                             "full Wikipedia).")
_CAPACITY = flags.DEFINE_float("capacity_gib", 0.0, "Memory per device (default: the slice's).")
_PLATFORM = flags.DEFINE_enum("platform", None, list(memory.UPDATE_BUFFERS),
                              "The devices' platform (default: tpu for a config that names a "
                              "TPU slice, else this machine's).")
flags.mark_flags_as_required(["config"])


def main(argv):
  del argv
  for flag, default in ((_DEVICES, "the config's slice"), (_ROWS, "the corpus's blocks")):
    if flag.value < 0:
      cli.fail(f"--{flag.name}={flag.value}: give a positive number (0: {default}).")
  if not (math.isfinite(_CAPACITY.value) and _CAPACITY.value >= 0):
    cli.fail(f"--capacity_gib={_CAPACITY.value}: give a positive number of GiB (0: the slice's).")
  c = _CONFIG.value
  kind = memory.run_kind(c, f"--config={flags.FLAGS['config'].config_filename}")
  platform = _PLATFORM.value or ("tpu" if kind == "pretrain" and c.slice.name
                                 else memory.platform_of())
  if kind == "retro":
    if not _DEVICES.value:
      cli.fail("--devices is needed for a RETRO config (e.g. --devices=8).")
    est = memory.retro_estimate(c, _DEVICES.value, retro_model_config(c), platform=platform)
    print(memory.format_retro_estimate(
        est, _CAPACITY.value, f"RETRO {c.variant} on {platform}: memory per device (estimate)"))
    return
  devices = _DEVICES.value or c.slice.devices
  if not devices:
    cli.fail("--devices is needed: this config names no TPU slice (e.g. --devices=8).")
  rows = _ROWS.value or memory.index_rows_for(c)
  est = memory.estimate(c, devices, rows, platform=platform)
  title = (f"{c.variant} on {c.slice.name + ' (' + platform + ')' if c.slice.name else platform}: "
           "memory per device (estimate)")
  print(memory.format_estimate(est, _CAPACITY.value or c.slice.hbm_gib, title))


if __name__ == "__main__":
  cli.run(main)
