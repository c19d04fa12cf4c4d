"""ICT warm start of the retriever (experiments/ict.py): Inverse Cloze Task, as in ORQA.

Variants (`--config=realm_jax/configs/ict.py:<variant>`):
  demo   the embedded corpus (first 1,000 articles as blocks of <= 96 word pieces), both towers
         from the first 2 layers of the installed all-MiniLM-L6-v2 with a random projection,
         batch 32, 100 steps, on 2 CPU cores in about 2.5 minutes; held-out in-batch accuracy
         goes from chance (1/32) to about 15% (MiniLM's [CLS] vectors start nearly alike, so the
         first ~30 steps sit at loss ln 32 before the towers pull apart):
           python experiments/ict.py --flagfile=experiments/flags/ict_demo.flags
  tiny   random 1-layer towers over 40 articles, for tests (seconds).
  paper  ORQA's settings: BERT-base towers (config.bert_weights: a HF BERT directory), batch 4096
         (in-batch negatives over the whole global batch), lr 1e-4, 100k steps, query 64 / block
         288 word pieces, the full English Wikipedia as blocks:
           python experiments/ict.py --config=realm_jax/configs/ict.py:paper --workdir=gs://... \
               --config.bert_weights=/path/to/bert-base-uncased --config.distributed=True

The export (`<workdir>/export`, a HF REALM scorer) is what pre-training starts from; keep its two
towers with share_embedders=False (with True, pre-training keeps only the document tower):
  --config=realm_jax/configs/pretrain.py:paper --config.retriever_weights=<workdir>/export \
      --config.share_embedders=False
"""

import ml_collections

from realm_jax.configs import pretrain


def get_config(arg: str = "demo") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.variant = arg
  c.init = "minilm"               # minilm | bert | random (see realm_jax/train/ict.py)
  c.bert_weights = ""             # init=bert: HF BERT directory (config.json, model.safetensors)
  c.vocab_file = ""               # init=random (default: the MiniLM package's uncased vocab)
  c.model = ml_collections.ConfigDict()   # init=random: RealmConfig fields
  c.num_layers = 0                # >0: keep only the first N transformer layers of the weights
  c.pooling = "projected_cls"     # projected_cls (REALM's) | mean (normalised) | auto (mean for
                                  # minilm): the export is read with the same pooling
  c.score_scale = 1.0             # logit = score_scale * <q, d> (mean pooling gives cosines: ~20)
  c.dtype = "float32"             # compute dtype: float32 | bfloat16
  c.chunk_tokens = 0              # >0: BERT calls in chunks of <= this many tokens (CPU: ~2048)

  c.corpus = ml_collections.ConfigDict(dict(
      source="wiki_vital", paths=(), block_length=288, blocking="sentences", max_docs=0,
      tfds_name="wikipedia/20230601.en"))
  c.data_dir = ""                 # the corpus (default: <workdir>/data)
  c.heldout_percent = 1           # blocks kept out of training, for the in-batch evaluation

  c.query_length = 64             # [CLS] sentence [SEP]
  c.doc_length = 288              # [CLS] title [SEP] body [SEP]
  c.remove_prob = 0.9             # the query sentence is cut out of its block this often

  c.batch_size = 4096             # global: every query is scored against every block of it
  c.num_steps = 100_000
  c.learning_rate = 1e-4
  c.warmup_steps = -1             # -1: min(10k, max(100, steps / 10))
  c.weight_decay = 0.01
  c.clip_norm = 1.0
  c.dropout = True
  c.seed = 0
  c.distributed = False           # jax.distributed.initialize() first (multi-host runs)

  c.log_every = 100
  c.eval_every = 5000             # 0: no held-out evaluation
  c.eval_batches = 4
  c.checkpoint_every = 5000
  c.keep_checkpoints = 3
  c.max_bad_steps = 10            # consecutive non-finite losses before the run stops
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

  if arg == "demo":
    c.num_layers = 2
    c.corpus.max_docs = 1000
    c.corpus.block_length = 96      # ~3 sentences: what is left of a block still says something
    c.heldout_percent = 10
    c.query_length = 32
    c.doc_length = 96
    c.batch_size = 32
    c.num_steps = 100
    c.learning_rate = 1e-4
    c.warmup_steps = 10
    c.dropout = False
    c.log_every = 10
    c.eval_every = 50
    c.eval_batches = 4
    c.checkpoint_every = 50
  elif arg == "tiny":
    c.init = "random"
    c.model = ml_collections.ConfigDict(pretrain.TINY_BERT)
    c.corpus.max_docs = 40
    c.corpus.block_length = 48
    c.heldout_percent = 30
    c.query_length = 16
    c.doc_length = 48
    c.batch_size = 8
    c.num_steps = 4
    c.learning_rate = 1e-3
    c.warmup_steps = 1
    c.log_every = 1
    c.eval_every = 2
    c.eval_batches = 1
    c.checkpoint_every = 2
  elif arg == "paper":
    c.init = "bert"
    c.corpus.source = "tfds_wikipedia"
  else:
    raise ValueError(f"Unknown ict config {arg!r}: use demo, tiny or paper.")
  return c
