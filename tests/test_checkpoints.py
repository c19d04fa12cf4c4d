"""Checkpoint conversion: HF round trips, HF from_pretrained on our export, TF1 names, bad input."""

import json
import os
import sys

import numpy as np
import pytest
from conftest import perturbed, write_tf1_checkpoint

torch = pytest.importorskip("torch")
realm_hf = pytest.importorskip("transformers.models.deprecated.realm.modeling_realm")

from realm_jax.checkpoints import (CheckpointError, detect_kind, from_hf_state_dict,  # noqa: E402
                                   load_hf_checkpoint, read_state_dict, save_hf_checkpoint,
                                   to_hf_state_dict)

HF_CLASSES = {"embedder": "RealmEmbedder", "retriever": "RealmScorer",
              "encoder": "RealmKnowledgeAugEncoder", "reader": "RealmReader"}


def _hf_model(kind, hf_config, seed=0, shared=True):
  if kind == "retriever" and not shared:
    model = realm_hf.RealmScorer(hf_config, query_embedder=realm_hf.RealmEmbedder(hf_config))
  else:
    model = getattr(realm_hf, HF_CLASSES[kind])(hf_config)
  return perturbed(model, seed=seed)


def _numpy_state(model):
  return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind,shared", [("embedder", True), ("retriever", True),
                                         ("retriever", False), ("encoder", True), ("reader", True)])
def test_hf_round_trip_is_bit_identical(hf_config, jax_config, kind, shared):
  model = _hf_model(kind, hf_config, shared=shared)
  before = _numpy_state(model)
  assert detect_kind(before) == kind
  params, extras = from_hf_state_dict(model.state_dict(), kind, jax_config)
  after = to_hf_state_dict(params, kind, extras)
  assert sorted(after) == sorted(before)
  for k in before:
    assert after[k].dtype == before[k].dtype and after[k].shape == before[k].shape, k
    assert np.array_equal(after[k], before[k]), k
  # HF accepts it back with strict=True.
  fresh = getattr(realm_hf, HF_CLASSES[kind])(hf_config) if shared else _hf_model(kind, hf_config, 9, False)
  fresh.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in after.items()}, strict=True)


def test_bert_round_trip_from_bare_and_prefixed_keys(jax_config):
  from transformers import BertConfig, BertModel
  hf = perturbed(BertModel(BertConfig(**{k: getattr(jax_config, k) for k in (
      "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
      "max_position_embeddings")})))
  state = _numpy_state(hf)
  params, extras = from_hf_state_dict(state, "bert", jax_config)
  assert set(extras) <= {"embeddings.position_ids"}
  back = to_hf_state_dict(params, "bert", extras)
  assert all(np.array_equal(back[k], v) for k, v in state.items())
  prefixed, _ = from_hf_state_dict({"bert." + k: v for k, v in state.items()}, "bert", jax_config)
  assert np.array_equal(prefixed["encoder"]["layer_1"]["output"]["dense"]["kernel"],
                        params["encoder"]["layer_1"]["output"]["dense"]["kernel"])


def test_saved_checkpoint_loads_in_hf_from_pretrained(tmp_path, hf_config, jax_config):
  model = _hf_model("encoder", hf_config, seed=3)
  params, extras = from_hf_state_dict(model.state_dict(), "encoder", jax_config)
  save_hf_checkpoint(tmp_path / "enc", jax_config, params, "encoder", extras)
  assert sorted(os.listdir(tmp_path / "enc")) == ["config.json", "model.safetensors"]
  loaded = realm_hf.RealmKnowledgeAugEncoder.from_pretrained(tmp_path / "enc").eval()
  ids = torch.randint(1, hf_config.vocab_size, (1, hf_config.num_candidates, 9))
  with torch.no_grad():
    np.testing.assert_array_equal(loaded(ids).logits.numpy(), model(ids).logits.numpy())
  config2, params2, _ = load_hf_checkpoint(tmp_path / "enc")
  assert config2 == jax_config
  assert np.array_equal(params2["cls"]["predictions"]["bias"], params["cls"]["predictions"]["bias"])


# ----------------------------------------------------------------------------- TF1 checkpoints


def _tf1_name(hf_key, prefix_map, renames=None):
  """HF key -> original TF1 variable name (the inverse of HF's load_tf_weights_in_realm)."""
  for hf_prefix, tf_prefix in prefix_map:
    if hf_key.startswith(hf_prefix):
      rest = hf_key[len(hf_prefix):]
      break
  else:
    return None, False
  parts = rest.split(".")
  out, i = [], 0
  while i < len(parts):
    if parts[i] == "layer" and i + 1 < len(parts) and parts[i + 1].isdigit():
      out.append(f"layer_{parts[i + 1]}")
      i += 2
    else:
      out.append(parts[i])
      i += 1
  out = [(renames or {}).get(p, p) for p in out]
  leaf, scope = out[-1], out[:-1]
  if scope and scope[-1].endswith("_embeddings"):
    return tf_prefix + "/".join(scope), False
  if scope and scope[-1] in ("LayerNorm", "layer_normalization"):
    return tf_prefix + "/".join(scope + [{"weight": "gamma", "bias": "beta"}[leaf]]), False
  if leaf == "weight":
    return tf_prefix + "/".join(scope + ["kernel"]), True
  return tf_prefix + "/".join(scope + [leaf]), False


TF1_LAYOUTS = {
    "encoder": [("realm.", "bert/"), ("cls.predictions.transform.", "cls/predictions/transform/"),
                ("cls.predictions.bias", "cls/predictions/output_bias")],
    "embedder": [("realm.", "module/module/module/bert/"), ("cls.", "module/module/")],
    "reader": [("realm.", "reader/module/bert/"), ("qa_outputs.", "reader/")],
}
TF1_RENAMES = {"dense_intermediate": "dense", "dense_output": "dense_1"}


@pytest.mark.parametrize("kind", sorted(TF1_LAYOUTS))
def test_tf1_checkpoint_loads_with_the_same_values_as_hf(tmp_path, hf_config, jax_config, kind):
  pytest.importorskip("tensorflow")
  from realm_jax.checkpoints import load_tf1_checkpoint

  source = _hf_model(kind, hf_config, seed=11)
  variables = {}
  for key, value in _numpy_state(source).items():
    if key == "cls.predictions.bias":
      name, transpose = ("cls/predictions/output_bias", False) if kind == "encoder" else (None, 0)
    else:
      name, transpose = _tf1_name(key, TF1_LAYOUTS[kind], TF1_RENAMES)
    unused_head = kind != "encoder" and "predictions" in (name or "")
    if name is not None and "position_ids" not in name and not unused_head:
      variables[name] = value.T.copy() if transpose else value
  variables["bert/encoder/layer_0/attention/self/query/kernel/adam_m"] = np.zeros((2, 2), np.float32)
  variables["global_step"] = np.int64(7)
  prefix = write_tf1_checkpoint(tmp_path / "model.ckpt", variables)

  _, params = load_tf1_checkpoint(prefix, kind, jax_config)
  ours = to_hf_state_dict(params, kind)
  # Independent oracle: HF's own TF1 loader, into a fresh model.
  oracle = getattr(realm_hf, HF_CLASSES[kind])(hf_config)
  realm_hf.load_tf_weights_in_realm(oracle, hf_config, prefix)
  want = _numpy_state(oracle)
  source_state = _numpy_state(source)
  for key in ours:
    if not key.startswith("cls.predictions.decoder"):
      assert np.array_equal(ours[key], want[key]), key
      assert np.array_equal(ours[key], source_state[key]), key


def test_tf1_orqa_layer_normalization_sets_eps(tmp_path, hf_config, jax_config):
  pytest.importorskip("tensorflow")
  from realm_jax.checkpoints import load_tf1_checkpoint
  variables = {}
  for key, value in _numpy_state(_hf_model("embedder", hf_config)).items():
    name, transpose = _tf1_name(key, TF1_LAYOUTS["embedder"])
    name = name and name.replace("module/module/LayerNorm/", "module/module/layer_normalization/")
    if name and "position_ids" not in name and "predictions" not in name:
      variables[name] = value.T.copy() if transpose else value
  prefix = write_tf1_checkpoint(tmp_path / "ict.ckpt", variables)
  config, params = load_tf1_checkpoint(prefix, "embedder", jax_config)
  assert config.projection_layer_norm_eps == 1e-3
  assert params["cls"]["LayerNorm"]["scale"].shape == (hf_config.retriever_proj_size,)


# ----------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def encoder_state(hf_config):
  return _numpy_state(_hf_model("encoder", hf_config, seed=5))


def test_missing_key_names_the_key(encoder_state, jax_config):
  state = dict(encoder_state)
  del state["realm.encoder.layer.1.attention.self.key.bias"]
  with pytest.raises(CheckpointError, match=r"ckpt.safetensors is missing parameter "
                     r"'realm.encoder.layer.1.attention.self.key.bias'"):
    from_hf_state_dict(state, "encoder", jax_config, source="ckpt.safetensors")


def test_wrong_vocab_size_says_so(encoder_state, jax_config):
  with pytest.raises(CheckpointError, match=r"vocabulary has 100 entries .*"
                     r"config.vocab_size=120. Use the config.json"):
    from_hf_state_dict(encoder_state, "encoder", jax_config.replace(vocab_size=120))


def test_wrong_shape_names_key_and_shapes(encoder_state, jax_config):
  with pytest.raises(CheckpointError, match=r"'realm.encoder.layer.0.intermediate.dense.bias' has "
                     r"shape \(37,\) but the config expects \(40,\)"):
    from_hf_state_dict(encoder_state, "encoder", jax_config.replace(intermediate_size=40))


def test_other_kind_and_unknown_checkpoints_are_refused(encoder_state, jax_config):
  with pytest.raises(CheckpointError, match="holds a 'encoder' checkpoint, not a 'reader' one"):
    from_hf_state_dict(encoder_state, "reader", jax_config, source="x")
  with pytest.raises(CheckpointError, match="does not look like a REALM or BERT checkpoint"):
    from_hf_state_dict({"transformer.h.0.attn.c_attn.weight": np.zeros(3)}, "encoder", jax_config)
  with pytest.raises(CheckpointError, match="Unknown model kind 'gpt'"):
    from_hf_state_dict(encoder_state, "gpt", jax_config)


def test_pickles_and_missing_files_are_refused(tmp_path):
  (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
  with pytest.raises(CheckpointError, match="pickled PyTorch checkpoint; realm_jax never loads"):
    read_state_dict(tmp_path / "pytorch_model.bin")
  with pytest.raises(FileNotFoundError, match="pytorch_model.bin, a pickle"):
    read_state_dict(tmp_path)
  with pytest.raises(FileNotFoundError, match="nowhere.safetensors does not exist"):
    read_state_dict(tmp_path / "nowhere.safetensors")
  (tmp_path / "bad.safetensors").write_bytes(b"garbage")
  with pytest.raises(CheckpointError, match="bad.safetensors is not a readable safetensors"):
    read_state_dict(tmp_path / "bad.safetensors")
  os.makedirs(tmp_path / "noconfig")
  from safetensors.numpy import save_file
  save_file({"embeddings.word_embeddings.weight": np.zeros((3, 2), np.float32)},
            str(tmp_path / "noconfig" / "model.safetensors"))
  with pytest.raises(FileNotFoundError, match="config.json does not exist"):
    load_hf_checkpoint(tmp_path / "noconfig")


# ----------------------------------------------------------------------- training checkpoints


def test_a_checkpoint_whose_arrays_read_other_bytes_is_set_aside_for_the_one_before(
    tmp_path, caplog):
  """Bytes changed inside a step's array files can decode (orbax's compression has no checksum)
  into other numbers: here step 6's arrays are step 4's files. The CRC-32 recorded at the save
  tells: the step is set aside with one warning naming it, and step 4 is used. A step saved before
  CRCs were recorded is restored as it reads; the meta given back is the one saved."""
  import shutil

  import jax
  import jax.numpy as jnp
  from realm_jax.checkpoints import training as checkpoints
  directory = tmp_path / "checkpoints"
  rng = np.random.default_rng(0)
  state = {"params": {"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32),
                      "b": jnp.ones(32)}, "step": jnp.zeros((), jnp.int32)}
  manager = checkpoints.checkpoint_manager(str(directory), asynchronous=False, data=False)
  for step in (2, 4, 6):
    checkpoints.save(manager, step, jax.tree.map(lambda x, s=step: x + s, state), {"step": step})
  shutil.rmtree(directory / "6" / "state")
  shutil.copytree(directory / "4" / "state", directory / "6" / "state")
  got, meta = checkpoints.restore_latest(manager, state)
  assert meta == {"step": 4} and float(got["params"]["b"][0]) == 5.0
  aside = list((tmp_path / "checkpoints-damaged").iterdir())
  assert [p.name.split("-")[0] for p in aside] == ["6"] and manager.all_steps() == [2, 4]
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert len(warnings) == 1 and warnings[0].startswith(
      f"The checkpoint {directory}/6 is damaged (3 of its arrays read other bytes than were "
      "saved, by the CRC-32 recorded then (params/b, params/w, ...)): step 4 is used "
      "instead"), warnings
  # A checkpoint without CRCs (saved before they were recorded) is taken as it reads.
  checkpoints.save(manager, 8, state, {"step": 8})
  meta_file = directory / "8" / "meta" / "metadata"
  record = json.loads(meta_file.read_text())
  assert sorted(record[checkpoints.CRC_KEY]) == ["params/b", "params/w", "step"]
  meta_file.write_text(json.dumps({"step": 8}))
  got, meta = checkpoints.restore_latest(manager, state)
  assert meta == {"step": 8} and float(got["params"]["b"][0]) == 1.0


def _saved_steps_2_and_4(tmp_path, arrays: int):
  """(manager, state): `arrays` small arrays saved as steps 2 and 4 in tmp_path/checkpoints."""
  import jax.numpy as jnp
  from realm_jax.checkpoints import training as checkpoints
  state = {f"a{i}": jnp.full(8, float(i)) for i in range(arrays)}
  manager = checkpoints.checkpoint_manager(str(tmp_path / "checkpoints"), asynchronous=False,
                                           data=False)
  for step in (2, 4):
    checkpoints.save(manager, step, state, {"step": step})
  return manager, state


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_checkpoint_whose_array_metadata_does_not_read_is_passed_over_quietly(
    tmp_path, monkeypatch):
  """A damaged manifest fails the reads of every array's metadata: when the first fails, orbax
  closes its event loop while the others are under way, and each of them, done, calls back into
  the closed loop, whose RuntimeError Python printed as an `Exception ignored` traceback (one per
  array: 101 for the tiny RETRO run) at any time up to the exit. After the restore those are
  dropped, and every other unraisable exception still shows."""
  import types

  from realm_jax.checkpoints import training as checkpoints
  shown = []
  monkeypatch.setattr(sys, "unraisablehook", shown.append)
  manager, state = _saved_steps_2_and_4(tmp_path, arrays=20)
  manifest = tmp_path / "checkpoints" / "4" / "state" / "manifest.ocdbt"
  data = bytearray(manifest.read_bytes())
  data[len(data) // 3:len(data) // 3 + 64] = bytes(64)
  manifest.write_bytes(bytes(data))
  _, meta = checkpoints.restore_latest(manager, state, set_aside=False)
  assert meta == {"step": 2}
  late = types.SimpleNamespace(exc_value=RuntimeError("Event loop is closed"), object=None)
  other = types.SimpleNamespace(exc_value=RuntimeError("something else"), object=None)
  sys.unraisablehook(late)
  sys.unraisablehook(other)
  assert shown == [other]

  # A read still waiting when the loop closes: its coroutine is closed, and orbax's
  # `except BaseException` turns the GeneratorExit into an Exception. A real coroutine doing that,
  # closed here as the loop closes it; an Exception from a coroutine for another reason still shows.
  @types.coroutine
  def tensorstore_read():
    yield  # a read under way

  async def read_array():
    try:
      await tensorstore_read()
    except BaseException as e:
      raise Exception("Encountered error while reading array index") from e

  def closed_while_waiting(coroutine):
    coroutine.send(None)  # now waiting for the read
    try:
      coroutine.close()
    except Exception as e:  # noqa: BLE001  (what Python would report as unraisable)
      return types.SimpleNamespace(exc_value=e, object=coroutine)
    raise AssertionError("close() did not raise")

  closed = closed_while_waiting(read_array())
  assert isinstance(closed.exc_value.__cause__, GeneratorExit)
  failed = types.SimpleNamespace(exc_value=Exception("a read failed"), object=read_array())
  sys.unraisablehook(closed)
  sys.unraisablehook(failed)
  failed.object.close()
  assert shown == [other, failed]


def test_gathered_reads_of_a_damaged_checkpoint_are_not_logged_when_collected(tmp_path, caplog):
  """When one read of a damaged step fails, orbax gives up on the reads gathered with it, and
  asyncio logs each gathering future it finalises ("_GatheringFuture exception was never
  retrieved", a page of TensorStore spec) whenever the collector gets to it: `ask` printed two
  after its `error:` line once. After such a restore they are dropped; any other future's error
  is still logged. Real futures of a real event loop, collected here."""
  import asyncio
  import gc
  import logging

  from realm_jax.checkpoints import training as checkpoints
  manager, state = _saved_steps_2_and_4(tmp_path, arrays=4)
  manifest = tmp_path / "checkpoints" / "4" / "state" / "manifest.ocdbt"
  manifest.write_bytes(bytes(len(manifest.read_bytes())))
  _, meta = checkpoints.restore_latest(manager, state, set_aside=False)
  assert meta == {"step": 2}

  async def read_array():  # orbax's wrapping of a TensorStore read error
    try:
      raise ValueError("FAILED_PRECONDITION: Truncated Zstd-compressed stream")
    except ValueError as e:
      raise Exception("Encountered error while reading array index") from e

  async def something_else():
    raise RuntimeError("not a read")

  async def gathered(coroutine):
    future = asyncio.gather(coroutine)
    while not future.done():
      await asyncio.sleep(0)
    return future  # done, its exception never retrieved

  def gathered_and_dropped(coroutine):
    loop = asyncio.new_event_loop()
    try:
      future = loop.run_until_complete(gathered(coroutine))
    finally:
      loop.close()
    assert future.done()
    del future
    gc.collect()

  caplog.set_level(logging.ERROR, logger="asyncio")
  gathered_and_dropped(read_array())
  gathered_and_dropped(something_else())
  logged = [r for r in caplog.records if "never retrieved" in r.getMessage()]
  assert len(logged) == 1 and isinstance(logged[0].exc_info[1], RuntimeError), logged
