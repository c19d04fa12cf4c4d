"""Runs larger than the machine (realm_jax/train/memory.py, and its use in pre-training): more
candidates than the corpus has blocks are refused as soon as the corpus is open; an estimate that
does not fit the device's memory is logged as a warning before anything is allocated."""

import logging
import os

import jax
import pytest

from realm_jax.train import memory

GIB = memory.GIB


def test_device_memory_on_the_cpu_is_the_hosts_ram_shared_by_its_devices():
  got = memory.device_memory()
  assert got is not None
  limit, what = got
  n = jax.local_device_count()
  assert limit == memory.host_ram_bytes() // n > 0
  assert what == ("host RAM" if n == 1 else f"host RAM shared by {n} CPU devices")
  assert memory.host_ram_bytes() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_an_estimate_that_does_not_fit_with_its_margin_is_a_warning():
  """16 GiB against a 10 GiB estimate warns: XLA took up to MARGIN x the estimate (a run whose
  estimate said 16.5 GiB asked for 33 GB). The verdict of the logged table agrees."""
  est = {"total": 10 * GIB}
  assert memory.memory_warning(est, None) is None
  assert memory.memory_warning(est, (100 * GIB, "host RAM")) is None
  warning = memory.memory_warning(est, (16 * GIB, "host RAM"))
  assert warning is not None and "the estimate is 10.00 GiB per device" in warning
  assert "the device has 16.00 GiB (host RAM)" in warning
  assert "--config.num_candidates" in warning and "--config.batch_size" in warning
  assert memory.fits(est, 100 * GIB) and not memory.fits(est, 16 * GIB)


@pytest.fixture
def tiny(tmp_path):
  try:  # the tiny config reads the embedded corpus and the MiniLM vocabulary (the demo extra)
    from realm_jax.checkpoints.minilm import minilm_dir
    from realm_jax.data.wiki_vital import summaries_path
    summaries_path(), minilm_dir()
  except Exception as e:  # noqa: BLE001
    pytest.skip(f"needs the demo extra: {e}")
  from realm_jax.configs.pretrain import get_config
  config = get_config("tiny")
  config.data_dir = str(tmp_path / "data")
  return config


def test_more_candidates_than_blocks_are_refused_before_the_examples(tiny, tmp_path):
  """num_candidates=1000 over a corpus of 140 blocks ran 30 s into a 33 GB allocation: refused,
  naming the flag and the corpus size, once the corpus is open and before its examples are
  built. As many candidates as blocks is fine (each query retrieves all the others)."""
  from realm_jax.train.init import build_models
  from realm_jax.train.pretrain_workdir import open_data
  _, _, vocab = build_models(tiny)
  tiny.num_candidates = 1000
  with pytest.raises(ValueError, match=r"--config.num_candidates=1000 is more than the (\d+) "
                     r"blocks of the corpus in .*Pass --config.num_candidates=\1 or fewer"):
    open_data(tiny, str(tmp_path / "w"), vocab)
  assert [p for p in os.listdir(tiny.data_dir) if p.startswith("examples")] == []
  from realm_jax.data.corpus import Corpus, CorpusConfig
  tiny.num_candidates = len(Corpus.build(os.path.join(tiny.data_dir, "corpus"),
                                         CorpusConfig.from_config(tiny.corpus, vocab)))
  open_data(tiny, str(tmp_path / "w"), vocab)


@pytest.mark.slow
def test_pretraining_warns_when_the_estimate_does_not_fit_the_device(tiny, tmp_path, monkeypatch,
                                                                     caplog):
  from realm_jax.train.pretrain import Trainer
  monkeypatch.setattr(memory, "device_memory", lambda: (GIB // 1024, "a test device's memory"),
                      raising=False)
  caplog.set_level(logging.INFO)
  trainer = Trainer(tiny, str(tmp_path / "w"))
  trainer.manager.close()
  trainer.metrics.close()
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert any("may not fit in memory" in m and "GiB (a test device's memory)" in m
             for m in warnings), warnings
  table = [r.getMessage() for r in caplog.records if "Memory per device" in r.getMessage()]
  assert len(table) == 1 and "does NOT fit" in table[0]


@pytest.mark.parametrize("name", ["ict", "dpr", "finetune", "build_index", "ablations"])
def test_the_estimate_is_refused_for_configs_of_other_runs(name):
  """memory_estimate.py ended in an AttributeError ('corpus', 'slice', 'share_embedders') for the
  configs of the runs it does not estimate; now one error names the configs it does."""
  import importlib
  config = importlib.import_module(f"realm_jax.configs.{name}").get_config("tiny")
  with pytest.raises(ValueError, match=rf"^--config=x\.py:tiny: .*configs/pretrain\.py or "
                                       r"realm_jax/configs/retro\.py"):
    memory.run_kind(config, "--config=x.py:tiny")


def test_the_runs_it_estimates_are_known_by_their_configs():
  from realm_jax.configs import pretrain, retro
  assert memory.run_kind(pretrain.get_config("tiny")) == "pretrain"
  assert memory.run_kind(retro.get_config("tiny")) == "retro"


def retro_estimate(c, devices, platform):
  """The estimate of the model a RETRO run of `c` builds (the trainer's own builder)."""
  from realm_jax.compile.steps import retro_model_config
  return memory.retro_estimate(c, devices, retro_model_config(c), platform=platform)


def test_retro_estimate_counts_the_state_and_under_fsdp_the_gathered_trained_weights():
  """By hand for the tiny RETRO (float32): 4 bytes a parameter held, 8 for AdamW's moments of the
  trained ones, on a TPU no float32 gradient or update buffer (its compiled step holds neither);
  split over fsdp, the trained weights gathered whole (4 bytes each, float32). A RETROfit's frozen
  decoder has no moments and is not gathered."""
  from realm_jax.configs import retro
  c = retro.get_config("tiny")
  whole = retro_estimate(c, 8, platform="tpu")  # data parallelism: all of it everywhere
  total = whole["params"]["decoder"]
  assert whole["parts"]["parameters"] == 4 * total
  assert whole["parts"]["optimizer state"] == 8 * total
  assert whole["parts"]["gathered weights"] == 0 and "gradients" not in whole["parts"]
  c.mesh = "data=2,fsdp=4"
  split = retro_estimate(c, 8, platform="tpu")["parts"]
  assert split["gathered weights"] == 4 * total
  assert split["parameters"] < 4 * total / 2   # most of it split 4 ways along "embed"
  c.freeze_decoder = True
  c.mesh = "data=-1"
  trained = retro_estimate(c, 8, platform="tpu")["parts"]["optimizer state"] // 8
  assert 0 < trained < total / 2
  c.mesh = "data=2,fsdp=4"
  assert retro_estimate(c, 8, platform="tpu")["parts"]["gathered weights"] == 4 * trained


def test_retro_estimate_of_a_decoder_memory_retrofit_is_that_model():
  """With `model.cca_memory=decoder` (CCA reads the decoder's own states of the neighbours: no
  neighbour encoder, CCA shaped like the decoder's attention) the estimate counts that model's
  parameters, as the model itself has them, and the neighbours' activations through the decoder:
  by hand for the tiny Llama RETRO (1 sequence of 64 tokens a device, 2 neighbours of 32 tokens per
  chunk of 16, width 32, 2 heads, float32, CCA at layer 2): each token of the neighbours keeps the
  state its 1 CCA layer reads (32 x 4 bytes) and one layer's working set, (34 x 32 + 5 x 2 x 32)
  x 2 bytes; the encoder's term it replaces is 1 layer of that working set with no state kept."""
  import jax
  from realm_jax.configs import retro
  from realm_jax.models.retro import RetroConfig, RetroModel
  c = retro.get_config("tiny")
  encoder = retro_estimate(c, 8, platform="tpu")
  c.model.cca_memory = "decoder"
  est = retro_estimate(c, 8, platform="tpu")
  model = RetroConfig(vocab_size=30522, num_layers=2, hidden_size=32, num_heads=2, mlp_size=64,
                      max_length=64, family="llama", num_kv_heads=1, chunk_length=16,
                      cca_layers=(2,), encoder_layers=1, num_neighbours=2, cca_memory="decoder")
  shapes = jax.eval_shape(lambda t, n: RetroModel(model).init(jax.random.key(0), t, n),
                          jax.ShapeDtypeStruct((1, 64), "int32"),
                          jax.ShapeDtypeStruct((1, 4, 2, 32), "int32"))
  count = sum(x.size for x in jax.tree.leaves(shapes))
  assert est["params"]["decoder"] == count != encoder["params"]["decoder"]
  tokens, per = 4 * 2 * 32, (34 * 32 + 5 * 2 * 32) * 2
  assert (est["parts"]["activations"] - encoder["parts"]["activations"]
          == tokens * (32 * 4 + per) - tokens * per)


def test_a_frozen_decoders_layers_below_the_first_cca_keep_no_activations():
  """With the decoder frozen, no gradient reaches the layers below the first CCA layer: by hand for
  the tiny RETRO (CCA at layer 2 of 2; 64 tokens a device, width 32, 2 heads, float32, nothing
  recomputed), one layer's activations fewer, (34 x 32 + 5 x 2 x 64) x 2 bytes a token; with CCA
  at layer 1, none fewer."""
  from realm_jax.configs import retro
  c = retro.get_config("tiny")
  act = lambda: retro_estimate(c, 8, platform="tpu")["parts"]["activations"]
  trained = act()
  c.freeze_decoder = True
  assert trained - act() == 64 * (34 * 32 + 5 * 2 * 64) * 2
  c.model.cca_layers = (1,)
  frozen = act()
  c.freeze_decoder = False
  assert act() == frozen


def test_with_flash_attention_the_decoder_keeps_no_attention_probabilities():
  """`model.attention=flash` forms no [heads, length, length] probabilities in the decoder's
  self-attention: by hand for the tiny RETRO made 128 tokens long (the kernel's least; 1
  sequence a device, 2 layers kept whole, 2 heads, float32), 5 x 2 x 128 x 2 bytes a token and
  layer fewer; nothing else changes (the neighbours' attention is not flash, encoder or decoder
  states)."""
  from realm_jax.configs import retro
  c = retro.get_config("tiny")
  c.db.seq_chunks, c.model.max_length = 8, 128
  est = lambda: retro_estimate(c, 8, platform="tpu")["parts"]
  dense = est()
  c.model.attention = "flash"
  flash = est()
  assert dense["activations"] - flash["activations"] == 128 * 2 * (5 * 2 * 128) * 2
  assert {k: v for k, v in dense.items() if k != "activations"} == {
      k: v for k, v in flash.items() if k != "activations"}
  # CCA reading the decoder's states of the neighbours: those run the dense attention, flash or
  # not (models/retro.py), so their probabilities stay counted; only the decoder's go.
  c.model.cca_memory = "decoder"
  flash = est()
  c.model.attention = "dense"
  assert est()["activations"] - flash["activations"] == 128 * 2 * (5 * 2 * 128) * 2


def test_with_layers_recomputed_the_estimate_adds_every_layers_dropout_masks():
  """Tiny REALM over 8 devices (1 example a device, 4 candidates; width 32, 2 heads, 2 layers),
  layers recomputed, dropout on: one byte a mask element, by hand, per layer and token the
  attention's [2 heads, length] and two of width 32, the embeddings' once, for the query (32
  tokens), the 4 candidates re-embedded (48 each) and the 4 joint sequences (64 each). Nothing
  else changes; with dropout off, or every activation kept (those count them), no masks."""
  from realm_jax.configs import pretrain
  c = pretrain.get_config("tiny")
  c.remat, c.model.num_hidden_layers = True, 2  # (the tiny config has 1)
  assert c.dropout and (c.batch_size, c.num_candidates) == (8, 4)
  per_token = lambda length: 2 * (2 * length + 2 * 32) + 32
  by_hand = 32 * per_token(32) + 4 * 48 * per_token(48) + 4 * 64 * per_token(64)
  assert by_hand == 183_296
  on = memory.estimate(c, 8, 1000, platform="tpu")
  assert on["parts"]["dropout masks"] == by_hand
  c.dropout = False
  off = memory.estimate(c, 8, 1000, platform="tpu")
  assert off["parts"] == {k: v for k, v in on["parts"].items() if k != "dropout masks"}
  c.dropout, c.remat = True, False
  assert "dropout masks" not in memory.estimate(c, 8, 1000, platform="tpu")["parts"]


@pytest.mark.parametrize("kind", ["pretrain", "retro"])
def test_on_the_cpu_and_gpu_the_estimate_adds_a_float32_gradient_and_update_of_what_is_trained(
    kind):
  """XLA:CPU's compiled step holds a float32 gradient and an update buffer of each trained
  parameter that the TPU compiler's does not (docs/tpu.md): 8 bytes a trained parameter per
  device, by hand (REALM's tiny retriever and encoder all trained; a RETROfit's frozen decoder
  not), nothing else changed; an unknown platform is refused."""
  from realm_jax.configs import pretrain, retro
  if kind == "pretrain":
    c = pretrain.get_config("tiny")
    est = lambda platform: memory.estimate(c, 8, 1000, platform=platform)
    trained = lambda e: sum(e["params"].values())
  else:
    c = retro.get_config("tiny")
    c.freeze_decoder = True
    est = lambda platform: retro_estimate(c, 8, platform=platform)
    trained = lambda e: e["parts"]["optimizer state"] // 8
  tpu, cpu, gpu = est("tpu"), est("cpu"), est("gpu")
  n = trained(tpu)
  assert 0 < n and (kind == "pretrain" or n < tpu["params"]["decoder"] / 2)
  assert cpu["parts"] == gpu["parts"] == {**tpu["parts"], "gradients": 4 * n,
                                          "update buffers": 4 * n}
  assert cpu["total"] == tpu["total"] + 8 * n
  with pytest.raises(ValueError, match="'metal' platform: use one of"):
    est("metal")
