"""Memory per device: the estimate printed before a run (realm_jax/train/memory.py) against XLA's
buffer assignment of the compiled train step, for the `tiny` and `demo` configs on this machine,
then the estimate for the paper config on each named TPU slice.

    python benchmarks/memory.py                 # 1 CPU device
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/memory.py

The step is compiled from shapes only (nothing is trained); "XLA" is what the compiled program
allocates per device: its arguments (state + batch), its outputs less the donated buffers they
reuse, and its temporaries (activations, gradients, optimiser updates).
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from realm_jax.configs.pretrain import SLICES, get_config
from realm_jax.train import memory
from realm_jax.train.init import make_models, param_shapes
from realm_jax.train.optimizer import bert_adamw
from realm_jax.train.realm_step import TrainState, train_step

GIB = memory.GIB
# The CPU configs, with the blocks of their corpora (their runs log "Corpus ...: N blocks"). The
# demo rows keep the shapes of the earlier 2-layer demo (K = 4) that benchmarks/README.md reports.
EARLIER_DEMO = {"num_layers": 2, "num_candidates": 4}
CPU_RUNS = [("tiny", {}, 96), ("demo", EARLIER_DEMO, 5166),
            ("demo", {**EARLIER_DEMO, "remat": True}, 5166),
            # activations dominate here, as they do in the paper config
            ("demo", {**EARLIER_DEMO, "num_layers": 6, "batch_size": 64}, 5166),
            ("demo", {**EARLIER_DEMO, "num_layers": 6, "batch_size": 64, "remat": True}, 5166)]


def abstract_inputs(config, mc, devices):
  """Shapes of (state, batch) of one step of `config`, nothing allocated."""
  models = make_models(config, mc)
  tx = bert_adamw(config.learning_rate, config.num_steps, 10, config.weight_decay,
                  clip_norm=config.clip_norm)
  params = param_shapes(models, mc)
  state = jax.eval_shape(lambda p: TrainState.create(apply_fn=None, params=p, tx=tx), params)
  b, k, m = config.batch_size, config.num_candidates, config.max_masked
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  three = lambda *s: {n: i32(*s) for n in ("input_ids", "attention_mask", "token_type_ids")}
  batch = {"query": three(b, config.query_length), "candidates": three(b, k, config.doc_length),
           "joint": three(b, k, config.joint_length),
           "candidate_mask": jax.ShapeDtypeStruct((b, k), jnp.float32),
           "mlm_positions": i32(b, m), "mlm_targets": i32(b, m),
           "mlm_weights": jax.ShapeDtypeStruct((b, m), jnp.float32)}
  return models, state, batch


def measured(config, mc, devices):
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  models, state, batch = abstract_inputs(config, mc, devices)
  mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
  rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  fn = jax.jit(functools.partial(train_step, models=models, dropout=config.dropout),
               in_shardings=(rep, data, rep), out_shardings=(rep, rep), donate_argnums=0)
  compiled = fn.lower(state, batch, jax.ShapeDtypeStruct((), jax.random.key(0).dtype)).compile()
  return memory.compiled_step_bytes(compiled)


def main():
  devices = jax.device_count()
  print(f"{devices} {jax.devices()[0].platform} device(s)\n")
  for variant, overrides, blocks in CPU_RUNS:
    c = get_config(variant)
    c.update(overrides)
    mc = memory.model_config(c)
    est = memory.estimate(c, devices, blocks, mc, platform=memory.platform_of())
    xla = measured(c, mc, devices)
    step_est = sum(v for k, v in est["parts"].items() if k not in ("index shard", "search scratch"))
    print(memory.format_estimate(est, title=f"{variant} {overrides or ''}: estimate"))
    print(f"  XLA, compiled step: arguments {xla['arguments'] / GIB:.3f} GiB, temporaries "
          f"{xla['temporaries'] / GIB:.3f} GiB, outputs not aliased "
          f"{(xla['outputs'] - xla['aliased']) / GIB:.3f} GiB -> {xla['total'] / GIB:.3f} GiB")
    print(f"  step (parameters + gradients + optimiser + activations): estimate "
          f"{step_est / GIB:.3f} GiB vs XLA {xla['total'] / GIB:.3f} GiB "
          f"(ratio {step_est / xla['total']:.2f})\n")
  for name in SLICES:
    c = get_config(f"paper_{name}")
    est = memory.estimate(c, c.slice.devices, memory.index_rows_for(c), platform="tpu")
    print(memory.format_estimate(est, c.slice.hbm_gib, f"paper_{name} on {c.slice.name}"
                                 f"{' (remat)' if c.remat else ''}: estimate") + "\n")


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  main()
