"""A RETRO export (realm_jax/checkpoints/retro_export.py) read back, and a damaged one refused with
an error naming the flag and what to do, as a damaged DPR or MiniLM export is."""

import numpy as np
import pytest

from realm_jax.checkpoints import retro_export
from realm_jax.models.retro import RetroConfig

PARAMS = {"decoder": {"wte": np.arange(12, dtype=np.float32).reshape(4, 3)}}


@pytest.fixture
def export(tmp_path):
  path = tmp_path / "retro" / "export"
  retro_export.save(str(path), RetroConfig(vocab_size=4, num_layers=1), PARAMS,
                    {"tokenizer": "t", "key_fingerprint": "k"})
  return path


def test_an_export_reads_back(export):
  config, params, meta = retro_export.load(str(export))
  assert config.vocab_size == 4 and meta["tokenizer"] == "t"
  np.testing.assert_array_equal(params["decoder"]["wte"], PARAMS["decoder"]["wte"])


@pytest.mark.parametrize("damage", ["header_length", "header_text", "truncated"])
def test_a_damaged_safetensors_file_is_an_error_naming_the_flag(export, damage):
  """A damaged header ended retro_eval.py and retro_sample.py in safetensors' own error, with a
  traceback and without the flag or what to do."""
  weights = export / retro_export.PARAMS
  data = bytearray(weights.read_bytes())
  if damage == "header_length":
    data[:8] = (10**12).to_bytes(8, "little")
  elif damage == "header_text":
    data[8:20] = b"\xff" * 12
  else:
    data = data[:len(data) // 2]
  weights.write_bytes(bytes(data))
  with pytest.raises(ValueError, match=(
      rf"^--models={export}: model\.safetensors is not a readable safetensors file \(.+\); "
      r"export the model again\.$")):
    retro_export.load(str(export), flag="--models")


def test_arrays_changed_after_saving_are_refused(export):
  weights = export / retro_export.PARAMS
  data = bytearray(weights.read_bytes())
  data[-4:] = bytes(b ^ 0xFF for b in data[-4:])
  weights.write_bytes(bytes(data))
  with pytest.raises(ValueError, match=r"model\.safetensors is corrupt .*export the model again"):
    retro_export.load(str(export))
