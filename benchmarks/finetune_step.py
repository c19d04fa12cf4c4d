"""Open-QA fine-tuning throughput: questions per second at batch 16 against batch 1 (the original
ORQA/REALM code trained one question at a time).

  python benchmarks/finetune_step.py --index_workdir=work/qa_wiki_vital
  python benchmarks/finetune_step.py --index_workdir=... --batch_sizes=1,4,16 --questions=64

Uses the `wiki_vital` fine-tuning config (embedded corpus, MiniLM question tower and reader, beam
1000, 5 read blocks) with the corpus and index of --index_workdir (a fine-tuning or build_index
work directory; linked into a temporary workdir, nothing is written there). Every reader input is
padded to config.reader_length (192), so both batch sizes run one compiled program on the same
shapes. For each batch size: warm-up steps (compilation), then --questions questions timed, split
into batch building (question embedding, beam search, has-answer masks, reader inputs: host) and
the jitted train step (forward, backward, AdamW: device). Prints a markdown table.
"""

import os
import tempfile
import time

from absl import app, flags, logging

from realm_jax import cli
from realm_jax.configs.finetune import get_config
from realm_jax.train.finetune import QaTrainer

_INDEX = flags.DEFINE_string("index_workdir", "work/qa_wiki_vital", "Workdir with corpus/ and index/.")
_SIZES = flags.DEFINE_list("batch_sizes", ["1", "16"], "Batch sizes to compare.")
_QUESTIONS = flags.DEFINE_integer("questions", 48, "Questions timed per batch size.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 2, "Untimed steps first.")
_LOCAL = flags.DEFINE_string("questions_dir", "../shared/data/nq_open", "NQ-Open files.")


def measure(batch_size: int, index_workdir: str) -> dict:
  import jax
  config = get_config("wiki_vital")
  config.batch_size = batch_size
  config.retriever_steps = 0
  config.num_steps = 10_000
  config.data.local_dir = _LOCAL.value
  config.eval_every = 0
  with tempfile.TemporaryDirectory() as workdir:
    for name in ("corpus", "embeddings", "index"):
      os.symlink(os.path.abspath(os.path.join(index_workdir, name)), os.path.join(workdir, name))
    trainer = QaTrainer(config, workdir)
    trainer.setup.batcher.length_multiple = config.reader_length  # one shape for every batch
    steps = max(1, _QUESTIONS.value // batch_size)
    build_s = step_s = 0.0
    for i in range(_WARMUP.value + steps):
      t0 = time.perf_counter()
      batch = trainer.next_batch()
      t1 = time.perf_counter()
      trainer.state, out = trainer.step_fn(trainer.state, batch, trainer.rng)
      jax.block_until_ready(out)
      t2 = time.perf_counter()
      if i >= _WARMUP.value:
        build_s += t1 - t0
        step_s += t2 - t1
    trainer.manager.close()
    trainer.best_manager.close()
  n = steps * batch_size
  return {"batch": batch_size, "questions": n, "build_s": build_s, "step_s": step_s,
          "q_per_s": n / (build_s + step_s), "step_q_per_s": n / step_s}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  cli.quiet_library_logs()
  rows = [measure(int(b), _INDEX.value) for b in _SIZES.value]
  print("| batch | questions timed | batch building s | train step s | questions/s (all) | "
        "questions/s (step only) |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['batch']} | {r['questions']} | {r['build_s']:.1f} | {r['step_s']:.1f} | "
          f"{r['q_per_s']:.2f} | {r['step_q_per_s']:.2f} |")
  base = rows[0]
  for r in rows[1:]:
    print(f"batch {r['batch']} vs {base['batch']}: {r['q_per_s'] / base['q_per_s']:.2f}x questions/s")


if __name__ == "__main__":
  app.run(main)
