"""The TPU compiler's settings that realm_jax's programs need, set before libtpu starts.

libtpu reads LIBTPU_INIT_ARGS once, when a process first uses it: every entry point
(`cli.run`) and the TPU compile (`compile/topology.py`) add these first.

  --xla_tpu_spmd_rng_bit_generator_unsafe=true: random bits drawn with XLA's RngBitGenerator
      (config.rng_impl="rbg": the dropout masks) are split over the devices like the array they
      fill; without it every device draws the whole global batch's bits and keeps its part. REALM's
      `paper_v5e_256` step with dropout needed 31.8 GiB of temporaries on each v5e device without
      it, 1.8 GiB with it (docs/tpu.md). "Unsafe": a device's bits depend on how the mesh splits
      the batch, so dropout masks differ between meshes (each is random all the same).
"""

from __future__ import annotations

import os

FLAGS = ("--xla_tpu_spmd_rng_bit_generator_unsafe=true",)


def add(environ=None) -> None:
  """Adds each of FLAGS to LIBTPU_INIT_ARGS in `environ` (default os.environ) unless that flag is
  already there, with whatever value the user gave it."""
  environ = os.environ if environ is None else environ
  given = environ.get("LIBTPU_INIT_ARGS", "")
  names = {arg.split("=", 1)[0] for arg in given.split()}
  missing = [f for f in FLAGS if f.split("=", 1)[0] not in names]
  if missing:
    environ["LIBTPU_INIT_ARGS"] = " ".join([given, *missing]).strip()
