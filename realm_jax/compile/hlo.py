"""The collectives of a compiled program, and where its time goes, read from its HLO text
(`compiled.as_text()`).

    collectives(compiled.as_text())
    # {"all-reduce": {"count": 1, "bytes": 4194304}, "all-gather": {...}, ...}
    time_by_block(time_by_part(compiled.as_text()))
    # {"h_*/encoder": 0.34, "optimizer": 0.16, "h_*/attn": 0.16, ...}  (libtpu's programs)

Per kind (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute): how many run in
one call of the program and the bytes of their results on one device (an SPMD program's shapes are
a device's), also by element type (a gradient all-reduced in bf16 shows as such). An asynchronous
pair (`all-gather-start` / `all-gather-done`) counts once, with the result of its `-done`. libtpu
writes most reduce-scatters as an all-reduce then a slice inside a fusion of its own (a computation
`all-reduce-scatter`, emitter `...AllReduceScatterFusion`): one reduce-scatter, with the fusion's
(sliced) result, not the all-reduce of the whole input it holds. A
collective in a while loop's body counts once per iteration when the HLO gives the trip count
(`known_trip_count`, as XLA:CPU prints it; libtpu's compiled text does not); otherwise once, and
`unknown_trip_counts` says how many such loops hold collectives.

`unestimated_calls` counts the custom calls libtpu's cost model cannot estimate (see aot.py);
`while_loops` the loops, whose bodies XLA's cost analysis counts once (not once per iteration).
`time_by_part` sums libtpu's own per-instruction time estimates by the part of the model (or the
optimizer) each instruction computes: where a step's time goes, as the compiler sees it.
"""

from __future__ import annotations

import collections
import math
import re

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# Bytes per element of HLO's element types (sub-byte types round up to a byte).
_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")  # name, the rest
_CALLS = re.compile(r"\b(calls|body|condition|to_apply|branch_computations|true_computation|"
                    r"false_computation)=(\{[^}]*\}|%?[\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_SCATTER_FUSION = re.compile(r'"emitter"\s*:\s*"\w*AllReduceScatter\w*"')


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape: `f32[1024,1024]{1,0}` or a tuple `(f32[], bf16[8,128])`."""
  return sum(typed_bytes(shape).values())


def typed_bytes(shape: str) -> dict[str, int]:
  """{element type: bytes} of an HLO shape (a tuple's elements added up by type)."""
  out: dict[str, int] = collections.defaultdict(int)
  for dtype, dims in re.findall(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]", shape):
    size = _BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)
    out[dtype] += size * math.prod(int(d) for d in dims.split(",") if d)
  return dict(out)


def _split_shape(rest: str) -> tuple[str, str]:
  """(shape, the text after it) of an instruction's right-hand side; tuples are balanced."""
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].lstrip()
  shape, _, after = rest.partition(" ")
  return shape, after


def _opcode(after: str) -> str:
  found = re.match(r"([\w\-]+)\(", after)
  return found.group(1) if found else ""


def _kind(opcode: str) -> str | None:
  """The collective an opcode is (its `-done` half for an async pair), else None."""
  if opcode in KINDS:
    return opcode
  base = opcode.removesuffix("-done")
  return base if opcode.endswith("-done") and base in KINDS else None


def collectives(hlo_text: str) -> dict:
  """{kind: {"count", "bytes", "bytes_by_type"}} for every kind in KINDS (zeros where absent),
  plus "unknown_trip_counts": loops of unknown trip count whose bodies hold collectives."""
  found = []                                   # (computation, kind, bytes)
  calls = collections.defaultdict(list)        # callee -> [(caller, times)]
  unknown_loops = []                           # (caller, body) without a trip count
  scatters = {}                                # fused all-reduce-scatter -> its result bytes
  computation = None
  for line in hlo_text.splitlines():
    head = _COMPUTATION.match(line)
    if head and "=" not in line.split("(")[0]:
      computation = head.group(1)
      continue
    inst = _INSTRUCTION.match(line)
    if not inst or computation is None:
      continue
    shape, after = _split_shape(inst.group(2))
    opcode = _opcode(after)
    kind = _kind(opcode)
    if kind:
      found.append((computation, kind, typed_bytes(shape)))
    trips = _TRIP_COUNT.search(after)
    scatter_fusion = opcode == "fusion" and bool(_SCATTER_FUSION.search(after))
    for attr, callees in _CALLS.findall(after):
      for callee in re.findall(r"%?([\w.\-]+)", callees.strip("{}")):
        if scatter_fusion or (opcode == "fusion" and callee.startswith("all-reduce-scatter")):
          scatters[callee] = typed_bytes(shape)
        times = 1
        if opcode == "while" and attr == "body":
          times = int(trips.group(1)) if trips else 1
          if not trips:
            unknown_loops.append(callee)
        calls[callee].append((computation, times))

  memo: dict[str, int] = {}

  def runs(name: str, seen=()) -> int:
    """How many times a computation runs per call of the program (the entry: once)."""
    if name not in memo:
      callers = [(c, t) for c, t in calls.get(name, ()) if c not in seen]
      memo[name] = sum(runs(c, seen + (name,)) * t for c, t in callers) if callers else 1
    return memo[name]

  found = [(comp, "reduce-scatter", scatters[comp]) if comp in scatters and kind == "all-reduce"
           else (comp, kind, sizes) for comp, kind, sizes in found]
  out = {kind: {"count": 0, "bytes": 0, "bytes_by_type": {}} for kind in KINDS}
  for comp, kind, sizes in found:
    n, by_type = runs(comp), out[kind]["bytes_by_type"]
    out[kind]["count"] += n
    for dtype, size in sizes.items():
      out[kind]["bytes"] += n * size
      by_type[dtype] = by_type.get(dtype, 0) + n * size
  holders = {comp for comp, _, _ in found}
  out["unknown_trip_counts"] = sum(
      1 for body in unknown_loops if _reaches(body, holders, _callees(calls)))
  return out


def _callees(calls: dict) -> dict:
  down = collections.defaultdict(set)
  for callee, callers in calls.items():
    for caller, _ in callers:
      down[caller].add(callee)
  return down


def _reaches(start: str, targets: set, down: dict) -> bool:
  stack, seen = [start], set()
  while stack:
    name = stack.pop()
    if name in targets:
      return True
    if name not in seen:
      seen.add(name)
      stack.extend(down.get(name, ()))
  return False


# Custom calls the TPU cost model gives -1 s each in `optimal_seconds`: ConcatBitcast joins the
# slices of a sliced prefetch (memory-space assignment), itself a bitcast; X64Combine,
# X64SplitHigh and X64SplitLow join and split the 64-bit state of the `rbg` random-number
# generator (config.rng_impl; each -1 s, measured on a compiled bernoulli mask, docs/tpu.md).
UNESTIMATED_CALLS = ("ConcatBitcast", "X64Combine", "X64SplitHigh", "X64SplitLow")


def unestimated_calls(hlo_text: str) -> int:
  """Custom calls of UNESTIMATED_CALLS in a compiled program (each one, wherever it is)."""
  return sum(len(re.findall(rf'custom_call_target="{name}"', hlo_text))
             for name in UNESTIMATED_CALLS)


def custom_calls(hlo_text: str) -> dict[str, int]:
  """{target: count} of the custom calls in a compiled program (`tpu_custom_call`: a Pallas
  kernel compiled by Mosaic, e.g. models/flash.py's attention)."""
  found = re.findall(r'custom_call_target="([^"]+)"', hlo_text)
  return {t: found.count(t) for t in sorted(set(found))}


def while_loops(hlo_text: str) -> int:
  """While loops in a program (XLA's cost analysis counts each body's FLOPs once)."""
  return len(re.findall(r"\swhile\(", hlo_text))


# ------------------------------------------------------------------ where the compiler's time goes
_CYCLES = re.compile(r'"estimated_cycles"\s*:\s*"?(\d+)')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_DECLARED_FLOPS = re.compile(r'"cost_estimate"\s*:\s*\{[^}]*"flops"\s*:\s*"?(\d+)')
# What jax writes into op_name around the model's module path: transformations, jitted helpers,
# a scan's body (closed_call), einsum specs and the primitive itself are not modules.
_NOT_A_MODULE = re.compile(r"[()<>,.]|->|^(checkpoint|rematted_computation|shard_map|pallas_call"
                           r"|closed_call|while|body|cond)$")


def _frames(hlo_text: str) -> dict[str, str]:
  """{stack frame id: "file:function"} of a module's FileNames, FunctionNames, FileLocations and
  StackFrames tables (what its instructions' `stack_frame_id` names: the innermost frame)."""
  tables: dict[str, dict[str, str]] = {}
  table = None
  for line in hlo_text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      table = tables.setdefault(line, {})
    elif table is not None and re.match(r"^\d+ ", line):
      key, _, value = line.partition(" ")
      table[key] = value
    elif table is not None and line.strip():
      table = None
  files, functions = tables.get("FileNames", {}), tables.get("FunctionNames", {})
  locations = {k: re.findall(r"(file_name_id|function_name_id)=(\d+)", v)
               for k, v in tables.get("FileLocations", {}).items()}
  out = {}
  for frame, value in tables.get("StackFrames", {}).items():
    where = dict(locations.get((re.findall(r"file_location_id=(\d+)", value) or ["?"])[0], ()))
    path = files.get(where.get("file_name_id", ""), '"?"').strip('"')
    path = path.rsplit("site-packages/", 1)[-1]
    path = "realm_jax/" + path.rsplit("/realm_jax/", 1)[-1] if "/realm_jax/" in path else path
    function = functions.get(where.get("function_name_id", ""), "?").strip('"')
    out[frame] = f"{path}:{function}"
  return out


def part_of(op_name: str, frame: str = "") -> str:
  """The part of a training step an instruction computes, from its `op_name` (and, outside any
  Flax module, the innermost source frame `frame`): "<phase> <module path>", the phase forward,
  recomputed (layer recomputation inside the backward pass) or backward, numbered layers merged
  (`h_5/mlp/c_fc` -> `h_*/mlp/c_fc`). Outside the model: "optimizer" (what optax computes, and
  the update that XLA fuses into the trainers' non-finite guard, train/realm_step.guarded_update)
  or the phase and the source file and function."""
  names = op_name.split("/")
  phase = ("recomputed" if "rematted_computation" in names else
           "backward" if any(n.startswith("transpose(") for n in names) else "forward")
  modules = [re.sub(r"_\d+$", "_*", n) for n in names[:-1] if not _NOT_A_MODULE.search(n)]
  if modules:
    return f"{phase} {'/'.join(modules)}"
  if frame.startswith("optax/") or ":guarded_update" in frame:
    return "optimizer"
  return f"{phase} {frame or op_name or '?'}"


def time_by_part(hlo_text: str) -> dict:
  """Where a compiled TPU program's time goes, by the compiler's own per-instruction estimates
  (`estimated_cycles` in each scheduled instruction's backend config; libtpu writes them, XLA:CPU
  does not): {"cycles": their sum, "parts": {part_of(...): {"cycles", "bytes", "instructions"}},
  "kernels": {"count", "declared_flops"}}. "bytes" are an instruction's operands and results (a
  fusion's reads and writes of memory, not its inner steps). Pallas kernels (`tpu_custom_call`)
  carry no estimate: they are counted apart with the FLOPs their cost estimates declare. A while
  loop's body is counted once."""
  frames = _frames(hlo_text)
  sizes: dict[str, int] = {}
  parts: dict[str, dict] = collections.defaultdict(lambda: {"cycles": 0, "bytes": 0,
                                                             "instructions": 0})
  kernels = {"count": 0, "declared_flops": 0}
  for line in hlo_text.splitlines():
    found = _INSTRUCTION.match(line)
    if not found:
      continue
    shape, after = _split_shape(found.group(2))
    sizes[found.group(1)] = shape_bytes(shape)
    if 'custom_call_target="tpu_custom_call"' in after:
      kernels["count"] += 1
      declared = _DECLARED_FLOPS.search(after)
      kernels["declared_flops"] += int(declared.group(1)) if declared else 0
    cycles = _CYCLES.search(after)
    if not cycles:
      continue
    operands = after[after.find("(") + 1:]
    operands = operands[:operands.find(")")] if ")" in operands else ""
    name, frame = _OP_NAME.search(after), _FRAME_ID.search(after)
    part = parts[part_of(name.group(1) if name else "", frames.get(frame.group(1), "")
                         if frame else "")]
    part["cycles"] += int(cycles.group(1))
    part["bytes"] += sizes[found.group(1)] + sum(
        sizes.get(o, 0) for o in re.findall(r"%([\w.\-]+)", operands))
    part["instructions"] += 1
  total = sum(p["cycles"] for p in parts.values())
  ordered = dict(sorted(parts.items(), key=lambda kv: -kv[1]["cycles"]))
  return {"cycles": total, "parts": ordered, "kernels": kernels}


def time_by_block(by_part: dict) -> dict[str, float]:
  """{block: share of the estimated cycles} of `time_by_part`'s result, its parts' phases
  together and module paths cut to two names (`h_*/encoder`, `h_*/mlp`), largest first."""
  blocks: dict[str, int] = collections.defaultdict(int)
  for part, p in by_part["parts"].items():
    blocks[_block(part)] += p["cycles"]
  total = by_part["cycles"] or 1
  return {k: v / total for k, v in sorted(blocks.items(), key=lambda kv: -kv[1])}


def _block(part: str) -> str:
  """The block of a `part_of` part: "optimizer", a module path's first two names, or (outside
  any module) the source file's name."""
  if part == "optimizer":
    return part
  path = part.partition(" ")[2]
  if ":" in path:
    return path.split(":")[0].rsplit("/", 1)[-1]
  return "/".join(path.split("/")[:2])
