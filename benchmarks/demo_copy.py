"""How fast the pre-training demo's encoder learns to use evidence that is always there.

  python experiments/pretrain.py --flagfile=experiments/flags/pretrain_demo.flags   # first
  python benchmarks/demo_copy.py                                   # ~5 min on 2 cores
  python benchmarks/demo_copy.py --mlm_transform_init=random       # the head without the identity
  python benchmarks/demo_copy.py --set num_layers=2 --set mlm_transform_init=random \
      --set learning_rate=1e-4 --set retriever_learning_rate=-1 --set query_hides_mask=False
                                       # the earlier 2-layer demo's settings (benchmarks/README.md)

The demo's config and data, but every example's only retrieved candidate is the block its
sentence came from (K = 2: the null document and that block), so the masked span is always in
the evidence: the most retrieval could give this encoder. Trains `--steps` steps with the
library's train step and prints, every `--eval_every` steps, held-out masked-token accuracy with
the own block against the null document alone, and the retrieval utility. The demo's real run
retrieves the span for ~14% of the held-out sentences (README), so its gain over the null
document is at most about a seventh of this one.
"""

import argparse
import glob
import json
import os
import shutil
import tempfile
import time

from realm_jax.configs.pretrain import get_config
from realm_jax.train.pretrain import Trainer


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", default="work/pretrain_demo", help="a demo run's work directory")
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--eval_every", type=int, default=100)
  p.add_argument("--learning_rate", type=float, default=None, help="default: the demo's")
  p.add_argument("--mlm_transform_init", default=None, help="default: the demo's")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="any other top-level setting of the demo config (repeatable), e.g. "
                      "num_layers=2 or query_hides_mask=False")
  args = p.parse_args()
  data = os.path.join(args.workdir, "data")
  if not glob.glob(os.path.join(data, "examples-*", "train.array_record")):
    raise FileNotFoundError(
        f"No examples under {data}: run the demo first (experiments/pretrain.py "
        "--flagfile=experiments/flags/pretrain_demo.flags) or pass its --workdir.")
  config = get_config("demo")
  for item in args.set:
    key, _, value = item.partition("=")
    if key not in config or isinstance(config[key], (dict, type(config))) or not value:
      p.error(f"--set {item!r}: give KEY=VALUE for a top-level setting of the demo config "
              "(realm_jax/configs/pretrain.py), e.g. num_layers=2.")
    kind = type(config[key])
    try:
      config[key] = ({"True": True, "False": False}[value] if kind is bool else kind(value))
    except (KeyError, ValueError):
      p.error(f"--set {item!r}: {key} takes a {kind.__name__} (bools: True or False).")
  config.num_candidates, config.num_steps = 2, args.steps
  if args.learning_rate is not None:
    config.learning_rate = args.learning_rate
  if args.mlm_transform_init is not None:
    config.mlm_transform_init = args.mlm_transform_init
  with tempfile.TemporaryDirectory() as scratch:
    shutil.copytree(data, os.path.join(scratch, "data"))  # the demo's workdir stays untouched
    t = Trainer(config, scratch)

    def own_block(queries):
      return t.put(t.builder.build(queries, t.corpus.rows_of(queries["block_id"])[:, None]))

    t.step_batch = own_block  # the trainer's own evaluation, with the own block as the retrieval

    def evaluate():
      m = t.evaluate()
      return {k: round(m[k], 4) for k in ("loss", "accuracy", "null_accuracy",
                                          "retrieval_utility")}

    print(f"lr {config.learning_rate}, MLM transform {config.mlm_transform_init}, "
          f"{args.steps} steps of {config.batch_size}")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
      t.state, _ = t.step_fn(t.state, t.step_batch(next(t.data_iterator)), t.rng)
      if step % args.eval_every == 0 or step == args.steps:
        print(f"step {step} ({time.perf_counter() - start:.0f} s) held-out:",
              json.dumps(evaluate()), flush=True)
    t.manager.close()


if __name__ == "__main__":
  main()
