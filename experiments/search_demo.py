"""Dense retrieval over the embedded Wikipedia corpus with real MiniLM weights.

  python experiments/search_demo.py --flagfile=experiments/flags/search_demo.flags
  python experiments/search_demo.py --workdir=work/search_demo --question="who discovered penicillin"
"""

from absl import flags, logging

from realm_jax import cli
from realm_jax.retrieval import search_demo

_CONFIG = cli.define_config(
    "config", "realm_jax/configs/build_index.py:wiki_vital_minilm", "Index config.")
_WORKDIR = flags.DEFINE_string("workdir", "work/search_demo", "Corpus, embeddings and index go here.")
_QUESTIONS = flags.DEFINE_multi_string("question", ["who discovered penicillin"], "Questions to ask.")
_K = flags.DEFINE_integer("k", 5, "Articles to show per question.")


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  search_demo.run(_WORKDIR.value, _QUESTIONS.value, _K.value, _CONFIG.value)


if __name__ == "__main__":
  cli.run(main)
