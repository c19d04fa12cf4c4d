"""Real weights: all-MiniLM-L6-v2 from the installed package in the Flax BERT vs PyTorch."""

import os

import jax
import numpy as np
import pytest

from realm_jax.checkpoints import load_minilm, minilm_dir
from realm_jax.models import RealmEmbedder
from realm_jax.text import BertTokenizer, batch_join

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "A man is riding a horse.",
    "A man is riding a white horse on an enclosed ground.",
    "The new movie is awesome.",
    "The new film is so great.",
    "Paris is the capital and most populous city of France.",
    "Which city is the capital of France?",
]


@pytest.fixture(scope="module")
def minilm():
  try:
    minilm_dir()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  config, params, vocab = load_minilm()
  return config, params, BertTokenizer(vocab)


def _embed(minilm, texts, max_length=32):
  config, params, tok = minilm
  batch = batch_join([(ids, None) for ids in tok.encode_batch(texts)], max_length, tok)
  model = RealmEmbedder(config, pooling="mean", normalize=True)
  fn = jax.jit(lambda p, b: model.apply({"params": {"realm": p}}, b["input_ids"],
                                        b["attention_mask"], b["token_type_ids"]))
  return np.asarray(fn(params, batch)), batch


def test_minilm_loads_as_a_6_layer_384_bert(minilm):
  config, params, tok = minilm
  assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (6, 384, 12)
  assert config.hidden_act == "gelu" and tok.vocab_size == config.vocab_size == 30522
  assert params["embeddings"]["word_embeddings"]["embedding"].shape == (30522, 384)


def test_mean_pooled_embeddings_match_pytorch(minilm):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  ours, batch = _embed(minilm, SENTENCES)
  hf = transformers.BertModel.from_pretrained(minilm_dir(), local_files_only=True).eval()
  # Same token ids from HF's own tokenizer: our tokenizer is checked here too.
  hf_tok = transformers.BertTokenizerFast(os.path.join(minilm_dir(), "vocab.txt"))
  enc = hf_tok(SENTENCES, padding="max_length", max_length=32, return_tensors="pt")
  np.testing.assert_array_equal(enc["input_ids"].numpy(), batch["input_ids"])
  with torch.no_grad():
    hidden = hf(**enc).last_hidden_state
  m = enc["attention_mask"][..., None].float()
  want = (hidden * m).sum(1) / m.sum(1)
  want = torch.nn.functional.normalize(want, dim=-1).numpy()
  err = np.abs(ours - want).max()
  print(f"MiniLM mean-pooled max abs error vs PyTorch: {err:.2e}")
  assert err <= 1e-5


def test_semantic_ordering(minilm):
  emb, _ = _embed(minilm, SENTENCES)
  sim = emb @ emb.T
  assert sim[0, 1] > sim[0, 2] and sim[0, 1] > sim[0, 4]      # eating ~ eating
  assert sim[2, 3] > sim[2, 0] and sim[2, 3] > sim[2, 5]      # horse ~ horse
  assert sim[4, 5] > sim[4, 0] and sim[4, 5] > sim[4, 6]      # movie ~ film
  assert sim[7, 6] == max(sim[7, j] for j in range(7))        # question -> its answer
