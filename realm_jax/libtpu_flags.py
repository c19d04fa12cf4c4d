"""libtpu's start in realm_jax's programs: the TPU compiler's settings they need, set before libtpu
starts, and no start at all on a machine without a TPU.

libtpu reads LIBTPU_INIT_ARGS once, when a process first uses it: every entry point
(`cli.run`) and the TPU compile (`compile/topology.py`) add these first. Every entry point then
keeps JAX to the CPU where libtpu is installed but no accelerator is visible
(`cpu_without_accelerator`).

  --xla_tpu_spmd_rng_bit_generator_unsafe=true: random bits drawn with XLA's RngBitGenerator
      (config.rng_impl="rbg": the dropout masks) are split over the devices like the array they
      fill; without it every device draws the whole global batch's bits and keeps its part. REALM's
      `paper_v5e_256` step with dropout needed 31.8 GiB of temporaries on each v5e device without
      it, 1.8 GiB with it (docs/tpu.md). "Unsafe": a device's bits depend on how the mesh splits
      the batch, so dropout masks differ between meshes (each is random all the same).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

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


# Google's PCI vendor and the device ids of its TPU chips (v3, an unnamed one, v4, v5p, v5e, v6e,
# TPU7x); a Google NIC or disk (gVNIC, NVMe) has the same vendor and another id.
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076")
# Device nodes of an accelerator JAX may use: a TPU VM's chips (accel, vfio groups), NVIDIA
# (nvidia0, nvidiactl, WSL2's dxg) or AMD (kfd) GPUs, and any GPU's render node (dri/renderD*).
ACCELERATOR_NODES = ("dev/accel*", "dev/vfio/[0-9]*", "dev/nvidia0", "dev/nvidiactl", "dev/dxg",
                     "dev/kfd", "dev/dri/renderD*")


def accelerator_visible(root: str = "/") -> bool:
  """Whether this machine shows a TPU chip on its PCI bus or an accelerator's device node."""
  for vendor in glob.glob(os.path.join(root, "sys/bus/pci/devices/*/vendor")):
    device = os.path.join(os.path.dirname(vendor), "device")
    try:
      with open(vendor) as v, open(device) as d:
        if v.read().strip() == GOOGLE_PCI_VENDOR and d.read().strip() in TPU_PCI_DEVICES:
          return True
    except OSError:
      continue
  return any(glob.glob(os.path.join(root, pattern)) for pattern in ACCELERATOR_NODES)


def cpu_without_accelerator(environ=None, root: str = "/") -> bool:
  """Keeps libtpu from starting on a machine with no accelerator: sets JAX_PLATFORMS=cpu in
  `environ` (default os.environ, and then jax's config too, for a jax already imported) when libtpu
  is installed (the `test` and `tpu-compile` extras), no TPU or GPU is visible (above) and the user
  has not set JAX_PLATFORMS. JAX would start libtpu first, which prints an `E0000 ...
  INVALID_ARGUMENT` line and more on stderr and takes /tmp/libtpu_lockfile before JAX falls back to
  the CPU; the result is the same CPU backend. Returns whether it set it."""
  environ = os.environ if environ is None else environ
  if "JAX_PLATFORMS" in environ or not libtpu_installed(environ) or accelerator_visible(root):
    return False
  environ["JAX_PLATFORMS"] = "cpu"
  jax = sys.modules.get("jax") if environ is os.environ else None
  if jax is not None and not jax.config.jax_platforms:  # read when jax's backends start
    jax.config.update("jax_platforms", "cpu")
  return True


def libtpu_installed(environ=None) -> bool:
  """Whether the TPU compiler can load: the libtpu package, or a library TPU_LIBRARY_PATH names."""
  environ = os.environ if environ is None else environ
  return (importlib.util.find_spec("libtpu") is not None
          or os.path.isfile(environ.get("TPU_LIBRARY_PATH", "")))
