"""DPR retriever training (experiments/dpr.py; Karpukhin et al. 2020): a question tower and a
passage tower trained with in-batch negatives (every passage of the global batch) plus one BM25
hard negative per question, on the open-QA training questions.

Variants (`--config=realm_jax/configs/dpr.py:<variant>`):
  wiki_vital  the embedded 10,033 Wikipedia articles (one block per article, laid out as the
              MiniLM index embeds them), both towers from all-MiniLM-L6-v2 (mean pooling,
              cosines x 20), the training part of fine-tuning's NQ-Open + EfficientQA split
              (the same hash: its dev and held-out test questions are never trained on):
                python experiments/dpr.py --flagfile=experiments/flags/dpr_wiki_vital.flags
              The export (<workdir>/export) feeds build_index.py (--config.weights), fine-tuning
              (--config.retrieval.weights) and evaluate.py (--retrievers=dpr=<export>).
  mixture     wiki_vital's towers and sizes on the training part of fine-tuning's mixture of four
              datasets (configs/finetune.py:mixture, the same splits), more steps:
                python experiments/dpr.py --flagfile=experiments/flags/dpr_mixture.flags
  tiny        200 articles, random 1-layer towers, a few steps: for tests (seconds).
  paper       DPR's settings: BERT-base towers ([CLS]: here REALM's projected [CLS]), batch 128,
              lr 1e-5, 40 epochs' worth of steps, passages of 256 word pieces.
"""

import ml_collections

from realm_jax.configs import build_index, finetune, pretrain


def get_config(arg: str = "wiki_vital") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.variant = arg
  c.init = "minilm"               # minilm | bert | random (realm_jax/train/two_towers.py)
  c.bert_weights = ""             # init=bert: HF BERT directory (config.json, model.safetensors)
  c.vocab_file = ""               # init=random (default: the MiniLM package's uncased vocab)
  c.model = ml_collections.ConfigDict()   # init=random: RealmConfig fields
  c.num_layers = 0                # >0: keep only the first N transformer layers of the weights
  c.pooling = "auto"              # auto (mean for minilm, else projected_cls) | mean | projected_cls
  c.score_scale = 20.0            # logit = score_scale * <q, p> (mean pooling gives cosines)
  c.dtype = "float32"             # compute dtype: float32 | bfloat16
  c.chunk_tokens = 0              # >0: BERT calls in chunks of <= this many tokens

  # The corpus and how a passage is laid out: fine-tuning's retrieval section, so that the
  # passage tower trains on the inputs its index is built from.
  c.retrieval = build_index.get_config("wiki_vital_minilm")
  c.data_dir = ""                 # the directory whose corpus/ holds the corpus (default: the
                                  # workdir; a fine-tuning workdir's built corpus serves as well)
  # The questions: fine-tuning's data section (the same hash split; DPR trains on "train").
  c.data = finetune.get_config("wiki_vital").data
  c.bm25_depth = 100              # BM25 blocks searched for a positive and a hard negative
  c.question_length = 64          # [CLS] question [SEP]
  c.passage_length = 0            # word pieces of a passage (0: config.retrieval.max_length)

  c.batch_size = 32               # global: every question against the 2B passages of the batch
  c.num_steps = 200
  c.learning_rate = 2e-5
  c.warmup_steps = -1             # -1: min(10k, max(100, steps / 10))
  c.weight_decay = 0.01
  c.clip_norm = 1.0
  c.dropout = True
  c.seed = 0
  c.distributed = False           # jax.distributed.initialize() first (multi-host runs)

  c.log_every = 10
  c.eval_every = 50               # in-batch metrics on the dev questions' pairs; 0: never
  c.eval_batches = 4
  c.checkpoint_every = 50
  c.keep_checkpoints = 2
  c.max_bad_steps = 10
  # How the devices are used (realm_jax/sharding.py): "data=-1" = data parallelism (the state
  # copied on every device); e.g. "data=2,fsdp=2,tensor=2" splits the parameters and optimizer
  # state over fsdp and tensor by their logical axes, mapped by sharding_rules ("" = defaults:
  # embed=fsdp,vocab=tensor,heads=tensor,mlp=tensor).
  c.mesh = "data=-1"
  c.sharding_rules = ""
  c.rng_impl = "threefry2x32"     # the dropout masks' generator: threefry2x32 | rbg (TPU; loop.py)
  c.profile_start = 10            # profile_steps > 0: a trace of steps profile_start.. in tb/,
  c.profile_steps = 0             # and the time per XLA op in the log (train/profile.py)
  c.export_dir = ""               # default: <workdir>/export

  if arg in ("wiki_vital", "mixture"):
    # Sized for 2 CPU cores: a step embeds 2B passages and B questions forward and backward
    # through two 6-layer towers; passages are cut to 128 word pieces for training (the index
    # embeds 256), 16 questions a step, ~1.8 epochs of the ~870 mined examples.
    c.batch_size = 16
    c.passage_length = 128
    c.num_steps = 100
    c.warmup_steps = 15
    if arg == "mixture":
      c.data = finetune.get_config("mixture").data
      c.num_steps = 1000
      c.warmup_steps = 100
      c.eval_every = 200
      c.checkpoint_every = 100
  elif arg == "tiny":
    c.init = "random"
    c.model = ml_collections.ConfigDict(pretrain.TINY_BERT)
    c.pooling = "mean"
    c.retrieval = build_index.get_config("tiny")
    # 40 articles give too few examples that do not hold each other's answers for a batch of 8.
    c.retrieval.corpus.max_docs = 200
    c.data = finetune.get_config("tiny").data
    c.data.limit = 0              # every question: few have an answer in 40 articles
    c.bm25_depth = 20
    c.question_length = 32
    c.batch_size = 8
    c.num_steps = 4
    c.learning_rate = 1e-3
    c.warmup_steps = 1
    c.log_every = 2
    c.eval_every = 2
    c.eval_batches = 1
    c.checkpoint_every = 2
  elif arg == "paper":
    c.init = "bert"
    c.pooling = "projected_cls"
    c.score_scale = 1.0
    c.retrieval.corpus.source = "tfds_wikipedia"
    c.retrieval.corpus.blocking = "sentences"
    c.retrieval.max_length = 256
    c.retrieval.truncate = "b"
    c.data.splits = ("train",)
    c.data.test_percent = 0.0
    c.batch_size = 128
    c.num_steps = 30_000
    c.learning_rate = 1e-5
    c.warmup_steps = 1_000
    c.log_every = 100
    c.eval_every = 1000
    c.checkpoint_every = 1000
    c.distributed = True
  else:
    raise ValueError(f"Unknown dpr config {arg!r}: use wiki_vital, mixture, tiny or paper.")
  return c
