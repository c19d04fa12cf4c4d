"""Compile a config's training step for a TPU slice on this machine (no TPU needed) and print the
TPU compiler's estimates: memory per device against the chip's HBM, collectives, FLOPs, its step
time and the MFU it implies (realm_jax/compile/aot.py). Needs libtpu:
`pip install -e ".[tpu-compile]"`.

  python experiments/compile_for.py --config=realm_jax/configs/retro.py:paper_172m \
      --topology=v5e-256 --out=work/compile/retro_172m_v5e-256.json
  python experiments/compile_for.py --config=realm_jax/configs/retro.py:retrofit_smollm2 \
      --topology=v5e-8
  python experiments/compile_for.py --config=realm_jax/configs/pretrain.py:paper_v4_64 \
      --topology=v4-64
  python experiments/compile_for.py --config=realm_jax/configs/finetune.py:mixture --topology=v5e-8
  python experiments/compile_for.py --config=realm_jax/configs/retro.py:tiny --topology=cpu-8

--topology: v5e-256, v5litepod-16, v6e-64, v4-64, v5p-128, v3-128 (Cloud TPU's names), a torus
(v5e:16x16, v4:2x4x4), or cpu / cpu-N (this machine's CPU devices, the same path without libtpu).
Every figure is the compiler's estimate, never a measurement.
"""

import os
import re

from absl import flags

from realm_jax import cli

_CONFIG = cli.define_config("config", None, "Config file (realm_jax/configs/<trainer>.py:<variant> "
                            "of retro, pretrain, finetune, ict or dpr).")
_TOPOLOGY = flags.DEFINE_string("topology", None, "The slice to compile for: v5e-256, v4-64, "
                                "v5p-128, v6e-8, v5e:16x16, cpu-8, ...")
_MESH = flags.DEFINE_string("mesh", "", "Mesh axes and sizes, e.g. data=-1 or data=32,fsdp=8 "
                            "(-1: the rest of the devices; default: the config's mesh). The "
                            "parameters are split by the config's sharding_rules.")
_ROWS = flags.DEFINE_integer("index_rows", 0, "Pre-training and fine-tuning: rows of the index "
                             "searched (0: the config's corpus when known, full Wikipedia's "
                             "13,353,718; fine-tuning over another corpus compiles no search "
                             "without it).")
_OUT = flags.DEFINE_string("out", "", "Write the report as JSON here.")
flags.mark_flags_as_required(["config", "topology"])


def main(argv):
  del argv
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the compiling happens on the CPU
  cpus = re.fullmatch(r"cpu-(\d+)", _TOPOLOGY.value.strip().lower())
  if cpus and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={cpus.group(1)}").strip()
  if _ROWS.value < 0:
    cli.fail(f"--index_rows={_ROWS.value}: give a positive number (0: the corpus's).")
  from realm_jax.compile import aot, steps
  from realm_jax.io_utils import check_writable, write_json
  if _OUT.value:  # before minutes of compiling
    check_writable(os.path.dirname(_OUT.value) or ".", "--out")
  name = flags.FLAGS["config"].config_filename
  config = _CONFIG.value
  report = aot.compile_for(config, steps.trainer_of(config, f"--config={name}"), _TOPOLOGY.value,
                           _MESH.value, index_rows=_ROWS.value, config_name=name)
  print(aot.format_report(report))
  if _OUT.value:
    write_json(_OUT.value, report)
    print(f"Written to {_OUT.value}")
  over = [n for n, p in report["programs"].items() if p["memory"].get("fits") is False]
  if over:  # (tpu/launch.sh starts no worker then)
    cli.fail(f"--config={name} does not fit {_TOPOLOGY.value}'s memory per device ("
             f"{', '.join(over)}, above): split the parameters with --config.mesh (fsdp, tensor), "
             "set --config.remat, or lower --config.batch_size.")


if __name__ == "__main__":
  cli.run(main)
