"""Compile a trainer's programs for a TPU slice on this machine and read the TPU compiler's own
estimates: memory per device against the chip's HBM, collectives, FLOPs, the compiler's step time
(`optimal_seconds`) and the MFU it implies. Nothing runs on a TPU: every figure is the compiler's
estimate, never a measurement.

    report = compile_for(config, "retro", "v5e-256")     # experiments/compile_for.py
    print(format_report(report))

The programs are laid out as the training loop lays them out (realm_jax/sharding.py): a mesh of
"data", "fsdp" and "tensor" (`--mesh`, default the config's `mesh`), the parameters and optimizer
state split by their logical axes and the config's `sharding_rules`, the batch over "data" and
"fsdp", an index's rows over "data".

Model FLOPs are XLA's count of the step lowered without layer recomputation and dropout, before
it is split over devices, divided by the devices: everything the step computes once (matmuls,
attention, softmax, the optimizer), recomputation and dropout's random bits not counted.
MFU = model FLOPs per device / (optimal_seconds x the chip's peak dense bf16 FLOP/s), also for
float32 configs. XLA's cost analysis counts a while loop's body once, so a program with loops
(the index search's scan over blocks, a step in pieces) gets no MFU.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import re
import time
from typing import Callable

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from realm_jax import sharding
from realm_jax.compile import hlo, steps, topology as topologies
from realm_jax.train import memory

NOTE = ("All figures are the TPU compiler's estimates (XLA's memory and cost analyses of the "
        "program compiled for the slice on a CPU machine), not measurements on a TPU.")
CPU_NOTE = ("XLA:CPU's memory and cost analyses of the program compiled for this process's CPU "
            "devices (no chip: no HBM verdict, no step time, no MFU).")
def logical(rules: dict):
  """The shardings function of a run laid out as the training loop lays it out
  (realm_jax/sharding.py): (in_shardings, out_shardings) of a program, one per argument and
  output, by role: a state (a TrainState, or parameters alone) split by its parameters' logical
  axes and `rules`, a batch split along its first axis over "data" and "fsdp", the random key
  replicated, an index's rows over "data" (with the default mesh "data=-1": data parallelism)."""
  def shardings(mesh: Mesh, program: steps.Program) -> tuple[tuple, tuple]:
    replicated = NamedSharding(mesh, P())
    by_role = {"replicated": replicated, "batch": sharding.batch_sharding(mesh),
               "rows": NamedSharding(mesh, P("data"))}
    ins = []
    for arg, role in zip(program.args, program.roles):
      if role != "state" or not rules:
        ins.append(by_role.get(role, replicated))
      elif hasattr(arg, "params"):
        params = sharding.param_shardings(arg.params, mesh, rules)
        ins.append(sharding.state_shardings(arg, arg.params, params, mesh))
      else:
        ins.append(sharding.param_shardings(arg, mesh, rules))
    state = next((s for s, r in zip(ins, program.roles) if r == "state"), replicated)
    outs = tuple(state if r == "state" else by_role[r] for r in program.out_roles)
    return tuple(ins), outs if len(outs) > 1 else outs[0]
  shardings.__name__ = "logical axes: " + ",".join(f"{k}={v or 'none'}" for k, v in rules.items())
  return shardings


DATA_PARALLEL = logical({})  # every rule unset: the state replicated, the batch split


def with_shardings(args: tuple, shardings: tuple) -> tuple:
  """ShapeDtypeStructs of `args` carrying their argument's sharding (a sharding or a pytree of
  them per argument)."""
  def one(arg, sharding):
    if isinstance(sharding, jax.sharding.Sharding):
      return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), arg)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        arg, sharding)
  return tuple(one(a, s) for a, s in zip(args, shardings))


def lower(program: steps.Program, mesh: Mesh, shardings: Callable = DATA_PARALLEL):
  """The program lowered for `mesh` from abstract arguments (jax.stages.Lowered)."""
  ins, outs = shardings(mesh, program)
  return jax.jit(sharding.traced_on(mesh, program.fn), in_shardings=ins, out_shardings=outs,
                 donate_argnums=program.donate).lower(*with_shardings(program.args, ins))


def one_device_mesh() -> Mesh:
  """A mesh of this process's first CPU device with the mesh axes (each of size 1)."""
  return sharding.make_mesh(jax.devices("cpu")[:1], {})


def program_flops(program: steps.Program, mesh: Mesh) -> float:
  """XLA's FLOPs of one call of `program` lowered (not compiled: nothing allocated) for `mesh`;
  on a one-device mesh, the FLOPs of the whole call. NaN when the program loops (XLA counts a
  loop's body once: on one device the index search scans its rows in blocks)."""
  lowered = lower(program, mesh)
  if "stablehlo.while" in lowered.as_text():
    return float("nan")
  return _cost(lowered.cost_analysis()).get("flops", float("nan"))


def model_flops(trainer: str, config, index_rows: int = 0) -> dict:
  """{program: FLOPs of one call, all devices together}: each of the trainer's programs built
  without layer recomputation and dropout (`steps.counted_config`) and counted on a one-device
  CPU mesh (`program_flops`)."""
  one = one_device_mesh()
  plain = steps.PROGRAMS[trainer](steps.counted_config(config, trainer), one, index_rows)
  return {name: program_flops(p, one) for name, p in plain.items()}


def _cost(analysis) -> dict:
  """cost_analysis() as one dict (older jax returned a list of one)."""
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  return dict(analysis or {})


# How libtpu says a program does not fit: "Used 20.5G of 15.75G hbm. Exceeded hbm capacity by
# 4.75G." (older) or "the total memory required for HLO temporaries (18.67G) exceeds available HBM
# (15.75G)."
_EXCEEDED = (re.compile(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm"),
             re.compile(r"required for ([\w ]+?) \(([\d.]+)([KMGT]?)\) exceeds available HBM "
                        r"\(([\d.]+)([KMGT]?)\)"))
_SCALE = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def out_of_memory(error: Exception | str) -> dict | None:
  """The TPU compiler's "does not fit" (RESOURCE_EXHAUSTED) as memory figures: {"fits": False,
  "compiler_error": its first line, "required" and "available" bytes (what it names: "what")
  where it gives them}; None for any other error."""
  text = str(error)
  if "RESOURCE_EXHAUSTED" not in text:
    return None
  first = next((line for line in text.splitlines() if "RESOURCE_EXHAUSTED" in line), text)
  out = {"fits": False, "compiler_error": " ".join(first.split())[:400]}
  used, required = _EXCEEDED[0].search(text), _EXCEEDED[1].search(text)
  if used:
    out.update(what="all", required=float(used.group(1)) * _SCALE[used.group(2)],
               available=float(used.group(3)) * _SCALE[used.group(4)])
  elif required:
    out.update(what=required.group(1),
               required=float(required.group(2)) * _SCALE[required.group(3)],
               available=float(required.group(4)) * _SCALE[required.group(5)])
  return out


def compile_program(program: steps.Program, mesh: Mesh, chip: topologies.Chip | None,
                    model_flops_total: float = float("nan"),
                    shardings: Callable = DATA_PARALLEL) -> dict:
  """One program compiled for `mesh`: the compiler's memory per device (against the chip's HBM),
  FLOPs, bytes accessed, optimal_seconds and collectives, with the MFU that the program's model
  FLOPs (`model_flops_total`, all devices together: `model_flops`) imply."""
  devices = mesh.devices.size
  start = time.perf_counter()
  flops = model_flops_total / devices
  lowered = lower(program, mesh, shardings)
  out = {"params": program.params, "trained_params": program.trained,
         "calls_per_step": program.calls, "model_flops_per_device": flops}
  if program.estimate is not None:
    platform = memory.platform_of(mesh.devices.flat[0])  # the slice's, or this process's CPU
    out["estimate"] = {k: int(v) for k, v in program.estimate(devices, platform).items()}
    out["estimate"]["total"] = sum(out["estimate"].values())
  capacity = chip.device_hbm_bytes if chip else None
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    oom = out_of_memory(e)
    if oom is None:
      raise
    out["memory"] = {**oom, "capacity": capacity}
    out["compile_seconds"] = time.perf_counter() - start
    return out
  out["compile_seconds"] = time.perf_counter() - start
  mem = memory.compiled_step_bytes(compiled)
  mem["generated_code"] = compiled.memory_analysis().generated_code_size_in_bytes
  mem["capacity"] = capacity
  if capacity:
    mem["fits"] = mem["total"] <= capacity
    mem["headroom"] = capacity - mem["total"]
  out["memory"] = mem
  cost = _cost(compiled.cost_analysis())
  out["flops_per_device"] = cost.get("flops")
  out["bytes_accessed_per_device"] = cost.get("bytes accessed")
  text = compiled.as_text()
  seconds = cost.get("optimal_seconds")
  if seconds is not None and chip:
    # libtpu adds -1 s per custom call it cannot estimate (hlo.UNESTIMATED_CALLS); added back.
    # On the tiny RETRO config (3 of them) the corrected time came within 3% of the same step
    # compiled without sliced prefetches (none of them).
    out["optimal_seconds_reported"] = seconds
    out["unestimated_calls"] = hlo.unestimated_calls(text)
    seconds += out["unestimated_calls"]
  # XLA's cost analysis counts a loop's body once (the model FLOPs' too): with loops, the FLOPs
  # are not a whole call's and no MFU follows from them.
  out["while_loops"] = hlo.while_loops(text)
  out["custom_calls"] = hlo.custom_calls(text)
  if seconds is not None and seconds > 0:
    out["optimal_seconds"] = seconds
    if chip and not out["while_loops"] and math.isfinite(flops):
      out["mfu"] = flops / (seconds * chip.device_peak_flops)
  out["collectives"] = hlo.collectives(text)
  by_part = hlo.time_by_part(text)
  if by_part["cycles"]:  # libtpu's per-instruction estimates (XLA:CPU gives none)
    out["time_by_part"] = by_part
  return out


def compile_for(config, trainer: str, topology: str, mesh: str = "", *,
                index_rows: int = 0, config_name: str = "") -> dict:
  """Every program of `trainer` (steps.PROGRAMS) for `config`, compiled for the slice
  `topology` with a mesh of axes `mesh` ("": config.mesh), the state split by config's
  sharding_rules; the report as JSON-ready dict (see format_report). Raises ValueError before
  anything is built for an unknown topology, a mesh that does not divide it, an unknown rule, a
  batch the mesh does not divide, or a missing libtpu."""
  if trainer not in steps.PROGRAMS:
    raise ValueError(f"no compile_for programs for the {trainer!r} trainer: use one of "
                     f"{tuple(steps.PROGRAMS)}.")
  topo = topologies.parse(topology)
  flag = "--mesh" if mesh else "--config.mesh"
  if mesh:  # the run this compiles (its memory estimate too) is laid out on this mesh
    config = ml_collections.ConfigDict(config.to_dict())
    config.mesh = mesh
  axes = sharding.mesh_axes(mesh or config.get("mesh", sharding.DEFAULT_MESH), topo.num_devices,
                            flag)
  shardings = logical(sharding.config_rules(config))
  parts = axes["data"] * axes["fsdp"]
  if config.batch_size % parts:
    raise ValueError(f"--config.batch_size={config.batch_size} is not divisible by the {parts} "
                     f"parts the batch is split into on {topology} (data x fsdp of {flag}); "
                     "pick a multiple.")
  devices = topologies.devices(topo)  # libtpu checked here, before any model is built
  grid = sharding.make_mesh(devices, axes)
  programs = steps.PROGRAMS[trainer](config, grid, index_rows)
  flops = model_flops(trainer, config, index_rows)
  chip = topo.chip
  report = {
      "note": NOTE if chip else CPU_NOTE, "date": time.strftime("%Y-%m-%d"), "config": config_name,
      "trainer": trainer, "topology": topology, "topology_name": topo.topology_name,
      "devices": topo.num_devices, "mesh": axes, "sharding": shardings.__name__,
      "chip": None if chip is None else {
          "name": chip.name, "peak_tflops_per_device": chip.device_peak_flops / 1e12,
          "hbm_gib_per_device": chip.device_hbm_bytes / topologies.GIB},
      "versions": _versions(), "host": _host(),
      "programs": {name: compile_program(p, grid, chip, flops[name], shardings)
                   for name, p in programs.items()},
  }
  return report


def _host() -> dict:
  """The machine that compiled: its CPU model (as lscpu names it) and count."""
  model = ""
  try:
    with open("/proc/cpuinfo") as f:
      model = next((line.split(":", 1)[1].strip() for line in f
                    if line.startswith("model name")), "")
  except OSError:
    pass
  return {"cpu": model, "cpus": os.cpu_count()}


def _versions() -> dict:
  out = {"jax": jax.__version__}
  try:
    out["libtpu"] = importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    pass
  return out


def _gib(x) -> str:
  return "?" if x is None else f"{x / topologies.GIB:.2f} GiB"


def _num(x: float, unit: str = "") -> str:
  """1.23e12 -> "1.23 T" (k, M, G, T, P)."""
  for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(x) >= scale:
      return f"{x / scale:.3g} {prefix}{unit}"
  return f"{x:.3g} {unit}".rstrip()


def format_report(report: dict) -> str:
  """The lines experiments/compile_for.py prints: per program, memory per device against the
  chip, collectives, FLOPs, the compiler's time and MFU."""
  chip = report["chip"]
  lines = [f"{report['config'] or report['trainer']} on {report['topology']} "
           f"({report['topology_name']}, {report['devices']} devices, mesh "
           f"{' x '.join(f'{a} {s}' for a, s in report['mesh'].items())}, {report['sharding']})",
           report["note"]]
  for name, p in report["programs"].items():
    m = p["memory"]
    calls = f", {p['calls_per_step']} calls a step" if p["calls_per_step"] > 1 else ""
    params = (f"{_num(p['params'])} parameters ({_num(p['trained_params'])} trained)"
              if p["trained_params"] else f"{_num(p['params'])} parameters read")
    lines.append(f"{name}: {params}{calls}")
    if "compiler_error" in m:
      lines.append(f"  memory per device: does NOT fit {_gib(m['capacity'])} HBM (the compiler "
                   f"stopped: {m['compiler_error']})")
    else:
      verdict = ""
      if m.get("capacity"):
        verdict = (f" of {_gib(m['capacity'])} HBM: "
                   + (f"fits, {_gib(m['headroom'])} to spare" if m["fits"]
                      else f"does NOT fit, {_gib(-m['headroom'])} over"))
      lines.append(f"  memory per device: arguments {_gib(m['arguments'])}, outputs "
                   f"{_gib(m['outputs'])} ({_gib(m['aliased'])} aliased), temporaries "
                   f"{_gib(m['temporaries'])}, code {_gib(m['generated_code'])}; total "
                   f"{_gib(m['total'])}{verdict}")
    if "estimate" in p:
      lines.append(f"  project's estimate (train/memory.py): {_gib(p['estimate']['total'])}")
    if "collectives" in p:
      c = p["collectives"]
      types = lambda k: ", ".join(f"{t} {b / 2**20:,.1f}"
                                  for t, b in sorted(c[k]["bytes_by_type"].items()))
      parts = [f"{k} {c[k]['count']} x, {c[k]['bytes'] / 2**20:,.1f} MiB ({types(k)})"
               for k in hlo.KINDS if c[k]["count"]]
      lines.append(f"  collectives per device: {'; '.join(parts) or 'none'}"
                   + (f" ({c['unknown_trip_counts']} loops of unknown trip count counted once)"
                      if c["unknown_trip_counts"] else ""))
      loops = (f" ({p['while_loops']} loops: each body counted once, so not a whole call's)"
               if p["while_loops"] else "")
      model = (f"{_num(p['model_flops_per_device'], 'FLOP')} model (no recomputation)"
               if math.isfinite(p["model_flops_per_device"]) else "model FLOPs not counted (loops)")
      lines.append(f"  per device: {_num(p['flops_per_device'], 'FLOP')} compiled, {model}; "
                   f"{_gib(p['bytes_accessed_per_device'])} accessed{loops}")
    if "time_by_part" in p:
      blocks = hlo.time_by_block(p["time_by_part"])
      kernels = p["time_by_part"]["kernels"]["count"]
      lines.append("  the compiler's time by part (its per-instruction estimates, phases "
                   "together" + (f"; {kernels} Pallas kernels not estimated" if kernels else "")
                   + "): " + ", ".join(f"{k} {v:.1%}" for k, v in list(blocks.items())[:8]))
    if p.get("optimal_seconds") is not None:
      mfu = (f"; MFU {p['mfu']:.1%} of {chip['peak_tflops_per_device']:g} TFLOP/s bf16"
             if p.get("mfu") is not None else "")
      lines.append(f"  compiler's time (optimal_seconds) {p['optimal_seconds'] * 1e3:,.2f} ms"
                   f"{mfu}")
      kernels = p.get("custom_calls", {}).get("tpu_custom_call", 0)
      if kernels:
        lines.append(f"  {kernels} Pallas kernels: the compiler counts only the FLOPs their cost "
                     "estimates declare (the flash attention's backward kernels declare none), "
                     "so the time is low and the MFU high by their share")
    elif chip and "collectives" in p:
      lines.append(f"  compiler's time: not estimated ({p.get('optimal_seconds_reported')})")
    lines.append(f"  compiled in {p['compile_seconds']:.1f} s")
  return "\n".join(lines)
