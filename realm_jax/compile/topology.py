"""Named TPU slices as devices on this machine: what `experiments/compile_for.py --topology=`
accepts, the chip behind each name, and the compile-only devices of the slice.

    topo = parse("v5e-256")           # Topology(chip=v5e, shape=(16, 16)): "v5e:16x16"
    devices(topo)                     # 256 TPU devices to compile for (libtpu, no TPU needed)

Names, as Cloud TPU's accelerator types: `v5e-256` (or `v5litepod-256`), `v6e-8` count chips;
`v3-128`, `v4-64` and `v5p-128` count TensorCores, two per chip (v4 and v5p have one JAX device per
chip, "megacore"; v3 one per core). The slice's shape is Cloud TPU's default for that size
(v5e-256 = 16x16, v4-64 = 2x4x4, v5p-128 = 4x4x4); `v5e:16x16` or `v4:2x4x4` give it directly.
`cpu` or `cpu-8` are this process's own CPU devices (all, or the first 8): the same compile path
without libtpu (tests; `--xla_force_host_platform_device_count` fakes more of them).

Peak dense bf16 FLOP/s and HBM per chip are the vendor's sheets (REFERENCE: v4 275 TFLOP/s,
32 GiB; v5e 197, 16 GiB; v5p 459, 95 GiB; v6e 918, 32 GiB; v3 123, 32 GiB over its 2 cores).
Compiling for a slice needs libtpu, the `tpu-compile` extra: `pip install -e ".[tpu-compile]"`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

from realm_jax import libtpu_flags

GIB = 1 << 30
INSTALL_HINT = ('install the TPU compiler (libtpu) with `pip install -e ".[tpu-compile]"` (or '
                '`pip install "jax[tpu]==<your jax version>"`); compiling needs no TPU')


@dataclasses.dataclass(frozen=True)
class Chip:
  """A TPU generation as JAX sees it: `per_device` figures are a chip's over its devices."""
  name: str                 # v5e
  jax_name: str             # the generation in libtpu's topology names
  peak_flops: float         # dense bf16 FLOP/s per chip
  hbm_bytes: int            # per chip
  dims: int                 # 2: a 2D torus (v3, v5e, v6e); 3: a 3D one (v4, v5p)
  cores_in_name: bool       # v4-64 counts TensorCores: 32 chips
  devices_per_chip: int     # 2 for v3 (a device per core); 1 where the cores act as one
  chip_config: str          # libtpu's chip config: "megacore" = one device per chip
  min_chips: int            # the smallest slice
  max_chips: int            # the largest

  @property
  def device_peak_flops(self) -> float:
    return self.peak_flops / self.devices_per_chip

  @property
  def device_hbm_bytes(self) -> int:
    return self.hbm_bytes // self.devices_per_chip


CHIPS = {c.name: c for c in (
    Chip("v3", "v3", 123e12, 32 * GIB, 2, True, 2, "default", 4, 1024),
    Chip("v4", "v4", 275e12, 32 * GIB, 3, True, 1, "megacore", 4, 4096),
    Chip("v5e", "v5e", 197e12, 16 * GIB, 2, False, 1, "default", 1, 256),
    Chip("v5p", "v5p", 459e12, 95 * GIB, 3, True, 1, "megacore", 4, 8960),
    Chip("v6e", "v6e", 918e12, 32 * GIB, 2, False, 1, "default", 1, 256),
)}
ALIASES = {"v5litepod": "v5e", "v6litepod": "v6e"}


@dataclasses.dataclass(frozen=True)
class Topology:
  """A slice: its chip and torus shape in chips; chip None is this process's CPU devices."""
  name: str                          # as the user gave it
  chip: Chip | None
  shape: tuple[int, ...]             # chips along each torus axis; (devices,) for the CPU

  @property
  def chips(self) -> int:
    return math.prod(self.shape)

  @property
  def num_devices(self) -> int:
    return self.chips * (self.chip.devices_per_chip if self.chip else 1)

  @property
  def accelerator_type(self) -> str:
    """Cloud TPU's name of the slice, e.g. "v5litepod-256", "v4-64"."""
    if self.chip is None:
      return self.name
    prefix = {"v5e": "v5litepod"}.get(self.chip.name, self.chip.name)
    return f"{prefix}-{self.chips * (2 if self.chip.cores_in_name else 1)}"

  @property
  def topology_name(self) -> str:
    """libtpu's name of the slice, e.g. "v5e:16x16"."""
    return f"{self.chip.jax_name}:{'x'.join(map(str, self.shape))}" if self.chip else self.name


def _names() -> str:
  return ("v5e-256, v5litepod-16, v6e-64, v4-64, v5p-128, v3-128 (Cloud TPU's names), "
          "v5e:16x16 or v4:2x4x4 (a torus shape), cpu or cpu-8")


def default_shape(chip: Chip, chips: int) -> tuple[int, ...]:
  """Cloud TPU's default torus for a slice of `chips` chips (a power of two): from the smallest
  slice, the last of the shortest axes doubles until the chips are there (v5e: 1x1, 1x2, 2x2, 2x4,
  4x4 ... 16x16; v4: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4 ...)."""
  shape = [1, 1] if chip.dims == 2 else [2, 2, 1]
  while math.prod(shape) < chips:
    shortest = min(shape)
    i = max(j for j, d in enumerate(shape) if d == shortest)
    shape[i] *= 2
  return tuple(shape)


def parse(name: str) -> Topology:
  """The slice a `--topology` names (see the module docstring); ValueError saying what names work
  for one it does not know or a size no slice has. Cheap: no libtpu needed."""
  bad = lambda why: ValueError(f"--topology={name}: {why}; names look like {_names()}.")
  text = name.strip().lower()
  if text == "cpu" or re.fullmatch(r"cpu-\d+", text):
    import jax
    have = len(jax.devices("cpu"))
    n = int(text.split("-")[1]) if "-" in text else have
    if not 1 <= n <= have:
      raise ValueError(f"--topology={name}: this process has {have} CPU devices (set XLA_FLAGS="
                       f"--xla_force_host_platform_device_count={n} for more).")
    return Topology(name, None, (n,))
  shaped = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)*)", text)
  sized = re.fullmatch(r"([a-z0-9]+)-(\d+)", text)
  if not (shaped or sized):
    raise bad("not a TPU slice name")
  kind = (shaped or sized).group(1)
  chip = CHIPS.get(ALIASES.get(kind, kind))
  if chip is None:
    raise bad(f"unknown TPU generation {kind!r} (known: {', '.join(CHIPS)})")
  if shaped:
    shape = tuple(int(d) for d in shaped.group(2).split("x"))
    if len(shape) != chip.dims or min(shape) < 1:
      example = "x".join(map(str, default_shape(chip, 8 if chip.dims == 3 else 4)))
      raise bad(f"{chip.name} slices are a {chip.dims}D torus of chips, e.g. {chip.name}:{example}")
  else:
    size = int(sized.group(2))
    chips, odd = divmod(size, 2) if chip.cores_in_name else (size, 0)
    if odd or chips < chip.min_chips or chips & (chips - 1):
      unit = "TensorCores (2 per chip)" if chip.cores_in_name else "chips"
      smallest = chip.min_chips * (2 if chip.cores_in_name else 1)
      raise bad(f"{chip.name} slice sizes count {unit} and are powers of two from {smallest}")
    shape = default_shape(chip, chips)
  if not chip.min_chips <= math.prod(shape) <= chip.max_chips:
    raise bad(f"{math.prod(shape)} chips: {chip.name} slices have {chip.min_chips} to "
              f"{chip.max_chips}")
  return Topology(name, chip, shape)


def devices(topology: Topology) -> list:
  """The devices to compile for: compile-only TPU devices of the slice from libtpu (no TPU
  attached), or the CPU devices. ValueError saying how to install libtpu when it is missing."""
  import jax
  if topology.chip is None:
    return jax.devices("cpu")[:topology.num_devices]
  if not libtpu_flags.libtpu_installed():
    raise ValueError(f"--topology={topology.name}: compiling for a TPU needs libtpu, which is not "
                     f"installed: {INSTALL_HINT}.")
  # Another process that loaded libtpu (any JAX program started without JAX_PLATFORMS=cpu) holds
  # its lock file; compile-only devices do not need it. Without a TPU VM's metadata, libtpu would
  # look for it and log errors: the slice's own name and this host say what there is.
  for key, value in (("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"), ("TPU_SKIP_MDS_QUERY", "1"),
                     ("TPU_WORKER_HOSTNAMES", "localhost"),
                     ("TPU_ACCELERATOR_TYPE", topology.accelerator_type)):
    os.environ.setdefault(key, value)
  libtpu_flags.add()  # the settings realm_jax's programs need (read when libtpu starts)
  from jax.experimental import topologies
  shape = topology.shape
  host = (2, 2, 1) if len(shape) == 3 else tuple(min(2, d) for d in shape) + (1,)
  desc = topologies.get_topology_desc(
      platform="tpu", topology_name=topology.topology_name,
      chip_config_name=topology.chip.chip_config, chips_per_host_bounds=host, num_slices=1)
  return list(desc.devices)
