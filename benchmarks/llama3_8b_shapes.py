"""Writes a stand-in for a Llama-3-8B checkpoint directory that holds its shapes alone, to compile a
RETROfit of it for a TPU slice without downloading 16 GB (experiments/compile_for.py reads a
RETROfit's decoder by its settings alone, never its weights): config.json with the shapes Meta
publishes for Meta-Llama-3-8B, and a tokenizer.json of the same size (128,256 ids;
<|begin_of_text|> 128000, <|end_of_text|> 128001 and 254 reserved special tokens after them) whose
128,000 ordinary tokens are placeholders, and a shard index naming no shards. No weights: nothing
here can be trained or sampled from.
With the real directory (config.json and tokenizer.json are all compile_for.py reads) the figures
are the same.

  python benchmarks/llama3_8b_shapes.py --out=work/llama3_8b_shapes
  python experiments/compile_for.py --config=realm_jax/configs/retro.py:retrofit_smollm2 \\
      --config.init=work/llama3_8b_shapes \\
      --config.db.tokenizer_file=work/llama3_8b_shapes/tokenizer.json \\
      --topology=v5p-128 --mesh=data=8,fsdp=16
"""

from __future__ import annotations

import argparse
import json
import os

# Meta-Llama-3-8B's config.json (the shapes and settings the decoder reads).
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "mlp_bias": False,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256}
ORDINARY = 128_000


def write(out: str) -> str:
  """Writes config.json, tokenizer.json and model.safetensors.index.json into `out` (made if
  missing); returns `out`."""
  from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
  specials = ["<|begin_of_text|>", "<|end_of_text|>",
              *(f"<|reserved_special_token_{i}|>" for i in range(CONFIG["vocab_size"] - ORDINARY - 2))]
  vocab = {f"placeholder{i}": i for i in range(ORDINARY)}
  vocab.update({t: ORDINARY + i for i, t in enumerate(specials)})
  tok = Tokenizer(models.WordLevel(vocab, unk_token="placeholder0"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
  # The real directory's shard index, naming no shards: the resolver finds a checkpoint, and
  # reading its weights (training, sampling) fails on the first one missing.
  index = {"metadata": {"note": "shapes only, no weights: benchmarks/llama3_8b_shapes.py"},
           "weight_map": {}}
  text = lambda value: lambda p: open(p, "w", encoding="utf-8").write(json.dumps(value, indent=1))
  os.makedirs(out, exist_ok=True)
  for name, save in (("tokenizer.json", tok.save), ("config.json", text(CONFIG)),
                     ("model.safetensors.index.json", text(index))):
    path = os.path.join(out, name)
    save(path + ".tmp")
    os.replace(path + ".tmp", path)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="work/llama3_8b_shapes")
  print(f"Llama-3-8B's shapes (no weights) in {write(parser.parse_args().out)}")


if __name__ == "__main__":
  main()
