"""Dense retrieval over the embedded Wikipedia corpus with real MiniLM weights.

  python experiments/search_demo.py --flagfile=experiments/flags/search_demo.flags
  python experiments/search_demo.py --workdir=/tmp/realm_demo --question="who discovered penicillin"
"""

from absl import app, flags, logging

from realm_jax.retrieval import search_demo

_WORKDIR = flags.DEFINE_string("workdir", "work/search_demo", "Where the corpus embeddings are cached.")
_QUESTIONS = flags.DEFINE_multi_string("question", ["who discovered penicillin"], "Questions to ask.")
_K = flags.DEFINE_integer("k", 5, "Articles to show per question.")
_MAX_LENGTH = flags.DEFINE_integer("max_length", 256, "Word pieces per article ([CLS] title [SEP] text [SEP]).")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Articles per embedding step.")
_MAX_DOCS = flags.DEFINE_integer("max_docs", None, "Only the first N articles (quick trials).")


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  search_demo.run(_WORKDIR.value, _QUESTIONS.value, _K.value, _MAX_LENGTH.value, _BATCH.value,
                  _MAX_DOCS.value)


if __name__ == "__main__":
  app.run(main)
