"""The main job's pieces: the embedded corpus, bucketed embedding, and real retrieval with MiniLM."""

import jax
import numpy as np
import pytest
from conftest import random_inputs

from realm_jax.models import RealmEmbedder, tiny_config
from realm_jax.retrieval.embed import bucket_lengths, embed_in_buckets


def test_bucketed_embedding_equals_full_length_embedding():
  config = tiny_config()
  model = RealmEmbedder(config)
  ids, mask, types = random_inputs(np.random.default_rng(0), (37,), 40, config.vocab_size, min_len=2)
  params = model.init(jax.random.key(0), ids, mask, types)["params"]
  fn = jax.jit(lambda b: model.apply({"params": params}, b["input_ids"], b["attention_mask"],
                                     b["token_type_ids"]))
  want = np.asarray(fn(dict(input_ids=ids, attention_mask=mask, token_type_ids=types)))
  inputs = dict(input_ids=ids.astype(np.int32), attention_mask=mask.astype(np.int32),
                token_type_ids=types.astype(np.int32))
  got = embed_in_buckets(fn, inputs, batch_size=5, buckets=bucket_lengths(40, step=8))
  np.testing.assert_allclose(got, want, atol=2e-6)  # same rows, original order, any padding
  assert bucket_lengths(40, step=8) == [8, 16, 24, 32, 40]
  with pytest.raises(ValueError, match="corpus is empty"):
    embed_in_buckets(fn, {k: v[:0] for k, v in inputs.items()}, batch_size=4)


@pytest.fixture(scope="module")
def articles():
  from realm_jax.data.wiki_vital import load_articles
  try:
    return load_articles()
  except FileNotFoundError as e:
    pytest.skip(str(e))


def test_embedded_corpus_has_the_vital_articles(articles):
  assert len(articles) == 10033
  titles = {a["title"] for a in articles}
  assert {"Mona Lisa", "Penicillin", "Jupiter", "World War II"} <= titles
  assert all(a["text"] for a in articles)


def test_minilm_retrieval_finds_the_right_article(articles, tmp_path):
  from realm_jax.retrieval import search_demo
  from realm_jax.retrieval.towers import load_tower
  wanted = ["Mona Lisa", "Penicillin", "Jupiter", "World War II", "Albert Einstein", "Ludwig van Beethoven",
            "Great Wall of China", "Photosynthesis", "Tokyo", "Association football"]
  subset = [a for a in articles if a["title"] in wanted]
  assert len(subset) == len(wanted)
  encoder = load_tower("minilm")
  emb = search_demo.embed_articles(encoder, subset, str(tmp_path), max_length=128, batch_size=4)
  assert emb.shape == (len(subset), 384)
  np.testing.assert_allclose(np.linalg.norm(emb, axis=-1), 1.0, atol=1e-5)
  questions = {"who painted the mona lisa": "Mona Lisa",
               "which antibiotic did alexander fleming discover": "Penicillin",
               "what is the largest planet in the solar system": "Jupiter",
               "how do plants turn sunlight into energy": "Photosynthesis",
               "what is the capital of japan": "Tokyo"}
  _, idx = search_demo.search(encoder, list(questions), emb, k=1)
  assert [subset[i]["title"] for i in idx[:, 0]] == list(questions.values())
  # Cached: the second call reads the file instead of embedding again.
  again = search_demo.embed_articles(encoder, subset, str(tmp_path), max_length=128, batch_size=4)
  np.testing.assert_array_equal(again, emb)
  with pytest.raises(ValueError, match="Empty question"):
    search_demo.search(encoder, ["  "], emb)
