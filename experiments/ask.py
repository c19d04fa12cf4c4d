"""Ask the best fine-tuned open-QA model of a work directory questions; see its evidence.

  python experiments/ask.py --workdir=work/qa_wiki_vital --question="who discovered penicillin"
  python experiments/ask.py --workdir=work/qa_wiki_vital --interactive      # question> ...
  python experiments/ask.py --workdir=work/qa_wiki_vital --question="..." --json --top_k=3

The work directory is one that experiments/finetune.py made (config.json, index/, best/). A
question, a flag or a work directory that cannot be used ends with `error: ...` and status 2.
"""

from absl import flags, logging

from realm_jax import cli
from realm_jax.eval import ask

_WORKDIR = flags.DEFINE_string("workdir", None, "Fine-tuning work directory (experiments/finetune.py).")
_QUESTION = flags.DEFINE_string("question", None, "The question to answer.")
_INTERACTIVE = flags.DEFINE_bool("interactive", False, "Read questions from stdin, one a line, until EOF, quit or exit.")
_TOP_K = flags.DEFINE_integer("top_k", None, "Evidence blocks to show (default: every block read).")
_JSON = flags.DEFINE_bool("json", False, "Print each prediction as a JSON line instead of text.")


def main(argv):
  del argv
  logging.set_verbosity(logging.ERROR)
  ask.run(_WORKDIR.value, _QUESTION.value, _INTERACTIVE.value, _TOP_K.value, _JSON.value)


if __name__ == "__main__":
  cli.run(main, stray_hint='quote the question, --question="who wrote the origin of species"')
