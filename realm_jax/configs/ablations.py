"""REALM's ablations at small scale (experiments/ablations.py; REALM Table 3).

Variants (`--config=realm_jax/configs/ablations.py:<variant>`):
  demo  every pre-training variant of `ABLATIONS` on the pre-training demo (300 steps each, same
        data, same seed: ~7-13 minutes each on 2 CPU cores), then open-QA fine-tuning
        (finetune.py:wiki_vital, ~35 minutes each) from MiniLM and from the default variant's
        export, evaluated on the held-out test questions:
          python experiments/ablations.py --flagfile=experiments/flags/ablations_demo.flags
        docs/ablations.md has the table it wrote.
  small the default pre-training only, as `configs/pretrain.py:small` (all 10,033 articles, 1,500
        steps), then fine-tuning from its export and from MiniLM: does a 5x longer pre-training
        over the corpus fine-tuning reads help open QA?
          python experiments/ablations.py --flagfile=experiments/flags/ablations_small.flags
  tiny  two variants of the tiny pre-training, the tiny fine-tuning from the default one, for
        tests (~3 minutes on 2 cores).
"""

import ml_collections

from realm_jax.configs import finetune, pretrain

# name -> overrides of the pre-training config (dotted keys). "default" is the config as it is;
# each other variant changes one ingredient of REALM.
# In the order they run: the paper's two largest effects first.
ABLATIONS = {
    "default": {},
    "random_tokens": {"masking": "random_tokens"},  # REALM: random token masking (as BERT)
    "stale_index": {"index.refresh": "none"},       # the index of the starting weights throughout
    "random_spans": {"masking": "random_spans"},    # REALM: random span masking
    "frozen_retriever": {"retriever_learning_rate": 0.0},
    "no_null_document": {"null_document": False},
}
MINILM = "minilm"  # in `finetune_variants`: fine-tuning from MiniLM, with no pre-training


def get_config(arg: str = "demo") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.variant = arg
  c.pretrain = pretrain.get_config(arg if arg in ("demo", "small") else "tiny")
  c.finetune = finetune.get_config("tiny" if arg == "tiny" else "wiki_vital")
  c.variants = tuple(ABLATIONS)        # pre-trained, in this order; "default" must be one
  c.finetune_variants = (MINILM, "default")  # fine-tuned and evaluated on the held-out questions
  c.bootstrap_samples = 10_000         # paired bootstrap resamples of each difference
  c.seed = 0                           # of the bootstrap
  if arg == "tiny":
    c.variants = ("default", "random_tokens")
    c.finetune_variants = ("default",)
    # The tiny pre-training's random retriever finds few answers: read the whole 40-block corpus.
    c.finetune.beam = 40
    c.bootstrap_samples = 200
  elif arg == "small":
    c.variants = ("default",)          # ~1.5-2 hours a variant on 2 CPU cores
  elif arg != "demo":
    raise ValueError(f"Unknown ablations config {arg!r}: demo, small or tiny.")
  return c
