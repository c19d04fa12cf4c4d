"""Parameters split by their logical axes over a (data, fsdp, tensor) mesh (realm_jax/sharding.py):
every parameter of every trainer named, the rules' errors, the RETRO step over Llama and GPT-2
decoders on data 2 x fsdp 2 x tensor 2 equal to one device, parameters created split, and a
checkpoint saved on one mesh restored bit-identical on others. (The REALM and fine-tuning steps'
comparisons are in test_train_step.py and test_qa_step.py.)"""

import functools

import chex
import jax
import ml_collections
import numpy as np
import pytest
from conftest import MESH_3D, laid_out, split_arrays
from jax.sharding import PartitionSpec as P

from realm_jax import sharding
from realm_jax.checkpoints import training as checkpoints
from realm_jax.configs import retro as retro_configs
from realm_jax.models.partitioning import axes_of, logical_axes
from realm_jax.models.retro import RetroConfig, RetroModel
from realm_jax.train import lm_step
from realm_jax.train.realm_step import TrainState

SEQ_CHUNKS, M, K = 4, 4, 2


def retro_config(family: str) -> RetroConfig:
  return RetroConfig(vocab_size=96, num_layers=3, hidden_size=32, num_heads=4,
                     num_kv_heads=2 if family == "llama" else 0, mlp_size=48, max_length=64,
                     chunk_length=M, cca_layers=(2, 3), encoder_layers=1, encoder_size=16,
                     num_neighbours=K, family=family, pad_id=0)


def retro_batch(seed: int, b: int = 8) -> dict:
  rng = np.random.default_rng(seed)
  length = SEQ_CHUNKS * M
  return {"inputs": rng.integers(1, 96, (b, length)).astype(np.int32),
          "targets": rng.integers(1, 96, (b, length)).astype(np.int32),
          "segments": np.repeat(np.arange(2, dtype=np.int32), length // 2)[None].repeat(b, 0),
          "loss_mask": (rng.random((b, length)) < 0.9).astype(np.float32),
          "target_bytes": rng.integers(1, 6, (b, length)).astype(np.float32),
          "neighbours": rng.integers(1, 96, (b, SEQ_CHUNKS, K, 2 * M)).astype(np.int32)}


def optimizer_config(freeze: bool):
  config = retro_configs.get_config("tiny")
  config.learning_rate, config.num_steps, config.warmup_steps = 1e-3, 10, 1
  config.freeze_decoder = freeze
  return config


# ---------------------------------------------------------------------------- logical axes
def test_every_parameter_of_every_model_has_logical_axes():
  """The table names every array of RETRO's Llama and GPT-2 decoders (with CCA and the neighbour
  encoder), REALM's towers and encoder, and the reader, one name per dimension."""
  from realm_jax.configs import pretrain
  from realm_jax.train import memory
  from realm_jax.train.init import make_models, param_shapes
  trees = {}
  for family in ("llama", "gpt2"):
    module = RetroModel(retro_config(family))
    trees[family] = jax.eval_shape(functools.partial(lm_step.init_params, module, SEQ_CHUNKS,
                                                     True), jax.random.key(0))
  for share in (True, False):
    config = pretrain.get_config("tiny")
    config.share_embedders = share
    mc = memory.model_config(config)
    trees[f"realm share={share}"] = param_shapes(make_models(config, mc), mc)
  for name, tree in trees.items():
    axes = logical_axes(tree)
    assert len(axes) == len(jax.tree.leaves(tree)), name
  llama = logical_axes(trees["llama"])
  assert llama["h_1/attn/q_proj/kernel"] == ("embed", "heads")
  assert llama["h_1/attn/o_proj/kernel"] == ("heads", "embed")
  assert llama["h_1/mlp/down_proj/kernel"] == ("mlp", "embed")
  assert llama["wte/embedding"] == ("vocab", "embed")
  assert logical_axes(trees["gpt2"])["h_0/mlp/c_proj/kernel"] == ("mlp", "embed")
  assert logical_axes(trees["gpt2"])["h_0/attn/c_proj/kernel"] == ("heads", "embed")
  realm = logical_axes(trees["realm share=True"])
  assert realm["encoder/realm/encoder/layer_0/attention/output/dense/kernel"] == ("heads", "embed")
  assert realm["encoder/realm/encoder/layer_0/output/dense/kernel"] == ("mlp", "embed")
  with pytest.raises(ValueError, match="partitioning.py"):
    axes_of("h_0/attn/something_new", 3)


def test_reader_parameters_have_logical_axes():
  import jax.numpy as jnp

  from realm_jax.models import RealmReader, tiny_config
  ids = jnp.zeros((1, 2, 8), jnp.int32)
  tree = jax.eval_shape(lambda: RealmReader(tiny_config()).init(
      jax.random.key(0), ids, ids, ids, ids, jnp.zeros((1, 2)))["params"])
  assert len(logical_axes(tree)) == len(jax.tree.leaves(tree))


def test_rules_and_mesh_errors_name_the_flag():
  assert sharding.mesh_axes("data=-1", 8) == {"data": 8, "fsdp": 1, "tensor": 1}
  assert sharding.mesh_axes("data=2,tensor=2,fsdp=-1", 8) == {"data": 2, "fsdp": 2, "tensor": 2}
  for spec in ("data=3", "data=2,fsdp=2", "fsdp=8", "data=2,pipeline=4", "data=-1,fsdp=-1"):
    with pytest.raises(ValueError, match="--config.mesh"):
      sharding.mesh_axes(spec, 8, "--config.mesh")
  assert sharding.parse_rules("embed=none,heads=fsdp") == {"embed": None, "heads": "fsdp"}
  with pytest.raises(ValueError, match="--config.sharding_rules.*'layers' is not a logical"):
    sharding.parse_rules("layers=fsdp")
  with pytest.raises(ValueError, match="--config.sharding_rules.*names no mesh axis"):
    sharding.parse_rules("embed=model")


def test_a_dimension_the_mesh_axis_does_not_divide_stays_whole():
  mesh = sharding.make_mesh(jax.devices()[:8], sharding.mesh_axes(MESH_3D, 8))
  rules = sharding.parse_rules("")
  assert sharding.spec_for((32, 48), ("embed", "mlp"), mesh, rules) == P("fsdp", "tensor")
  assert sharding.spec_for((9, 48), ("embed", "mlp"), mesh, rules) == P(None, "tensor")
  # one mesh axis at most once per array
  same = {"embed": "tensor", "heads": "tensor"}
  assert sharding.spec_for((32, 32), ("embed", "heads"), mesh, same) == P("tensor", None)


def test_optimizer_state_is_split_like_its_parameters():
  module = RetroModel(retro_config("llama"))
  params = jax.eval_shape(functools.partial(lm_step.init_params, module, SEQ_CHUNKS, True),
                          jax.random.key(0))
  _, tx = lm_step.optimizer(optimizer_config(freeze=False), params)
  states, _, _ = laid_out(MESH_3D, params, tx)
  q = states.params["h_1"]["attn"]["q_proj"]["kernel"]
  assert q.spec == P("fsdp", "tensor")
  adam = [s for path, s in jax.tree_util.tree_leaves_with_path(states.opt_state)
          if jax.tree_util.keystr(path).endswith("['h_1']['attn']['q_proj']['kernel']")]
  assert len(adam) == 2 and all(s.spec == q.spec for s in adam)  # mu and nu
  assert states.step.spec == P()


# ------------------------------------------------------------------------------- the step
@functools.lru_cache(maxsize=None)
def retro_step(family: str, freeze: bool, mesh: str):
  module = RetroModel(retro_config(family))
  init = functools.partial(lm_step.init_params, module, SEQ_CHUNKS, True)
  params = jax.eval_shape(init, jax.random.key(0))
  _, tx = lm_step.optimizer(optimizer_config(freeze), params)
  states, data, rep = laid_out(mesh, params, tx)
  step = functools.partial(lm_step.train_step, module=module, retrieval=True,
                           freeze_decoder=freeze, dropout=False)
  fn = jax.jit(sharding.traced_on(rep.mesh, step), in_shardings=(states, data, rep),
               out_shardings=(states, rep), donate_argnums=0)  # with the activation hints
  create = jax.jit(lambda key: TrainState.create(apply_fn=None, params=init(key), tx=tx),
                   out_shardings=states)
  return create, fn, data


def run_retro(family: str, freeze: bool, mesh: str, steps: int = 2):
  create, fn, data = retro_step(family, freeze, mesh)
  state = create(jax.random.key(0))
  losses = []
  for s in range(steps):
    state, out = fn(state, jax.device_put(retro_batch(s), data), jax.random.key(3))
    losses.append(float(out["loss"]))
  return state, losses


@pytest.mark.parametrize("family,freeze", [("llama", True)])
def test_retro_step_on_three_mesh_axes_equals_one_device(family, freeze):
  """A RETROfit of a Llama decoder (frozen; CCA and the neighbour encoder trained): after two
  steps on data 2 x fsdp 2 x tensor 2 the parameters and losses equal one device's to 1e-5.
  (GPT-2's parameters take the same rules: test_every_parameter_of_every_model_has_logical_axes;
  the whole RETRO trainer runs on this mesh in test_retro_train.py.)"""
  one, one_losses = run_retro(family, freeze, "data=1")
  split, split_losses = run_retro(family, freeze, MESH_3D)
  assert split_arrays(split.params) > 10 and split_arrays(split.opt_state) > 10
  np.testing.assert_allclose(split_losses, one_losses, rtol=1e-5)
  assert one_losses[0] != one_losses[1]
  chex.assert_trees_all_close(jax.device_get(split.params), jax.device_get(one.params),
                              atol=1e-5, rtol=0)


# --------------------------------------------------------------------- created split, saved
def test_parameters_are_created_split_never_whole_on_one_device(tmp_path):
  """The loop's init is compiled to write each device's part only: per device its outputs are its
  parts, and its outputs and temporaries (random bits) together stay under the size of the
  parameters whole (with the state replicated, the outputs alone are that)."""
  from realm_jax.train.loop import TrainLoop
  config = ml_collections.ConfigDict({"batch_size": 8, "seed": 0, "mesh": MESH_3D})
  loop = TrainLoop(config, str(tmp_path))
  module = RetroModel(retro_config("llama"))
  init = functools.partial(lm_step.init_params, module, SEQ_CHUNKS, True)
  params = loop.init_params(init, jax.random.key(0))
  whole = sum(x.nbytes for x in jax.tree.leaves(params))
  held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))
  assert held < whole / 2
  abstract = jax.eval_shape(init, jax.random.key(0))
  compiled = jax.jit(init, out_shardings=loop.param_shardings(abstract)).lower(
      jax.random.key(0)).compile()
  used = compiled.memory_analysis()
  assert used.output_size_in_bytes <= held + 8 * len(jax.tree.leaves(params))  # (+ a pointer each)
  assert used.output_size_in_bytes + used.temp_size_in_bytes < whole
  wte = params["wte"]["embedding"]
  assert wte.sharding.spec == P("tensor", "fsdp")
  assert not (tmp_path / "checkpoints").exists()  # nothing written before start()


def test_checkpoint_saved_on_one_mesh_restores_bit_identical_on_others(tmp_path):
  """Saved split over data 2 x fsdp 2 x tensor 2, restored onto one device and onto fsdp 4 x
  tensor 2: the same bytes, each with the new mesh's layout."""
  state, _ = run_retro("llama", True, MESH_3D, steps=1)
  saved = jax.device_get(state)
  manager = checkpoints.checkpoint_manager(str(tmp_path / "ckpt"), data=False,
                                           asynchronous=False)
  checkpoints.save(manager, 1, state, {"step": 1})
  module = RetroModel(retro_config("llama"))
  init = functools.partial(lm_step.init_params, module, SEQ_CHUNKS, True)
  _, tx = lm_step.optimizer(optimizer_config(True), jax.eval_shape(init, jax.random.key(0)))
  for mesh in ("data=1", "data=1,fsdp=4,tensor=2"):
    states, _, _ = laid_out(mesh, jax.eval_shape(init, jax.random.key(0)), tx)
    template = jax.jit(lambda key: TrainState.create(apply_fn=None, params=init(key), tx=tx),
                       out_shardings=states)(jax.random.key(1))
    restored, meta = checkpoints.restore_latest(
        checkpoints.checkpoint_manager(str(tmp_path / "ckpt"), data=False), template)
    assert meta["step"] == 1
    for (path, a), b, t in zip(jax.tree_util.tree_leaves_with_path(restored),
                               jax.tree.leaves(saved), jax.tree.leaves(template)):
      assert a.sharding == t.sharding, (mesh, jax.tree_util.keystr(path))
      np.testing.assert_array_equal(np.asarray(a), b, err_msg=f"{mesh} {jax.tree_util.keystr(path)}")
