"""realm_jax/compile (experiments/compile_for.py): slice names, the collective counts of HLO text,
model FLOPs against a hand count, the same compile path on the suite's 8 CPU devices and (when
libtpu is installed) the tiny RETRO step compiled for a v5e-8 slice. (The errors that come before
any compiling: tests/test_cli.py's table.)"""

import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT

from realm_jax import libtpu_flags, sharding
from realm_jax.compile import aot, hlo, steps, topology
from realm_jax.configs import retro as retro_configs
from realm_jax.models.retro import RetroModel

needs_libtpu = pytest.mark.skipif(
    not libtpu_flags.libtpu_installed(),
    reason='libtpu is not installed (pip install -e ".[test]" or ".[tpu-compile]"): no TPU '
    'compiler')


@pytest.mark.parametrize("name, libtpu_name, chips, devices", [
    ("v5e-256", "v5e:16x16", 256, 256), ("v5litepod-8", "v5e:2x4", 8, 8),
    ("v5e-32", "v5e:4x8", 32, 32), ("v6e-128", "v6e:8x16", 128, 128),
    ("v4-8", "v4:2x2x1", 4, 4), ("v4-64", "v4:2x4x4", 32, 32), ("v5p-128", "v5p:4x4x4", 64, 64),
    ("v5p-256", "v5p:4x4x8", 128, 128), ("v3-128", "v3:8x8", 64, 128),
    ("v4:2x2x2", "v4:2x2x2", 8, 8),
])
def test_slice_names_and_their_default_torus(name, libtpu_name, chips, devices):
  topo = topology.parse(name)
  assert (topo.topology_name, topo.chips, topo.num_devices) == (libtpu_name, chips, devices)
  if "-" in name:  # Cloud TPU's own name back
    assert topo.accelerator_type == name.replace("v5e-", "v5litepod-")


def test_chip_figures_per_device():
  assert topology.parse("v5e-8").chip.device_peak_flops == 197e12
  assert topology.parse("v5p-8").chip.device_hbm_bytes == 95 * topology.GIB
  v3 = topology.parse("v3-8").chip  # two devices per chip: half a chip's figures each
  assert (v3.device_peak_flops, v3.device_hbm_bytes) == (61.5e12, 16 * topology.GIB)


@pytest.mark.parametrize("name, says", [
    ("v5e-300", "powers of two"), ("v7x-8", "unknown TPU generation"), ("v4:2x4", "3D torus"),
    ("v4-4", "from 8"), ("v5e-512", "1 to 256"), ("tpu", "not a TPU slice name"),
    ("cpu-64", "--xla_force_host_platform_device_count=64"),
])
def test_unknown_slices_are_refused_with_the_names_that_work(name, says):
  with pytest.raises(ValueError, match=says):
    topology.parse(name)


def test_mesh_axes():
  assert sharding.mesh_axes("data=-1", 256) == {"data": 256, "fsdp": 1, "tensor": 1}
  assert sharding.mesh_axes("data=-1,fsdp=4", 256) == {"data": 64, "fsdp": 4, "tensor": 1}
  for spec, says in (("data=3", "multiply to 3 devices"), ("data=-1,fsdp=3", "does not divide"),
                     ("data=-1,fsdp=-1", "only one"), ("model=8", "axes from"), ("", "'data' axis"), ("fsdp=8", "'data' axis"),
                     ("data=0", "sizes >= 1")):
    with pytest.raises(ValueError, match=says):
      sharding.mesh_axes(spec, 8)


HLO = """\
HloModule jit_step, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %a, f32[] %b)
}

%body (p: (s32[], bf16[4,128])) -> (s32[], bf16[4,128]) {
  %p = (s32[], bf16[4,128]{1,0}) parameter(0)
  %x = bf16[4,128]{1,0:T(8,128)(2,1)} get-tuple-element(%p), index=1
  %cp-start = (bf16[4,128]{1,0}, bf16[4,128]{1,0}, u32[], u32[]) collective-permute-start(%x), \
source_target_pairs={{0,1},{1,0}}
  %cp-done = bf16[4,128]{1,0} collective-permute-done(%cp-start)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], bf16[4,128]{1,0}) tuple(%i, %cp-done)
}

%cond (p: (s32[], bf16[4,128])) -> pred[] {
  %p = (s32[], bf16[4,128]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%body2 (q: (s32[], f32[16])) -> (s32[], f32[16]) {
  %q = (s32[], f32[16]{0}) parameter(0)
  %y = f32[16]{0} get-tuple-element(%q), index=1
  %a2a = f32[16]{0} all-to-all(%y), dimensions={0}
  %j = s32[] get-tuple-element(%q), index=0
  ROOT %u = (s32[], f32[16]{0}) tuple(%j, %a2a)
}

ENTRY %main.1 (w: f32[1024,256], g: f32[8]) -> f32[8] {
  %w = f32[1024,256]{1,0:T(8,128)} parameter(0)
  %g = f32[8]{0} parameter(1)
  %all-reduce.1 = (f32[1024,256]{1,0:T(8,128)}, f32[]{:T(128)}) all-reduce(%w, %g), \
channel_id=1, replica_groups=[1,8]<=[8], to_apply=%add
  %ag-start = ((f32[8]{0}), f32[64]{0}) all-gather-start(%g), dimensions={0}
  %ag-done = f32[64]{0} all-gather-done(%ag-start)
  %rs = f32[1]{0} reduce-scatter(%g), dimensions={0}, to_apply=%add
  %init = (s32[], bf16[4,128]{1,0}) tuple(%c0, %b0)
  %loop = (s32[], bf16[4,128]{1,0}) while(%init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"12"}}
  %init2 = (s32[], f32[16]{0}) tuple(%c1, %z)
  %loop2 = (s32[], f32[16]{0}) while(%init2), condition=%cond, body=%body2
  %cat = f32[16]{0} custom-call(%z), custom_call_target="ConcatBitcast"
  %x64 = u64[2]{0} custom-call(%z), custom_call_target="X64Combine"
  ROOT %out = f32[8]{0} copy(%g)
}
"""


def test_collectives_of_hand_written_hlo():
  got = hlo.collectives(HLO)
  # all-reduce of a tuple: both results; the async all-gather once, at its -done; the permute in
  # a loop of 12 known iterations, 12 times; the all-to-all in a loop of unknown trip count once.
  count_bytes = lambda kind: (got[kind]["count"], got[kind]["bytes"])
  assert count_bytes("all-reduce") == (1, 1024 * 256 * 4 + 4)
  assert count_bytes("all-gather") == (1, 64 * 4)
  assert count_bytes("reduce-scatter") == (1, 4)
  assert got["collective-permute"] == {"count": 12, "bytes": 12 * 4 * 128 * 2,
                                       "bytes_by_type": {"bf16": 12 * 4 * 128 * 2}}
  assert count_bytes("all-to-all") == (1, 16 * 4)
  assert got["unknown_trip_counts"] == 1
  assert hlo.unestimated_calls(HLO) == 2 and hlo.while_loops(HLO) == 2
  assert hlo.custom_calls(HLO) == {"ConcatBitcast": 1, "X64Combine": 1}
  assert hlo.shape_bytes("(bf16[2,3]{1,0}, pred[], s4[10])") == 12 + 1 + 10


# libtpu's reduce-scatter: an all-reduce and the slice of this device, fused (as it prints them).
SCATTER_HLO = """\
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%all-reduce-scatter.3 (input: f32[1024,2048]) -> f32[256,2048] {
  %input = f32[1024,2048]{1,0:T(8,128)S(1)} parameter(0)
  %all-reduce.2 = f32[1024,2048]{1,0:T(8,128)} all-reduce(%input), channel_id=3, \
replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %partition-id.2 = u32[] partition-id()
  %zero = u32[] constant(0)
  ROOT %dynamic-slice.5 = f32[256,2048]{1,0:T(8,128)S(1)} dynamic-slice(%all-reduce.2, \
%partition-id.2, %zero), dynamic_slice_sizes={256,2048}
}

ENTRY %main.2 (g: f32[1024,2048], h: f32[8]) -> f32[256,2048] {
  %g = f32[1024,2048]{1,0} parameter(0)
  %h = f32[8]{0} parameter(1)
  %sum = f32[8]{0} all-reduce(%h), replica_groups={{0,1}}, to_apply=%add
  ROOT %fusion = f32[256,2048]{1,0:T(8,128)S(1)} fusion(%g), kind=kCustom, \
calls=%all-reduce-scatter.3, backend_config={"flag_configs":[],"collective_algorithm_config":\
{"emitter":"SingleInputAllReduceScatterFusion","strategy":"StrategyRing"}}
}
"""


def test_a_fused_all_reduce_and_slice_is_one_reduce_scatter():
  """libtpu writes a reduce-scatter as an all-reduce of the whole input then this device's slice,
  inside one fusion: one reduce-scatter of the slice's bytes; the plain all-reduce stays one."""
  got = hlo.collectives(SCATTER_HLO)
  assert (got["reduce-scatter"]["count"], got["reduce-scatter"]["bytes"]) == (1, 256 * 2048 * 4)
  assert (got["all-reduce"]["count"], got["all-reduce"]["bytes"]) == (1, 8 * 4)


@needs_libtpu
def test_fsdp_gradients_are_reduce_scattered_for_a_tpu():
  """A weight split over fsdp (4) and a batch over data x fsdp (2 x 4) on v5e-8: the gradient is
  reduce-scattered over fsdp (the device keeps its quarter) and only that quarter is all-reduced
  over data; no all-reduce of the whole gradient."""
  devices = topology.devices(topology.parse("v5e-8"))
  mesh = sharding.make_mesh(devices, {"data": 2, "fsdp": 4, "tensor": 1})
  w_s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", None))
  x_s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
  step = lambda w, x: w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
  text = jax.jit(step, in_shardings=(w_s, x_s), out_shardings=w_s).lower(
      jax.ShapeDtypeStruct((1024, 2048), jnp.float32, sharding=w_s),
      jax.ShapeDtypeStruct((64, 1024), jnp.float32, sharding=x_s)).compile().as_text()
  got = hlo.collectives(text)
  quarter = 256 * 2048 * 4
  assert got["reduce-scatter"]["count"] == 1 and got["reduce-scatter"]["bytes"] == quarter
  assert got["all-reduce"]["bytes"] == quarter


def test_the_compilers_out_of_memory_message_is_read():
  got = aot.out_of_memory(
      "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
      "temporaries (18.67G) exceeds available HBM (15.75G).\nmore")
  assert got["what"] == "HLO temporaries" and not got["fits"]
  assert (got["required"], got["available"]) == (18.67 * 2**30, 15.75 * 2**30)
  got = aot.out_of_memory("RESOURCE_EXHAUSTED: Used 20.5G of 15.75G hbm. Exceeded hbm capacity")
  assert (got["required"], got["available"]) == (20.5 * 2**30, 15.75 * 2**30)
  assert aot.out_of_memory("INVALID_ARGUMENT: something else") is None


def _matmul_program(batch=64, d=128, h=256):
  """y = x @ w summed: 2 B D H multiply-adds' FLOPs plus the sum's B H - 1 additions."""
  w = jax.ShapeDtypeStruct((d, h), jnp.float32)
  x = jax.ShapeDtypeStruct((batch, d), jnp.float32)
  return steps.Program(lambda w, x: jnp.sum(x @ w), (w, x), ("state", "batch"), ("replicated",),
                       params=d * h, trained=d * h)


def test_a_program_with_a_loop_has_no_model_flops():
  def scanned(w, x):  # XLA would count the body's matmul once, not 4 times
    return jax.lax.scan(lambda c, wi: (c + jnp.sum(x @ wi), None), 0.0, w)[0]
  w = jax.ShapeDtypeStruct((4, 8, 8), jnp.float32)
  x = jax.ShapeDtypeStruct((8, 8), jnp.float32)
  program = steps.Program(scanned, (w, x), ("state", "batch"), ("replicated",))
  assert np.isnan(aot.program_flops(program, aot.one_device_mesh()))


def test_model_flops_equal_a_hand_count_and_the_cpu_mesh_splits_them():
  batch, d, h = 64, 128, 256
  program = _matmul_program(batch, d, h)
  total = aot.program_flops(program, aot.one_device_mesh())
  assert total == pytest.approx(2 * batch * d * h, rel=0.01)
  mesh = sharding.make_mesh(topology.devices(topology.parse("cpu-8")), {"data": 8})
  got = aot.compile_program(program, mesh, None, total)
  assert got["model_flops_per_device"] == total / 8
  assert got["flops_per_device"] == pytest.approx(total / 8, rel=0.01)
  assert got["memory"]["arguments"] == (d * h + batch // 8 * d) * 4  # w replicated, x split
  assert got["collectives"]["all-reduce"]["count"] == 1  # the partial sums
  assert "mfu" not in got and "optimal_seconds" not in got  # no chip
  assert got["while_loops"] == 0


# A compiled TPU program as libtpu prints it: source tables, then instructions with op_name,
# stack frame and the compiler's per-instruction estimate (fused computations left out).
TIMED_HLO = """\
HloModule jit_wrapped, is_scheduled=true

FileNames
1 "/venv/lib/python3.11/site-packages/optax/_src/transform.py"
2 "/work/realm_jax/models/retro.py"

FunctionNames
1 "update_fn"
2 "token_nll"

FileLocations
1 {file_name_id=1 function_name_id=1 line=9 end_line=9 column=1 end_column=1}
2 {file_name_id=2 function_name_id=2 line=5 end_line=5 column=3 end_column=3}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}

ENTRY %main.1 (p: f32[1024], w: bf16[8,128,256]) -> f32[1024] {
  %p = f32[1024]{0:T(1024)} parameter(0)
  %w = bf16[8,128,256]{2,1,0:T(8,128)(2,1)} parameter(1)
  %fusion.1 = bf16[8,128,256]{2,1,0} fusion(%w), kind=kLoop, calls=%f.1, \
metadata={op_name="jit(wrapped)/jvp(RetroModel)/h_3/mlp/c_fc/dot_general" stack_frame_id=2}, \
backend_config={"flag_configs":[],"estimated_cycles":"300"}
  %fusion.2 = bf16[8,128,256]{2,1,0} fusion(%fusion.1, %w), kind=kOutput, calls=%f.2, \
metadata={op_name="jit(wrapped)/transpose(jvp(RetroModel))/jvp(RetroModel)/checkpoint/h_4/mlp/\
c_fc/dot_general" stack_frame_id=2}, backend_config={"estimated_cycles":"500"}
  %fusion.3 = bf16[8,128,256]{2,1,0} fusion(%w), kind=kOutput, calls=%f.3, \
metadata={op_name="jit(wrapped)/transpose(jvp(RetroModel))/jvp(RetroModel)/checkpoint/\
rematted_computation/h_11/mlp/c_fc/dot_general"}, backend_config={"estimated_cycles":"200"}
  %sum.1 = f32[] fusion(%fusion.3), kind=kLoop, calls=%f.5, \
metadata={op_name="jit(wrapped)/jvp(RetroModel)/reduce_sum" stack_frame_id=2}, \
backend_config={"estimated_cycles":"50"}
  %custom-call.1 = bf16[8,128,256]{2,1,0} custom-call(%w), \
custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"x",\
"cost_estimate":{"flops":"1000","transcendentals":"0","bytes_accessed":"8"}}}
  ROOT %fusion.4 = f32[1024]{0} fusion(%p), kind=kLoop, calls=%f.4, \
metadata={op_name="jit(wrapped)/mul" stack_frame_id=1}, backend_config={"estimated_cycles":"100"}
}
"""


def test_the_compilers_time_by_part_of_hand_written_hlo():
  """Each estimated instruction goes to one part: the module path from its op_name, layers
  merged, with its phase (recomputed inside the backward pass, backward, forward); outside any
  module, optax's code is the optimizer and other code is named by its source frame. Bytes are
  an instruction's results and operands; the Pallas kernel carries no estimate and is counted
  apart with the FLOPs it declares."""
  got = hlo.time_by_part(TIMED_HLO)
  slab = 8 * 128 * 256 * 2
  assert got["cycles"] == 300 + 500 + 200 + 50 + 100
  assert got["parts"] == {
      "backward h_*/mlp/c_fc": {"cycles": 500, "bytes": 3 * slab, "instructions": 1},
      "forward h_*/mlp/c_fc": {"cycles": 300, "bytes": 2 * slab, "instructions": 1},
      "recomputed h_*/mlp/c_fc": {"cycles": 200, "bytes": 2 * slab, "instructions": 1},
      "optimizer": {"cycles": 100, "bytes": 2 * 1024 * 4, "instructions": 1},
      "forward realm_jax/models/retro.py:token_nll": {"cycles": 50, "bytes": 4 + slab,
                                                      "instructions": 1}}
  assert got["kernels"] == {"count": 1, "declared_flops": 1000}
  assert hlo.time_by_block(got) == {"h_*/mlp": 1000 / 1150, "optimizer": 100 / 1150,
                                    "retro.py": 50 / 1150}
  assert hlo.time_by_part(HLO)["cycles"] == 0  # no estimates (XLA:CPU's text): nothing


def _tiny_retro():
  c = retro_configs.get_config("tiny")
  c.models = ("retro",)
  c.db.update(chunk_length=8, seq_chunks=2)
  return c


@functools.lru_cache(maxsize=None)
def _tiny_retro_report(topology_name: str, mesh: str = "") -> dict:
  """compile_for's report of `_tiny_retro()` for a topology and mesh, compiled once and shared by
  the tests that read it (read only)."""
  return aot.compile_for(_tiny_retro(), "retro", topology_name, mesh, config_name="tiny")


def test_the_llama3_8b_stand_in_builds_a_model_of_its_published_size(tmp_path):
  """benchmarks/llama3_8b_shapes.py: its directory goes through the decoder resolver and the
  trainer's model config as a real Llama-3-8B directory would, and the decoder it builds has
  Meta-Llama-3-8B's 8,030,261,248 parameters (by hand: two 128,256 x 4,096 embeddings, 32 layers
  of q/o 4,096^2, k/v 4,096 x 1,024, SwiGLU 3 x 4,096 x 14,336 and two norms, a final norm)."""
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import llama3_8b_shapes
  from realm_jax.train import lm_step
  out = llama3_8b_shapes.write(str(tmp_path / "llama3"))
  c = retro_configs.get_config("retrofit_smollm2")
  c.init, c.db.tokenizer_file = out, os.path.join(out, "tokenizer.json")
  db = steps.retro_database_shape(c)
  assert (db.tokenizer.vocab_size, db.tokenizer.eos_id) == (128256, 128001)
  model = lm_step.model_config(c, db, retrieval=False)
  assert (model.hidden_size, model.num_layers, model.num_heads, model.num_kv_heads,
          model.mlp_size, model.rope_theta) == (4096, 32, 32, 8, 14336, 500000.0)
  params = jax.eval_shape(functools.partial(lm_step.init_params, RetroModel(model), db.seq_chunks,
                                            False), jax.random.key(0))
  layer = 2 * 4096 ** 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
  assert steps.count(params) == 2 * 128256 * 4096 + 32 * layer + 4096 == 8_030_261_248


def test_tiny_retro_step_compiles_on_the_cpu_devices():
  report = _tiny_retro_report("cpu-8")
  assert (report["devices"], report["mesh"], report["chip"]) == (
      8, {"data": 8, "fsdp": 1, "tensor": 1}, None)
  p = report["programs"]["retro"]
  assert p["params"] == p["trained_params"] > 0
  # Data parallel: the gradients of every parameter are all-reduced (float32), nothing else moves.
  c = p["collectives"]
  assert c["all-reduce"]["bytes"] >= 4 * p["params"]
  assert sum(c[k]["count"] for k in hlo.KINDS if k != "all-reduce") == 0
  assert 0 < p["model_flops_per_device"] <= p["flops_per_device"] * 1.01
  assert p["memory"]["arguments"] >= 12 * p["params"]  # the state: parameters + AdamW moments
  assert p["estimate"]["total"] > 0
  json.dumps(report)  # what --out writes


def test_missing_libtpu_is_refused_before_any_model_is_built(monkeypatch):
  def build(*args):
    raise AssertionError("a model was built before libtpu was checked")
  monkeypatch.setattr(libtpu_flags, "libtpu_installed", lambda: False)
  monkeypatch.setattr(steps, "PROGRAMS", {"retro": build})
  with pytest.raises(ValueError, match=r'needs libtpu.*pip install -e "\.\[tpu-compile\]"'):
    aot.compile_for(_tiny_retro(), "retro", "v5e-8")


@needs_libtpu
@pytest.mark.parametrize("name, kind", [
    ("v5e-256", "TPU v5 lite"), ("v6e-8", "TPU v6 lite"), ("v4-64", "TPU v4"),
    ("v5p-128", "TPU v5"), ("v3-128", "TPU v3")])
def test_libtpu_gives_the_devices_of_each_default_torus(name, kind):
  topo = topology.parse(name)
  devices = topology.devices(topo)
  assert len(devices) == topo.num_devices and {d.device_kind for d in devices} == {kind}


@needs_libtpu
def test_tiny_retro_step_compiles_for_a_v5e_slice():
  report = aot.compile_for(_tiny_retro(), "retro", "v5e-8", config_name="tiny")
  assert report["topology_name"] == "v5e:2x4" and report["devices"] == 8
  p = report["programs"]["retro"]
  assert p["memory"]["fits"] and p["memory"]["capacity"] == 16 * topology.GIB
  assert p["collectives"]["all-reduce"]["bytes"] >= 4 * p["params"]
  assert "tpu_custom_call" not in p["custom_calls"]
  assert p["optimal_seconds"] > 0 and 0 < p["mfu"] < 1
  assert "TPU compiler's estimates" in report["note"] and report["versions"]["libtpu"]
  # The project's estimate of the state (parameters and AdamW's moments, replicated) against the
  # arguments the TPU compiler allots (that state and a small batch): within 20%.
  held = p["estimate"]["parameters"] + p["estimate"]["optimizer state"]
  assert 0.8 < held / p["memory"]["arguments"] < 1.2
  # Where the compiler's time goes: the model's blocks, and the AdamW update reading and writing
  # at least each parameter and both moments (float32) and reading its gradient.
  by_part = p["time_by_part"]
  blocks = hlo.time_by_block(by_part)
  assert {"h_*/attn", "h_*/mlp", "h_*/cca", "h_*/encoder", "optimizer"} <= set(blocks)
  assert abs(sum(blocks.values()) - 1) < 1e-9 and by_part["kernels"]["count"] == 0
  assert by_part["parts"]["optimizer"]["bytes"] >= (3 * 2 + 1) * 4 * p["params"]
  assert any(k.startswith("backward h_*/mlp") for k in by_part["parts"])
  assert "the compiler's time by part" in aot.format_report(report)


def test_tiny_finetuning_step_compiles_on_the_cpu_devices(tiny_reader):
  """Open-QA fine-tuning's own step (train/qa_step.py) over a batch of the longest shapes its
  batcher lays out (by hand from the config: 8 questions of 32 word pieces, the beam's 8 frozen
  embeddings of MiniLM's 384, the first 2 blocks read at 96 pieces, 8 gold spans each), compiled
  on the 8 CPU devices by compile_for's path (a TPU slice's compile of it takes ~11 s more), with
  the search for the beams over an index of 40 rows: the question tower and the reader trained,
  their gradients all-reduced (float32)."""
  from realm_jax.checkpoints import minilm_dir
  from realm_jax.configs import finetune as finetune_configs
  from realm_jax.text.tokenizer import BertTokenizer
  c = finetune_configs.get_config("tiny")
  c.reader_weights = tiny_reader  # (conftest.py: 32 wide instead of MiniLM's first layer)
  assert steps.trainer_of(c) == "finetune"
  batch = steps.finetune_batch(c, BertTokenizer(os.path.join(minilm_dir(), "vocab.txt")), 384, 8)
  assert batch["question"]["input_ids"].shape == (8, 32)
  assert batch["beam_embeddings"].shape == (8, 8, 384) and batch["beam_mask"].shape == (8, 8)
  assert batch["reader"]["input_ids"].shape == batch["block_mask"].shape == (8, 2, 96)
  assert batch["gold_starts"].shape == (8, 2, 8)
  report = aot.compile_for(c, "finetune", "cpu-8", index_rows=40, config_name="tiny")
  assert set(report["programs"]) == {"train_step", "embed_questions", "search"}
  p = report["programs"]["train_step"]
  assert p["params"] == p["trained_params"] > 0
  # The float32 gradients all-reduced: those of nearly every parameter (a few get none).
  assert 0.9 * 4 * p["params"] <= p["collectives"]["all-reduce"]["bytes"] < 1.1 * 4 * p["params"]
  assert 0 < p["model_flops_per_device"] <= p["flops_per_device"] * 1.01
  assert p["memory"]["arguments"] >= 12 * p["params"]  # the state: parameters + AdamW moments
  assert report["programs"]["embed_questions"]["params"] < p["params"]


def test_ict_and_dpr_steps_compile_on_the_cpu_devices():
  """The retriever trainers' own steps (train/retriever_step.py) on the 8 CPU devices: ICT's
  compiled (both towers trained, their float32 gradients all-reduced), DPR's built and lowered
  over the pairs its pipeline gives at the tiny config's lengths (by hand: 8 questions of 32
  word pieces, 8 positives and 8 hard negatives of the index's 64)."""
  from realm_jax.configs import dpr as dpr_configs
  from realm_jax.configs import ict as ict_configs
  ict, dpr = ict_configs.get_config("tiny"), dpr_configs.get_config("tiny")
  assert (steps.trainer_of(ict), steps.trainer_of(dpr)) == ("ict", "dpr")
  report = aot.compile_for(ict, "ict", "cpu-8", config_name="tiny")
  p = report["programs"]["train_step"]
  assert p["params"] == p["trained_params"] > 0
  assert 0.9 * 4 * p["params"] <= p["collectives"]["all-reduce"]["bytes"] < 1.1 * 4 * p["params"]
  assert 0 < p["model_flops_per_device"] <= p["flops_per_device"] * 1.01
  mesh = sharding.make_mesh(jax.devices("cpu"), {"data": 8, "fsdp": 1, "tensor": 1})
  program = steps.PROGRAMS["dpr"](dpr, mesh)["train_step"]
  batch = program.args[1]
  assert batch["question"]["input_ids"].shape == (8, 32)
  assert batch["positive"]["input_ids"].shape == batch["hard_negative"]["input_ids"].shape == (
      8, 64)
  metrics = aot.lower(program, mesh).out_info[1]
  assert {"loss", "accuracy", "skipped"} <= set(metrics)

@needs_libtpu
def test_flash_attention_compiles_for_a_v5e_slice_split_three_ways():
  """The fused TPU kernel (models/flash.py) runs per device inside the step laid out on a
  (data 2, fsdp 2, tensor 2) mesh: it compiles for the slice, as Mosaic custom calls (forward and
  the two backward kernels of its one layer), which the dense step has none of (the test above);
  the model's FLOPs are still counted. Split three ways, the state is split by its logical axes
  (parameters gathered: all-gather) and the project's estimate of it holds within 20% of the
  arguments the TPU compiler allots (the dense step split the same way on the CPU devices:
  test_tiny_retro_compiles_split_over_fsdp_and_tensor_with_the_estimate_beside_it)."""
  config = _tiny_retro()
  # 128 tokens: one of the kernel's blocks (two compiled in 55 CPU-s instead of 38 on a Zen 3;
  # tests/test_flash.py checks the kernel's numbers over several blocks).
  config.db.update(chunk_length=16, seq_chunks=8)
  config.model.update(max_length=128, attention="flash", num_heads=4, num_kv_heads=2,
                      num_layers=1, cca_layers=(1,))
  report = aot.compile_for(config, "retro", "v5e-8", "data=2,fsdp=2,tensor=2")
  p = report["programs"]["retro"]
  assert p["memory"]["fits"] and p["custom_calls"].get("tpu_custom_call", 0) >= 3
  assert p["model_flops_per_device"] > 0
  assert report["sharding"].startswith("logical axes: embed=fsdp")
  assert p["collectives"]["all-gather"]["count"] > 0
  held = p["estimate"]["parameters"] + p["estimate"]["optimizer state"]
  assert 0.8 < held / p["memory"]["arguments"] < 1.2
  # The kernels carry no per-instruction estimate: counted apart, with the FLOPs their forward
  # declares (the backward kernels declare none).
  kernels = p["time_by_part"]["kernels"]
  assert kernels["count"] == p["custom_calls"]["tpu_custom_call"] and kernels["declared_flops"] > 0
  assert f"{kernels['count']} Pallas kernels not estimated" in aot.format_report(report)

@needs_libtpu
@pytest.mark.slow
def test_tiny_pretraining_programs_compile_for_a_v5e_slice_with_the_estimate_beside_them():
  """REALM pre-training's three programs compile for v5e-8; the project's estimate for a TPU holds
  the state (parameters and AdamW's moments, replicated) that the compiler allots within 20%, and
  no float32 gradient or update buffer (memory.UPDATE_BUFFERS). The dropout masks drawn by XLA's
  RngBitGenerator (config.rng_impl="rbg", the paper configs'): the compiler's -1 s for each of
  their X64Combine calls is added back, and the step time is positive."""
  from realm_jax.configs import pretrain as pretrain_configs
  config = pretrain_configs.get_config("tiny")
  assert config.dropout
  config.rng_impl = "rbg"
  report = aot.compile_for(config, "pretrain", "v5e-8", index_rows=1000)
  step, embed, search = (report["programs"][k] for k in ("train_step", "embed_queries", "search"))
  assert step["params"] == step["trained_params"] > 0 and step["memory"]["fits"]
  assert step["collectives"]["all-reduce"]["bytes"] >= 4 * step["params"]
  assert embed["trained_params"] == 0 and embed["memory"]["total"] > 0
  # 1,000 rows of the index over 8 devices: 125 rows a device (float32, retriever_proj_size 16).
  assert search["memory"]["arguments"] >= 125 * 16 * 4 and search["calls_per_step"] == 1
  held = step["estimate"]["parameters"] + step["estimate"]["optimizer state"]
  assert 0.8 < held / step["memory"]["arguments"] < 1.2
  assert "gradients" not in step["estimate"] and "update buffers" not in step["estimate"]
  calls = step["custom_calls"]
  assert calls["X64Combine"] > 0
  assert step["unestimated_calls"] == sum(calls.get(c, 0) for c in hlo.UNESTIMATED_CALLS)
  assert step["optimal_seconds_reported"] < -calls["X64Combine"] < 0 < step["optimal_seconds"]


def test_tiny_retro_compiles_split_over_fsdp_and_tensor_with_the_estimate_beside_it():
  """data 2 x fsdp 2 x tensor 2 on the CPU devices: the state's arguments per device shrink to
  about a quarter of data parallelism's (split over fsdp x tensor), parameters are gathered
  (all-gather) and gradients reduce-scattered, and the project's estimate of the state follows."""
  whole = _tiny_retro_report("cpu-8")["programs"]["retro"]
  split = _tiny_retro_report("cpu-8", "data=2,fsdp=2,tensor=2")["programs"]["retro"]
  assert split["memory"]["arguments"] < 0.4 * whole["memory"]["arguments"]
  assert split["collectives"]["all-gather"]["count"] > 0
  state = lambda p: sum(v for k, v in p["estimate"].items()
                       if k not in ("activations", "gathered weights", "total"))
  assert state(split) < 0.4 * state(whole)
  # What the step takes in is the state (parameters and AdamW's two moments) and a small batch:
  # the estimate's parameters and optimizer state per device are that within 20%.
  held = split["estimate"]["parameters"] + split["estimate"]["optimizer state"]
  assert 0.8 < held / split["memory"]["arguments"] < 1.2


@needs_libtpu
def test_random_bits_are_drawn_per_device_on_a_tpu_slice():
  """XLA's RngBitGenerator (config.rng_impl="rbg") draws a split mask per device only with
  libtpu_flags set before libtpu starts (topology.devices sets them): for a [8 x 2048, 1024]
  dropout mask split over v5e-8, the compiled program draws [2048, 1024] bits on each device, not
  the whole [16384, 1024] that every device draws without the flag."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  devices = topology.devices(topology.parse("v5e-8"))
  assert "--xla_tpu_spmd_rng_bit_generator_unsafe=true" in os.environ["LIBTPU_INIT_ARGS"]
  split = NamedSharding(Mesh(np.array(devices), ("data",)), P("data"))

  def dropout(x, seed):
    keep = jax.random.bernoulli(jax.random.key(seed, impl="rbg"), 0.9, x.shape)
    return jnp.where(keep, x / 0.9, 0)

  x = jax.ShapeDtypeStruct((8 * 2048, 1024), jnp.float32, sharding=split)
  seed = jax.ShapeDtypeStruct((), jnp.uint32, sharding=NamedSharding(split.mesh, P()))
  text = jax.jit(dropout, out_shardings=split).lower(x, seed).compile().as_text()
  drawn = re.findall(r"= (u32\[[0-9,]+\])\S* rng-bit-generator\(", text)
  assert drawn == ["u32[2048,1024]"]


def test_libtpu_flags_are_added_once_and_a_users_own_value_is_kept():
  env = {}
  libtpu_flags.add(env)
  assert env["LIBTPU_INIT_ARGS"].split() == list(libtpu_flags.FLAGS)
  libtpu_flags.add(env)
  assert env["LIBTPU_INIT_ARGS"].split() == list(libtpu_flags.FLAGS)
  env = {"LIBTPU_INIT_ARGS": "--xla_tpu_spmd_rng_bit_generator_unsafe=false --other=1"}
  libtpu_flags.add(env)
  assert env["LIBTPU_INIT_ARGS"] == "--xla_tpu_spmd_rng_bit_generator_unsafe=false --other=1"


def _fake_machine(root, pci=(), nodes=()):
  """A file tree under `root` with PCI devices (vendor, device) and device nodes, as in /."""
  for i, (vendor, device) in enumerate(pci):
    d = root / "sys/bus/pci/devices" / f"0000:00:{i:02x}.0"
    d.mkdir(parents=True)
    (d / "vendor").write_text(vendor + "\n")
    (d / "device").write_text(device + "\n")
  for node in nodes:
    (root / node).parent.mkdir(parents=True, exist_ok=True)
    (root / node).write_text("")
  return str(root)


def test_an_accelerator_is_seen_by_its_tpu_chip_or_device_node_and_not_by_a_google_nic(tmp_path):
  gvnic, intel = ("0x1ae0", "0x0042"), ("0x8086", "0x0063")  # a TPU's id under another vendor
  cpu_only = _fake_machine(tmp_path / "cpu", pci=[gvnic, intel, ("0x1af4", "0x1000")],
                           nodes=["dev/null", "dev/vfio/vfio", "dev/dri/card0"])
  assert not libtpu_flags.accelerator_visible(cpu_only)
  for name, pci, nodes in [("v5e", [gvnic, ("0x1ae0", "0x0063")], []),
                           ("v4", [("0x1ae0", "0x005e")], []), ("accel", [], ["dev/accel0"]),
                           ("vfio", [], ["dev/vfio/0"]), ("nvidia", [], ["dev/nvidiactl"]),
                           ("wsl", [], ["dev/dxg"]), ("rocm", [], ["dev/kfd"]),
                           ("render", [], ["dev/dri/renderD128"])]:
    assert libtpu_flags.accelerator_visible(_fake_machine(tmp_path / name, pci, nodes)), name


def test_jax_is_kept_to_the_cpu_only_with_libtpu_no_accelerator_and_no_choice_of_the_user(
    tmp_path, monkeypatch):
  cpu_only = _fake_machine(tmp_path / "cpu", pci=[("0x1ae0", "0x0042")])
  tpu = _fake_machine(tmp_path / "tpu", nodes=["dev/accel0"])
  monkeypatch.setattr(libtpu_flags, "libtpu_installed", lambda environ=None: True)
  env = {}
  assert libtpu_flags.cpu_without_accelerator(env, root=cpu_only)
  assert env == {"JAX_PLATFORMS": "cpu"}
  for given in ("", "cuda", "tpu,cpu"):  # the user's choice stands, an empty one too
    env = {"JAX_PLATFORMS": given}
    assert not libtpu_flags.cpu_without_accelerator(env, root=cpu_only)
    assert env == {"JAX_PLATFORMS": given}
  env = {}
  assert not libtpu_flags.cpu_without_accelerator(env, root=tpu) and env == {}
  monkeypatch.setattr(libtpu_flags, "libtpu_installed", lambda environ=None: False)
  assert not libtpu_flags.cpu_without_accelerator(env, root=cpu_only) and env == {}


@needs_libtpu
@pytest.mark.skipif(libtpu_flags.accelerator_visible(), reason="this machine has an accelerator")
def test_an_entry_point_on_a_machine_without_a_tpu_does_not_start_libtpu(tmp_path):
  """With libtpu installed (the test extra) and no JAX_PLATFORMS, JAX alone would start libtpu
  first: it prints an `E0000 ... TPU_WORKER_HOSTNAMES` error and more before the CPU is used."""
  script = tmp_path / "entry.py"
  script.write_text("import jax\nfrom realm_jax import cli\n\n"
                    "def main(argv):\n  print(jax.default_backend(), len(jax.devices()))\n\n"
                    "cli.run(main)\n")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
  assert run.returncode == 0, run.stderr
  assert run.stdout.split()[0] == "cpu"
  for noise in ("TPU_WORKER_HOSTNAMES", "E0000", "libtpu", "backend 'tpu'"):
    assert noise not in run.stderr, run.stderr
