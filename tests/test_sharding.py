"""The embedder with its batch sharded over 8 fake CPU devices equals the single-device result."""

import jax
import numpy as np
import pytest
from conftest import jit_init, random_inputs
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from realm_jax.models import KnowledgeAugEncoder, RealmEmbedder, tiny_config


@pytest.fixture(scope="module")
def mesh():
  if jax.device_count() < 8:
    pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (set by conftest)")
  return Mesh(np.array(jax.devices()[:8]), ("data",))


def test_sharded_embedder_equals_single_device(mesh):
  config = tiny_config()
  model = RealmEmbedder(config)
  ids, mask, types = random_inputs(np.random.default_rng(0), (16,), 12, config.vocab_size)
  params = jit_init(model, 0, ids, mask, types)
  params = jax.tree.map(lambda p: p + 0.1 * np.random.default_rng(1).normal(size=p.shape), params)

  apply = lambda p, i, m, t: model.apply({"params": p}, i, m, t)
  single = jax.jit(apply)(jax.device_put(params, jax.devices()[0]), ids, mask, types)

  data = NamedSharding(mesh, P("data"))
  replicated = NamedSharding(mesh, P())
  sharded_fn = jax.jit(apply, in_shardings=(replicated, data, data, data), out_shardings=data)
  out = sharded_fn(jax.device_put(params, replicated), *(jax.device_put(x, data)
                                                         for x in (ids, mask, types)))
  assert len(out.sharding.device_set) == 8
  assert out.addressable_shards[0].data.shape == (2, config.retriever_proj_size)
  np.testing.assert_allclose(np.asarray(out), np.asarray(single), atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_sharded_encoder_bf16_runs_and_is_close_to_f32(mesh):
  config = tiny_config()
  ids, mask, types = random_inputs(np.random.default_rng(2), (8, 3), 10, config.vocab_size)
  f32 = KnowledgeAugEncoder(config)
  params = jit_init(f32, 0, ids, mask, types)
  data = NamedSharding(mesh, P("data"))
  outs = {}
  for dtype in ("float32", "bfloat16"):
    model = KnowledgeAugEncoder(config.replace(dtype=dtype))
    fn = jax.jit(lambda p, i, m, t: model.apply({"params": p}, i, m, t), out_shardings=data)
    outs[dtype] = np.asarray(fn(params, *(jax.device_put(x, data) for x in (ids, mask, types))))
  assert outs["bfloat16"].dtype == np.float32  # logits come back in float32
  assert jax.tree.leaves(params)[0].dtype == np.float32
  np.testing.assert_allclose(outs["bfloat16"], outs["float32"], atol=0.1)


@pytest.mark.parametrize("pooling,dim", [("projected_cls", 16), ("mean", 32)])
def test_memory_estimate_index_shard_has_the_embedding_width(pooling, dim):
  """The index shard per device is rows / devices x the width the document tower really embeds
  to: retriever_proj_size with REALM's projected [CLS], hidden_size with mean pooling (the tiny
  config's random models: 16 and 32)."""
  import jax.numpy as jnp

  from realm_jax.configs import pretrain as pretrain_configs
  from realm_jax.train import memory
  from realm_jax.train.init import make_models
  config = pretrain_configs.get_config("tiny")
  config.pooling = pooling
  mc = memory.model_config(config)
  retriever = make_models(config, mc).retriever
  ids = jnp.zeros((2, 8), jnp.int32)
  params = jax.eval_shape(lambda: retriever.init(
      jax.random.key(0), dict(input_ids=ids, attention_mask=ids, token_type_ids=ids),
      dict(input_ids=ids[:, None], attention_mask=ids[:, None], token_type_ids=ids[:, None])))
  docs = jax.eval_shape(lambda p: retriever.apply(p, ids, ids, ids, method="embed_documents"),
                        params)
  assert docs.shape == (2, dim)  # what the index will hold, from the models themselves
  est = memory.estimate(config, devices=8, index_rows=1000, mc=mc, platform="cpu")
  assert est["dim"] == dim
  assert est["parts"]["index shard"] == 125 * dim * 4  # 1000 / 8 float32 rows
