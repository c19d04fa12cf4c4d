"""Corpus -> embeddings -> document index (experiments/build_index.py).

Variants (`--config=realm_jax/configs/build_index.py:<variant>`):
  wiki_vital_minilm  the embedded 10,033 Wikipedia articles, one block per article (title, text)
                     truncated to 256 word pieces, all-MiniLM-L6-v2 mean pooling: the dense
                     baseline of NQ-Open recall@1/5/20 = 6.9 / 14.0 / 20.2 (about 5 min on 2 cores).
      python experiments/build_index.py --flagfile=experiments/flags/build_index_wiki_vital.flags
  wiki_vital_blocks  the same articles as REALM blocks of <= 288 word pieces.
  tiny               the first 40 articles, for tests.
"""

import ml_collections


def scann_settings() -> dict:
  """ScaNN's settings for searcher="scann"; 0 keeps ScannSearcher's default (see its docstring).
  On the 10k x 384 MiniLM index, dims_per_block=8 with reorder_num_neighbors=200 was the fastest
  at recall@10 0.95 (benchmarks/README.md)."""
  return dict(num_leaves=0, num_leaves_to_search=0, reorder_num_neighbors=0, dims_per_block=0,
              training_sample_size=0)


def get_config(arg: str = "wiki_vital_minilm") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.weights = "minilm"          # or a HF REALM embedder/scorer or BERT checkpoint directory
  c.pooling = "auto"            # auto | mean | projected_cls
  c.normalize = "auto"          # auto | yes | no
  c.dtype = "float32"           # compute dtype of the tower: float32 | bfloat16
  c.num_layers = 0              # >0: the towers keep only the first N transformer layers
  c.corpus = ml_collections.ConfigDict(dict(
      source="wiki_vital",      # wiki_vital | jsonl | tfds_wikipedia
      paths=(),                 # JSONL files or folders for source=jsonl
      block_length=288,
      blocking="sentences",     # sentences (REALM blocks) | article (one block per document)
      max_docs=0,               # 0 = all
      tfds_name="wikipedia/20230601.en"))
  c.max_length = 288            # word pieces of [CLS] title [SEP] body [SEP] when embedding
  c.truncate = "b"              # b (cut the body) | longest (HF longest_first)
  c.batch_size = 64
  c.shard_size = 4096
  c.index = ml_collections.ConfigDict(dict(
      searcher="exact",         # exact | approx | scann (realm_jax/retrieval/searcher.py)
      dtype="float32",
      scann=scann_settings()))
  c.eval = ml_collections.ConfigDict(dict(
      questions="",             # NQ-Open style JSONL; empty = no evaluation
      ks=(1, 5, 20),
      limit=0))

  if arg == "wiki_vital_minilm":
    c.corpus.blocking = "article"
    c.max_length = 256
    c.truncate = "longest"
  elif arg == "wiki_vital_blocks":
    pass
  elif arg == "tiny":
    c.corpus.max_docs = 40
    c.max_length = 64
    c.batch_size = 8
    c.shard_size = 16
  else:
    raise ValueError(f"Unknown build_index config {arg!r}: wiki_vital_minilm, wiki_vital_blocks, tiny.")
  return c
