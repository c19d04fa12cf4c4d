"""REALM pre-training (experiments/pretrain.py).

Variants (`--config=realm_jax/configs/pretrain.py:<variant>`):
  demo   the embedded corpus (first 2,000 articles as blocks of <= 64 word pieces), both models
         from all 6 layers of the installed all-MiniLM-L6-v2, K = 3, 300 steps on 2 CPU cores
         (7-13 minutes): held-out masked-token accuracy 9.42% with retrieval against 7.48% with
         the null document only, retrieval utility 0.071 at step 300 (docs/pretraining.md):
           python experiments/pretrain.py --flagfile=experiments/flags/pretrain_demo.flags
  small  the demo's models and shapes over all 10,033 embedded articles (25,033 blocks), 1,500 steps,
         the index refreshed every 500: the longer CPU run whose exports feed fine-tuning
         (finetune.py's config.init). On 2 AMD EPYC cores: 108 minutes (2.8-2.9 s a step alone,
         ~3 minutes per refresh of the 25,033 blocks; other runs shared the cores for its last
         55 minutes); held-out accuracy 15.41% against 12.65% with the null document at step 1500
         (docs/ablations.md). Alone, or as the ablations runner's `small` (then fine-tuned):
           python experiments/pretrain.py --config=realm_jax/configs/pretrain.py:small \
               --workdir=work/pretrain_small
  tiny   random 1-layer models over 40 articles, for tests (seconds).
  paper  REALM's settings: BERT-base towers and encoder (config.init='hf' with REALM/BERT weights),
         batch 512, K = 8, 200k steps, lr 3e-5, query 96 / block 288 / joint 384 word pieces,
         the full English Wikipedia as blocks (13.35M), index sharded over the devices of a pod
         and refreshed asynchronously by experiments/refresh_index.py.
  paper_v3_128, paper_v4_64, paper_v5e_256
         `paper` on one TPU pod slice (tpu/launch.sh): bfloat16 compute, several hosts
         (config.distributed), and `slice` naming its devices and their memory, for the memory
         estimate printed before the run (realm_jax/train/memory.py;
         python experiments/memory_estimate.py --config=realm_jax/configs/pretrain.py:paper_v4_64).
"""

# TPU pod slices: JAX devices (v3: two cores per chip, each a device; v4/v5e: one per chip),
# memory per device (GiB) and hosts. From Google's TPU system architecture pages.
SLICES = {
    "v3_128": dict(name="v3-128", devices=128, hbm_gib=16, hosts=16),
    "v4_64": dict(name="v4-64", devices=32, hbm_gib=32, hosts=8),
    "v5e_256": dict(name="v5litepod-256", devices=256, hbm_gib=16, hosts=64),
}
BERT_BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, max_position_embeddings=512, retriever_proj_size=128)
# The tests' random towers (tiny configs here and in dpr.py, ict.py); initializer_range is BERT's
# std, named so that a flag can set it (~0.5 keeps random sentences' retrieval scores apart).
TINY_BERT = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=128, retriever_proj_size=16,
                 initializer_range=0.02)

import ml_collections

from realm_jax.configs import build_index


def get_config(arg: str = "demo") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.variant = arg
  c.init = "minilm"               # minilm | hf | random (see realm_jax/train/init.py)
  c.retriever_weights = ""        # init=hf: HF REALM embedder/scorer directory (e.g. from ict.py)
  c.encoder_weights = ""          # init=hf: HF REALM encoder or BERT directory
  c.vocab_file = ""               # init=random (or a HF directory without vocab.txt)
  c.model = ml_collections.ConfigDict()   # init=random: RealmConfig fields
  c.num_layers = 0                # >0: keep only the first N transformer layers of the weights
  c.retriever_num_layers = 0      # >0: the retriever keeps only its first N of those layers
  c.pooling = "projected_cls"     # init=random only; minilm: mean, hf: projected_cls
  c.normalize = False
  c.share_embedders = True
  c.score_scale = 1.0             # multiplies relevance scores (20 for L2-normalised MiniLM)
  c.mlm_transform_init = "random"  # a new MLM head's dense layer: random | identity
  c.query_hides_mask = False      # the query tower ignores [MASK]: retrieves with x minus its span
  c.dtype = "float32"             # compute dtype: float32 | bfloat16
  c.remat = False                 # recompute each layer in the backward pass (less memory)
  c.chunk_tokens = 0              # >0: BERT calls in chunks of <= this many tokens (CPU: ~2048)
  # >0: each device runs this many of its examples at a time through the step (forward and
  # backward) and adds up their gradients: activations shrink by (batch per device / this); the
  # step's result changes only by the order of its sums. 0: the whole batch at once.
  c.microbatch = 0

  c.corpus = ml_collections.ConfigDict(dict(
      source="wiki_vital", paths=(), block_length=288, blocking="sentences", max_docs=0,
      tfds_name="wikipedia/20230601.en"))
  c.data_dir = ""                 # corpus and examples (default: <workdir>/data)
  c.tagger = "auto"               # salient spans: spacy | regex | auto
  c.heldout_percent = 2

  c.query_length = 96
  c.max_masked = 10
  c.doc_length = 288
  c.joint_length = 384
  c.num_candidates = 8            # K, the null document included
  # Ablations (REALM Table 3; experiments/ablations.py): what the training queries mask
  # (salient_spans | random_spans | random_tokens, as many word pieces as the salient span; the
  # held-out evaluation always masks salient spans) and whether the null document is a candidate.
  # A frozen retriever is retriever_learning_rate=0; a stale index is index.refresh='none'.
  c.masking = "salient_spans"
  c.null_document = True

  c.batch_size = 512              # global, over all devices and hosts
  c.num_steps = 200_000
  c.learning_rate = 3e-5
  c.retriever_learning_rate = -1.0  # >= 0: the retriever towers' own peak rate (-1: as above)
  c.warmup_steps = -1             # -1: min(10k, max(100, steps / 10))
  c.weight_decay = 0.01
  c.clip_norm = 1.0
  c.dropout = True
  c.seed = 0
  c.distributed = False           # jax.distributed.initialize() first (multi-host runs)

  c.index = ml_collections.ConfigDict(dict(
      searcher="exact", dtype="float32",
      scann=build_index.scann_settings(),  # for searcher="scann"; 0: DocIndex's default
      refresh="async",            # sync | async | none
      refresh_every=500,          # sync: steps between refreshes
      keep=3,                     # published indexes kept (0: all); never one a checkpoint names
      embed_batch_size=64))
  c.slice = ml_collections.ConfigDict(dict(name="", devices=0, hbm_gib=0.0, hosts=0))
  c.log_every = 50
  c.eval_every = 1000
  c.eval_batches = 20
  c.checkpoint_every = 1000
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

  if arg in ("demo", "small"):
    # All 6 MiniLM layers in both models: with 2, the encoder barely learns to copy a span from a
    # retrieved block in 300 steps and the retriever brings it less often (docs/notes.md).
    c.num_layers = 6
    c.mlm_transform_init = "identity"  # the new MLM head starts by pointing at the word it sees
    c.query_hides_mask = True   # retrieve with the sentence minus its masked span
    c.dropout = False
    c.chunk_tokens = 1024       # XLA:CPU: BERT calls in cache-sized pieces (~5% faster steps)
    c.corpus.max_docs = 2000
    c.corpus.block_length = 64
    c.score_scale = 20.0
    c.query_length = 32
    c.doc_length = 64
    c.joint_length = 96
    c.num_candidates = 3        # K = 4 shows a larger gain but takes ~9 minutes (docs/notes.md)
    c.batch_size = 8
    c.num_steps = 300
    c.learning_rate = 3e-4
    # Batches of 8 give the retriever a noisy gradient: at 1e-4 (encoder 1e-3) its 6 layers drifted
    # away from the index (held-out sentences whose span is retrieved: 14% -> 0.3% by step 200).
    c.retriever_learning_rate = 1e-5
    c.warmup_steps = 30
    c.index.refresh = "sync"
    c.index.refresh_every = 100
    c.log_every = 10
    c.heldout_percent = 10      # ~240 held-out sentences: enough masked tokens to compare
    c.eval_every = 100
    c.eval_batches = 40         # 320 of the ~342 held-out sentences (batches of 8)
    c.checkpoint_every = 100
    if arg == "small":
      c.corpus.max_docs = 0     # all 10,033 articles
      c.heldout_percent = 2     # ~5x the sentences: about as many held out as the demo's 10%
      c.num_steps = 1500
      c.warmup_steps = 100
      c.index.refresh_every = 500
      c.eval_every = 500
      c.checkpoint_every = 250
  elif arg == "tiny":
    c.init = "random"
    c.model = ml_collections.ConfigDict(TINY_BERT)
    c.corpus.max_docs = 40
    c.corpus.block_length = 48
    c.tagger = "regex"
    c.heldout_percent = 30
    c.query_length = 32
    c.max_masked = 6
    c.doc_length = 48
    c.joint_length = 64
    c.num_candidates = 4
    c.batch_size = 8
    c.num_steps = 6
    c.learning_rate = 1e-3
    c.warmup_steps = 2
    c.index.refresh = "sync"
    c.index.refresh_every = 3
    c.log_every = 1
    c.eval_every = 3
    c.eval_batches = 1
    c.checkpoint_every = 2
    c.index.embed_batch_size = 16
  elif arg == "paper" or arg.removeprefix("paper_") in SLICES:
    c.init = "hf"
    c.model = ml_collections.ConfigDict(BERT_BASE)  # the sizes of the weights init=hf loads
    c.share_embedders = False   # REALM's query and document towers (from ICT) are separate
    c.corpus.source = "tfds_wikipedia"
    c.index.searcher = "exact"
    c.index.dtype = "bfloat16"
    c.index.refresh = "async"
    if arg != "paper":
      c.slice = ml_collections.ConfigDict(SLICES[arg.removeprefix("paper_")])
      c.dtype = "bfloat16"
      c.distributed = True
      # With every activation kept, 4 / 16 / 2 examples per device need more than the 16 / 32 /
      # 16 GiB of a v3 core / v4 chip / v5e chip (python benchmarks/memory.py): recompute each
      # layer in the backward pass instead.
      c.remat = True
      # BERT's dropout with threefry masks had not compiled for a TPU slice after 28 minutes;
      # with XLA's RngBitGenerator it compiles in 5 (docs/tpu.md).
      c.rng_impl = "rbg"
  else:
    raise ValueError(f"Unknown pretrain config {arg!r}: use demo, small, tiny, paper or one of "
                     f"{[f'paper_{s}' for s in SLICES]}.")
  return c
