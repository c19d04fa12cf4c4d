"""Open-QA fine-tuning (experiments/finetune.py), evaluation and ask (same config).

Variants (`--config=realm_jax/configs/finetune.py:<variant>`):
  wiki_vital  the embedded 10,033 Wikipedia articles indexed with all-MiniLM-L6-v2 (one block per
              article; the question tower starts from MiniLM, the document tower and the index
              stay frozen), the reader = MiniLM + a new span scorer, trained on NQ-Open dev +
              EfficientQA dev questions split by a hash of the question into train / dev (model
              selection) / held-out test parts:
                python experiments/finetune.py --flagfile=experiments/flags/finetune_wiki_vital.flags
                python experiments/evaluate.py --flagfile=experiments/flags/finetune_wiki_vital.flags
              held-out test EM 2.4 and recall@5 20.1 (MiniLM untuned: recall@5 13.3;
              docs/open_qa.md)
  mixture     wiki_vital's models and memory settings, trained on four datasets at once
              (realm_jax/data/mixture.py): NQ-Open (wiki_vital's split, its held-out test part
              unchanged, + NQ-Open train), TriviaQA (a hash-split 20% held out), WebQuestions and
              CuratedTREC (their test splits held out), drawn 53 / 27 / 13 / 7% (each dataset's
              share of the training questions); dev and test reported per dataset; training
              questions whose answer is nowhere in the corpus dropped (docs/open_qa.md):
                python experiments/finetune.py --flagfile=experiments/flags/finetune_mixture.flags
                python experiments/evaluate.py --flagfile=experiments/flags/finetune_mixture.flags
  tiny        40 articles, a 1-layer reader, a few steps: tests and the notebook (seconds).
  paper       ORQA/REALM: beam 5000, read 5, lr 1e-5, question tower and index from a REALM
              checkpoint (config.retrieval.weights: HF REALM scorer; projected [CLS], score scale
              1), reader from the pre-trained knowledge-augmented encoder (config.reader_weights).
"""

import ml_collections

from realm_jax.configs import build_index


def get_config(arg: str = "wiki_vital") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.variant = arg
  # The frozen index and where the question tower starts: a build_index config, built into the
  # fine-tuning work directory if it is not there yet.
  c.retrieval = build_index.get_config("wiki_vital_minilm")
  # A realm_jax pre-training work directory (experiments/pretrain.py): its exported retriever
  # becomes retrieval.weights (the question tower's start and the index's document tower) and its
  # knowledge-augmented encoder reader_weights. "": those two as given.
  c.init = ""
  c.score_scale = 20.0            # retriever logit = score_scale * <q, z> (cosines for MiniLM)
  c.reader_weights = "minilm"     # minilm | a HF directory: REALM reader, encoder or a BERT
  c.reader_layers = 0             # >0: keep only the first N transformer layers of the reader
  c.span_hidden_size = 256
  c.max_span_width = 10

  c.data = ml_collections.ConfigDict(dict(
      name="nq_open",             # nq_open | web_questions | curated_trec
      splits=("dev", "efficientqa_dev"),  # pooled, then split by a hash of the question
      local_dir="",               # a folder holding the files (offline); "" = download with TFDS
      data_dir="",                # TFDS data_dir for downloads ("" = TFDS's default)
      test_percent=20.0,          # held out for the final report (evaluate.py)
      dev_percent=10.0,           # of the rest: model selection during fine-tuning
      seed="realm_jax-qa",        # hash salt of the split
      limit=0))                   # >0: use only the first N questions (tests)

  c.beam = 1000                   # blocks retrieved for the retriever loss (5000 in the paper)
  c.reader_blocks = 5             # the beam's first R blocks are read
  c.question_length = 64
  c.reader_length = 288           # [CLS] q [SEP] title [SEP] body [SEP]
  c.reader_title = True           # False: [CLS] q [SEP] body [SEP] (ORQA/REALM's reader layout)
  c.max_answer_spans = 8          # gold spans kept per block
  c.skip_unanswerable = True      # drop questions with no answer in their beam (zero gradient)

  c.retriever_steps = 0           # first N steps train the question tower alone (no reading)
  c.batch_size = 16               # questions per step, sharded over every device
  # >0: each device reads this many of its questions at a time (forward and backward) and adds up
  # their gradients: the reader's activations, most of fine-tuning's memory, shrink by (batch per
  # device / this); the step's result changes only by the order of its sums. 0: all at once.
  c.reader_microbatch = 0
  c.num_steps = 300
  c.learning_rate = 5e-5
  c.warmup_steps = -1             # -1: min(10k, max(100, steps / 10))
  c.weight_decay = 0.01
  c.clip_norm = 1.0
  c.dropout = True
  c.seed = 0

  c.log_every = 10
  c.eval_every = 100              # dev EM every N steps; the best checkpoint is kept
  c.eval_limit = 0                # >0: only the first N dev questions in those evaluations
  c.eval_batch_size = 16
  c.checkpoint_every = 100
  c.keep_checkpoints = 1          # the newest (best/ keeps the best model apart)
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
  c.ks = (1, 5, 20)

  if arg == "wiki_vital":
    # Sized for 2 CPU cores (~40 min): 400 cheap retriever-only steps (~1 s each: the question
    # tower sees every answerable training question several times), then 80 joint steps reading
    # 5 blocks of <= 192 word pieces (~15-25 s each: the reader is where the time goes).
    c.retriever_steps = 400
    c.num_steps = 480
    c.reader_microbatch = 1         # 0.9 GiB of XLA buffers instead of 9.7, and faster on CPU
    c.warmup_steps = 20
    c.reader_length = 192
    c.eval_every = 40
    c.eval_limit = 200
    c.checkpoint_every = 40
  elif arg == "mixture":
    # Sized for 2 CPU cores (a few hours): 2,000 retriever-only steps (~3 epochs of the training
    # questions that have an answer in the corpus), then 400 joint steps; memory as wiki_vital.
    c.retriever_steps = 2000
    c.num_steps = 2400
    c.reader_microbatch = 1
    c.warmup_steps = 100
    c.reader_length = 192
    c.eval_every = 200
    c.eval_limit = 100              # dev questions of each dataset
    c.checkpoint_every = 100
    nq = c.data
    c.data = ml_collections.ConfigDict(dict(
        # One entry per dataset (realm_jax/data/mixture.py): weight = share of the draws.
        mixture=ml_collections.ConfigDict({
            "nq_open": _dataset(2.0, splits=nq.splits, test_percent=nq.test_percent,
                                train_splits=("train",)),
            "trivia_qa": _dataset(1.0, splits=("train",), test_percent=20.0),
            "web_questions": _dataset(0.5, splits=("train",), test_splits=("test",)),
            "curated_trec": _dataset(0.25, splits=("train",), test_splits=("test",))}),
        data_dir=nq.data_dir, dev_percent=nq.dev_percent, seed=nq.seed, limit=0,
        # Training questions whose answer is nowhere in the corpus train nothing: dropped
        # (counted in the log; experiments/absent_answers.py). Dev and test keep them.
        drop_absent=True))
  elif arg == "tiny":
    c.retrieval = build_index.get_config("tiny")
    c.retrieval.num_layers = 1      # MiniLM's first layer: compiles in half the time of all 6
    c.reader_layers = 1
    c.beam = 8
    c.reader_blocks = 2
    c.question_length = 32
    c.reader_length = 96
    c.data.limit = 200
    # 145 of the 155 training questions have no answer in the 40 blocks: without them a step
    # looks at ~20 questions for its 8 with an answer in the beam, not ~300 (2.7% of them).
    c.data.drop_absent = True
    c.batch_size = 8                # divisible by the tests' 8 fake devices
    c.num_steps = 4
    c.warmup_steps = 1
    c.learning_rate = 1e-4
    c.log_every = 2
    c.eval_every = 2
    c.eval_limit = 8
    c.eval_batch_size = 8
    c.checkpoint_every = 2
    c.ks = (1, 2, 5)
  elif arg == "paper":
    c.retrieval.weights = ""      # required: a HF REALM scorer / embedder directory
    c.retrieval.corpus.blocking = "sentences"
    c.retrieval.corpus.source = "tfds_wikipedia"
    c.retrieval.max_length = 288
    c.retrieval.truncate = "b"
    c.score_scale = 1.0
    c.reader_length = 320         # 288 + 32: the block and the question, no title
    c.reader_title = False
    c.reader_weights = ""         # required: the pre-trained encoder / reader directory
    c.data.splits = ("train",)
    c.data.test_percent = 0.0     # evaluate on the official dev (= ORQA's test) instead
    c.beam = 5000
    c.batch_size = 16
    c.num_steps = 20_000
    c.learning_rate = 1e-5
    c.eval_every = 1000
    c.checkpoint_every = 1000
  else:
    raise ValueError(f"Unknown finetune config {arg!r}: wiki_vital, mixture, tiny, paper.")
  return c


def _dataset(weight: float, *, splits=(), test_percent: float = 0.0, test_splits=(),
             train_splits=()) -> ml_collections.ConfigDict:
  """One dataset of a mixture (realm_jax/data/mixture.py); local_dir "" = download with TFDS."""
  return ml_collections.ConfigDict(dict(
      weight=weight, splits=tuple(splits), test_percent=test_percent,
      test_splits=tuple(test_splits), train_splits=tuple(train_splits), local_dir=""))
