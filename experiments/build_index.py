"""Corpus + retriever weights -> document index in a work directory (and recall@k if asked).

  python experiments/build_index.py --flagfile=experiments/flags/build_index_wiki_vital.flags
  python experiments/build_index.py --config=realm_jax/configs/build_index.py:wiki_vital_blocks \
      --config.corpus.source=jsonl --config.corpus.paths='("my_docs/",)' --workdir=work/mine
"""

from absl import flags, logging

from realm_jax import cli
from realm_jax.retrieval import build

_CONFIG = cli.define_config("config", None, "Config file (realm_jax/configs/build_index.py:<variant>).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Work directory: corpus, embeddings and index go here.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  build.build_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  cli.run(main)
