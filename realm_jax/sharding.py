"""How a run is laid out over its devices: a mesh of three axes and rules that map the parameters'
logical axes (realm_jax/models/partitioning.py) onto them, as MaxText and t5x do.

    data    the batch is split over it; parameters are copied on it (data parallelism)
    fsdp    the batch is split over it too, and the parameters and optimizer state are split
            over it along their "embed" dimension (fully sharded data parallelism, ZeRO-3): each
            device holds 1/fsdp of them, gathered layer by layer by XLA when used
    tensor  the batch is copied on it; attention heads, the feed-forward width and the vocabulary
            are split over it (tensor parallelism, Megatron's layout)

A config says `mesh = "data=-1"` (the default: every device on "data", the state replicated:
plain data parallelism) or e.g. "data=2,fsdp=2,tensor=2", and `sharding_rules` the map from
logical to mesh axes ("" = DEFAULT_RULES). A dimension whose size the mesh axis does not divide
stays whole (a 9-head model on tensor=2 splits its MLP, not its heads). The optimizer state is
split like the parameters it belongs to; the index of REALM's searcher is split over every device
whatever the mesh (retrieval/exact.py).
"""

from __future__ import annotations

import functools
import math
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from realm_jax.models.partitioning import BATCH_AXES, LOGICAL_AXES, axes_of, path_name

MESH_AXES = ("data", "fsdp", "tensor")  # the batch is split over BATCH_AXES, copied over "tensor"
DEFAULT_MESH = "data=-1"
DEFAULT_RULES = "embed=fsdp,vocab=tensor,heads=tensor,mlp=tensor"


def mesh_axes(spec: str, devices: int, flag: str = "--mesh") -> dict[str, int]:
  """{axis: size} of a mesh such as "data=-1" or "data=64,fsdp=4" (-1: what the other axes
  leave), every axis of MESH_AXES present (size 1 when not named); ValueError naming `flag`
  unless the sizes multiply to `devices` (0: not known yet, the spelling alone is checked)."""
  axes = {}
  for part in filter(None, (p.strip() for p in spec.split(","))):
    name, _, size = part.partition("=")
    name = name.strip()
    if name not in MESH_AXES or not re.fullmatch(r"-1|[1-9]\d*", size.strip()):
      raise ValueError(f"{flag}={spec}: give axis=size pairs with axes from {MESH_AXES} and "
                       "sizes >= 1 (one may be -1: the rest), e.g. data=-1 or data=2,fsdp=4.")
    if name in axes:
      raise ValueError(f"{flag}={spec}: axis {name!r} is named twice.")
    axes[name] = int(size)
  if "data" not in axes:
    raise ValueError(f"{flag}={spec!r}: the mesh needs a 'data' axis (the batch and an index's "
                     "rows are split over it), e.g. data=-1.")
  free = [a for a, s in axes.items() if s == -1]
  fixed = math.prod(s for s in axes.values() if s != -1)
  if len(free) > 1:
    raise ValueError(f"{flag}={spec}: only one axis may be -1.")
  if devices and free and devices % fixed:
    raise ValueError(f"{flag}={spec}: the sized axes take {fixed} devices, which does not divide "
                     f"the {devices} devices; pick sizes whose product divides {devices}.")
  if devices and not free and fixed != devices:
    raise ValueError(f"{flag}={spec}: the axes multiply to {fixed} devices, but there are "
                     f"{devices}; make them multiply to {devices}, or give one axis -1 (the rest).")
  if devices and free:
    axes[free[0]] = devices // fixed
  return {a: axes.get(a, 1) for a in MESH_AXES}


def make_mesh(devices: list, axes: dict[str, int]) -> Mesh:
  """A mesh of `devices` with these axes, in MESH_AXES order (on a TPU slice, laid out along its
  torus; several hosts: each host's devices contiguous on the first axes)."""
  from jax.experimental import mesh_utils
  shape = tuple(axes.get(a, 1) for a in MESH_AXES)
  if len(devices) == 1 or devices[0].platform == "cpu":
    grid = np.array(devices).reshape(shape)
  else:
    grid = mesh_utils.create_device_mesh(shape, devices=devices)
  return Mesh(grid, MESH_AXES)


def config_mesh(config, devices: list | None = None) -> Mesh:
  """The mesh of a run's config (`config.mesh`, default "data=-1") over `devices` (all)."""
  devices = jax.devices() if devices is None else devices
  return make_mesh(devices, mesh_axes(config.get("mesh", DEFAULT_MESH), len(devices),
                                      "--config.mesh"))


def parse_rules(spec: str, flag: str = "--config.sharding_rules") -> dict[str, str | None]:
  """{logical axis: mesh axis or None} from "embed=fsdp,heads=tensor,..." ("" = DEFAULT_RULES;
  a logical axis not named stays whole); ValueError naming `flag` for an unknown name."""
  rules = {}
  for part in filter(None, (p.strip() for p in (spec or DEFAULT_RULES).split(","))):
    logical, _, mesh_axis = (s.strip() for s in part.partition("="))
    if logical not in LOGICAL_AXES:
      raise ValueError(f"{flag}={spec}: {logical!r} is not a logical axis; name those of "
                       f"{LOGICAL_AXES}.")
    if mesh_axis not in (*MESH_AXES, "none"):
      raise ValueError(f"{flag}={spec}: {logical}={mesh_axis!r} names no mesh axis; map it to "
                       f"one of {MESH_AXES} or none.")
    rules[logical] = None if mesh_axis == "none" else mesh_axis
  return rules


def config_rules(config) -> dict[str, str | None]:
  return parse_rules(config.get("sharding_rules", ""))


def check_config(config) -> None:
  """Refuses a misspelt config.mesh or config.sharding_rules before any work (the devices are
  counted later, once jax.distributed has started)."""
  mesh_axes(config.get("mesh", DEFAULT_MESH), 0, "--config.mesh")
  config_rules(config)


def spec_for(shape: tuple, axes: tuple, mesh: Mesh | dict, rules: dict) -> P:
  """The PartitionSpec of an array of `shape` whose dimensions have logical names `axes`: each
  dimension on its rule's mesh axis when that axis has more than one device and divides it, a
  mesh axis used once per array. `mesh`: a Mesh, or its {axis: size}."""
  sizes = mesh.shape if isinstance(mesh, Mesh) else mesh
  used, out = set(), []
  for size, logical in zip(shape, axes):
    mesh_axis = rules.get(logical) if logical else None
    if (mesh_axis is None or mesh_axis in used or sizes.get(mesh_axis, 1) == 1
        or size % sizes[mesh_axis]):
      out.append(None)
      continue
    used.add(mesh_axis)
    out.append(mesh_axis)
  return P(*out)


def elements_per_device(params, mesh_axes: dict, rules: dict, keep=None) -> int:
  """Elements of `params` (arrays or ShapeDtypeStructs; those whose path `keep` accepts) that one
  device holds on a mesh of these {axis: size}: what memory estimates count."""
  total = 0
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    if keep is not None and not keep(path):
      continue
    spec = spec_for(x.shape, _axes_or_none(path_name(path), len(x.shape)), mesh_axes, rules)
    total += math.prod(x.shape) // math.prod(mesh_axes[a] for a in spec if a)
  return total


def _axes_or_none(name: str, ndim: int) -> tuple:
  """The logical axes of a parameter, or (None, ...) (kept whole) for one no rule names: a model
  outside realm_jax's (the loop's own tests use one) trains replicated."""
  try:
    return axes_of(name, ndim)
  except ValueError:
    return (None,) * ndim


def param_shardings(params, mesh: Mesh, rules: dict):
  """A NamedSharding per array of `params` (arrays or ShapeDtypeStructs), by its logical axes."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(mesh, spec_for(
          x.shape, _axes_or_none(path_name(path), len(x.shape)), mesh, rules)), params)


def state_shardings(state, params, shardings, mesh: Mesh):
  """A NamedSharding per array of a train state (its parameters and optimizer state): an array
  whose path ends with a parameter's path, and of its shape (Adam's moments, ...), is split like
  that parameter; the rest (step counts, schedules) is replicated. `shardings`: param_shardings'
  tree for `params`."""
  by_path = {}
  for (path, x), s in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(shardings)):
    by_path[tuple(path_name(path).split("/"))] = (tuple(x.shape), s)
  replicated = NamedSharding(mesh, P())

  def one(path, x):
    keys = tuple(path_name(path).split("/"))
    for i in range(len(keys)):
      shape, s = by_path.get(keys[i:], (None, None))
      if shape == tuple(x.shape):
        return s
    return replicated
  return jax.tree_util.tree_map_with_path(one, state)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """A batch split along its first axis over "data" and "fsdp" (copied over "tensor")."""
  return NamedSharding(mesh, P(BATCH_AXES))


def batch_shards(mesh: Mesh) -> int:
  """How many parts a global batch is split into."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


def traced_on(mesh: Mesh, fn):
  """`fn` traced with `mesh`'s axes known, so that the models' activation hints
  (models/partitioning.batch_split) apply; jit it as usual."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args, **kwargs)
  return wrapped
