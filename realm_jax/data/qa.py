"""Open-domain QA questions: NQ-Open, TriviaQA, WebQuestions and CuratedTREC, as TFDS datasets or
plain lists.

    qs = load_questions("nq_open", "dev", local_dir="../shared/data/nq_open")
    qs[0]  # {"question": "when was the last time anyone was on the moon",
           #  "answers": ["14 December 1972 UTC", "December 1972"], "answer_type": "text"}
    train, held_out = split_by_hash(qs, dev_percent=10, seed_string="nq-dev")

Each dataset is a TFDS builder (`NqOpen`, `TriviaQa`, `WebQuestions`, `CuratedTrec`; array_record
files, no TensorFlow needed) with the features `question` (text) and `answers` (sequence of text),
rows in the order of the source file. The answer type belongs to the dataset
(`Builder.ANSWER_TYPE`, also in every dict of `load_questions`), not to a row:
  * "text": answers are compared after `text.answers.normalize_answer` (`exact_match`,
    `has_answer`);
  * "regex" (CuratedTREC): answers are regular expressions, matched case-insensitively anywhere in
    a text (`text.answers.regex_match`), as DrQA and ORQA do. They must compile (checked on load).

Where the data comes from (the builders download these files; `local_dir` reads them offline):

* nq_open: train = NQ-open.train.jsonl (87,925), dev = NQ-open.dev.jsonl (3,610; the test set of
  ORQA and REALM), efficientqa_dev = NQ-open.efficientqa.dev.1.1.jsonl (1,800), each from
  https://raw.githubusercontent.com/google-research-datasets/natural-questions/master/nq_open/<file>
  A local folder may hold NQ-open.train-sample.jsonl instead of the train file: a sample of it.
* trivia_qa: train = unfiltered-web-train.json (87,622), dev = unfiltered-web-dev.json (11,313; the
  test set of ORQA, REALM and DPR) of the unfiltered (open-domain) release,
  http://nlp.cs.washington.edu/triviaqa/data/triviaqa-unfiltered.tar.gz (632 MB). The answers are
  the answer's value and its aliases. A local folder may hold trivia_qa.unfiltered.dev.jsonl
  instead of the train file: a sample of it (ORQA and DPR's dev questions, carved out of train).
* web_questions: train (3,778), test (2,032) = webquestions.examples.<split>.json, the official
  Stanford release that DrQA's download.sh converts and ORQA resplits,
  http://nlp.stanford.edu/static/software/sempre/release-emnlp2013/lib/data/webquestions/dataset_11/webquestions.examples.<split>.json.bz2
  A local folder may hold DrQA's converted WebQuestions-<split>.txt or a <split>.jsonl instead.
* curated_trec: train (1,486), test (694) = CuratedTrec-<split>.txt from DrQA's rehosting of
  brmson/dataset-factoid-curated, https://dl.fbaipublicfiles.com/drqa/CuratedTrec.tar.gz, the
  files ORQA resplits. A local folder may hold brmson's curated-<split>.tsv or a <split>.jsonl
  instead (../shared/data's are brmson's large2470-train and curated-test: 1,704 and 430
  questions, not DrQA's split).

A file that is not the whole official split is said so in the log when it is read (`QaFile.note`).

File formats: NQ-Open, DrQA's *.txt and the *.jsonl are JSON lines `{"question": str, "answer":
[str, ...]}` (for CuratedTREC the answers are patterns). The official WebQuestions file is one JSON
array of `{"url", "targetValue": "(list (description \\"Jazmyn Bieber\\") (description Jaxon))",
"utterance"}`; the answers are the descriptions. The official TriviaQA file is one JSON object
`{"Data": [{"Question": str, "Answer": {"Value": str, "Aliases": [str, ...], ...}, ...}, ...]}`,
read one question at a time (the train file is large). brmson's TSV has 4 columns: id, type,
question, answer pattern (one pattern, alternatives joined by `|`).

None of these has a separate dev split: ORQA holds out 10% of each train set by a hash of the
question; `split_by_hash` does the same kind of split, deterministically.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence

import tensorflow_datasets as tfds
import tensorflow_datasets.core  # noqa: F401  (tfds.core is not imported by the package itself)

from realm_jax.data.prepare import LocalDatasetInfo, prepare
from realm_jax.data.qa_batches import MAX_QUESTION_CHARS
from realm_jax.io_utils import iter_jsonl
from realm_jax.text.answers import normalize_answer

_NQ_URL = ("https://raw.githubusercontent.com/google-research-datasets/natural-questions/master/"
           "nq_open/")
_WQ_URL = ("http://nlp.stanford.edu/static/software/sempre/release-emnlp2013/lib/data/webquestions/"
           "dataset_11/")
_DRQA_TREC_URL = "https://dl.fbaipublicfiles.com/drqa/CuratedTrec.tar.gz"
_TRIVIA_URL = "http://nlp.cs.washington.edu/triviaqa/data/triviaqa-unfiltered.tar.gz"


# Readers: each yields (where, question, answers); `where` ("file:line") goes into error messages.

def _read_nq_jsonl(path: str) -> Iterator[tuple[str, str, list[str]]]:
  """NQ-Open / DrQA format: one `{"question": str, "answer": [str, ...]}` per line."""
  for lineno, ex in iter_jsonl(path, "question file"):
    ok = (isinstance(ex, dict) and isinstance(ex.get("question"), str)
          and isinstance(ex.get("answer"), list)
          and all(isinstance(a, (str, int, float)) for a in ex["answer"])
          and any(str(a).strip() for a in ex["answer"]))
    if not ok:
      raise ValueError(f'{path}:{lineno}: expected {{"question": str, "answer": [str, ...]}} '
                       "(NQ-Open format, at least one answer that is not blank); fix or remove "
                       "this line.")
    yield f"{path}:{lineno}", ex["question"], [str(a) for a in ex["answer"]]


_DESCRIPTION = re.compile(r'\(description (?:"((?:[^"\\]|\\.)*)"|([^)]*))\)')


def _read_webquestions_json(path: str) -> Iterator[tuple[str, str, list[str]]]:
  """The official WebQuestions file: a JSON array of {"url", "targetValue", "utterance"}."""
  try:
    with open(path, encoding="utf-8-sig") as f:  # a byte-order mark is fine
      data = json.load(f)
  except FileNotFoundError:
    raise FileNotFoundError(f"Question file {path} does not exist.") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path}: not a valid UTF-8 JSON file ({e}); download it again.") from None
  if not isinstance(data, list):
    raise ValueError(f"{path}: expected a JSON array of WebQuestions examples.")
  for i, ex in enumerate(data):
    where = f"{path}: example #{i}"
    if not (isinstance(ex, dict) and isinstance(ex.get("utterance"), str)
            and isinstance(ex.get("targetValue"), str)):
      raise ValueError(f'{where}: expected {{"utterance": str, "targetValue": "(list (description '
                       '...) ...)"}}; fix or remove this example.')
    answers = [quoted.replace('\\"', '"') if quoted else bare.strip()
               for quoted, bare in _DESCRIPTION.findall(ex["targetValue"])]
    answers = [a for a in answers if a]
    if not answers:
      raise ValueError(f"{where}: targetValue {ex['targetValue']!r} holds no (description ...) "
                       "answer; fix or remove this example.")
    yield where, ex["utterance"], answers


def _iter_json_array(path: str, key: str, chunk_chars: int = 1 << 20) -> Iterator[object]:
  """The items of the array `key` of a JSON object file, decoded one at a time: a file of GBs is
  never held whole. ValueError naming the file when it is not such a file (the array must open
  in its first MiB, and no item may be over 64 Mi characters)."""
  decoder, opening = json.JSONDecoder(), re.compile(r'"%s"\s*:\s*\[' % re.escape(key))
  try:
    f = open(path, encoding="utf-8-sig")
  except FileNotFoundError:
    raise FileNotFoundError(f"Question file {path} does not exist.") from None
  with f:
    buf, pos, eof, items = "", 0, False, 0

    def more():
      nonlocal buf, pos, eof
      chunk = f.read(chunk_chars)
      eof = not chunk
      buf, pos = buf[pos:] + chunk, 0

    try:
      while (found := opening.search(buf)) is None and not eof and len(buf) < 1 << 20:
        more()
      if found is None:
        raise ValueError(f'{path}: expected a JSON object with a "{key}": [...] array; is this '
                         "the dataset's official file?")
      pos = found.end()
      while True:
        while True:  # what separates the items
          while pos < len(buf) and (buf[pos].isspace() or buf[pos] == ","):
            pos += 1
          if pos < len(buf) or eof:
            break
          more()
        if pos >= len(buf):
          raise ValueError(f'{path}: the "{key}" array is not closed: the file is cut short; '
                           "download it again.")
        if buf[pos] == "]":
          return
        try:
          item, pos = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as e:
          if eof or len(buf) - pos > 1 << 26:  # no item is that long: a broken file
            raise ValueError(f"{path}: not valid JSON after item #{items} of \"{key}\" ({e.msg});"
                             " download the file again.") from None
          more()
          continue
        items += 1
        yield item
    except UnicodeDecodeError as e:
      raise ValueError(f"{path}: not valid UTF-8 ({e}); download the file again.") from None


def _read_triviaqa_json(path: str) -> Iterator[tuple[str, str, list[str]]]:
  """The official TriviaQA file: {"Data": [{"Question", "Answer": {"Value", "Aliases"}}, ...]}.
  The answers are the value, then its aliases not already given."""
  for i, ex in enumerate(_iter_json_array(path, "Data")):
    where = f"{path}: question #{i}"
    answer = ex.get("Answer") if isinstance(ex, dict) else None
    ok = (isinstance(ex, dict) and isinstance(ex.get("Question"), str)
          and isinstance(answer, dict) and isinstance(answer.get("Value"), str)
          and isinstance(answer.get("Aliases", []), list))
    if not ok:
      raise ValueError(f'{where}: expected {{"Question": str, "Answer": {{"Value": str, "Aliases": '
                       "[str, ...]}}}} (a file with answers: not the test file without them).")
    answers = [a.strip() for a in [answer["Value"], *answer.get("Aliases", [])]
               if isinstance(a, str) and a.strip()]
    if not answers:
      raise ValueError(f"{where}: the answer is blank; fix or remove this question.")
    yield where, ex["Question"].strip(), list(dict.fromkeys(answers))


def _read_trec_tsv(path: str) -> Iterator[tuple[str, str, list[str]]]:
  """brmson/dataset-factoid-curated: `id <TAB> type <TAB> question <TAB> answer pattern` lines."""
  try:
    f = open(path, encoding="utf-8")
  except FileNotFoundError:
    raise FileNotFoundError(f"Question file {path} does not exist.") from None
  with f:
    try:
      for lineno, line in enumerate(f, 1):
        if not line.strip():
          continue
        cols = line.rstrip("\r\n").split("\t")
        if len(cols) != 4 or not cols[2].strip() or not cols[3]:
          raise ValueError(f"{path}:{lineno}: expected 4 tab-separated columns (id, type, "
                           f"question, answer pattern), got {len(cols)}: {line.strip()[:80]!r}.")
        yield f"{path}:{lineno}", cols[2], [cols[3]]
    except UnicodeDecodeError as e:
      raise ValueError(f"{path}: not valid UTF-8 ({e}); convert the file to UTF-8.") from None


@dataclasses.dataclass(frozen=True)
class QaFile:
  """One accepted file of a split: its name in a local folder, how to read it, (for the file the
  builder downloads) its URL, and (for a file that is not the official split) what it is, said in
  the log when it is read. An archive's URL extracts to a folder holding `name`."""
  name: str
  read: Callable[[str], Iterator[tuple[str, str, list[str]]]]
  url: str = ""
  note: str = ""


def _check_length(where: str, question: str) -> None:
  """A question longer than the readers and `ask` take fails here, naming its line, rather than
  in the middle of a run."""
  if len(question) > MAX_QUESTION_CHARS:
    raise ValueError(f"{where}: the question has {len(question):,} characters, more than the "
                     f"{MAX_QUESTION_CHARS:,} a question may have; shorten or remove it.")


def read_qa_file(path: str, qa_file: QaFile, answer_type: str) -> list[dict]:
  """[{"question", "answers"}] of one file; errors name the file and line."""
  out = []
  for where, question, answers in qa_file.read(path):
    if not question.strip():
      raise ValueError(f"{where}: the question is empty; fix or remove it.")
    _check_length(where, question)
    if answer_type == "regex":
      for pattern in answers:
        if not pattern.strip():
          raise ValueError(f"{where}: answer pattern {pattern!r} is empty: it would match every "
                           "text and every prediction; fix or remove it.")
        try:
          re.compile(pattern)
        except re.error as e:
          raise ValueError(f"{where}: answer pattern {pattern!r} is not a valid regular "
                           f"expression ({e}); fix it.") from None
    out.append({"question": question, "answers": answers})
  if not out:
    raise ValueError(f"{path} holds no question.")
  if qa_file.note:
    logging.warning("%s: %d questions, %s", path, len(out), qa_file.note)
  else:
    logging.info("%s: %d questions", path, len(out))
  return out


class _QaBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """A QA dataset from its official files (downloaded) or from a local folder holding them.

  Builder configs: "official" (downloads every split), or "local_<fingerprint>" for a folder (the
  fingerprint covers the names, sizes and times of its files, so a changed file is rebuilt). A
  folder needs only the splits it is used for: the others are left out of the built dataset.
  """

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Questions and answers in source order."}
  ANSWER_TYPE = "text"
  SPLITS: dict[str, tuple[QaFile, ...]] = {}
  HOMEPAGE = ""

  def __init__(self, *, local_dir: str | None = None, **kwargs):
    self._local_dir = local_dir
    if local_dir is None:
      config = tfds.core.BuilderConfig(name="official", description="The official files.")
    else:
      self._found = _local_files(type(self), local_dir)
      h = hashlib.sha256()
      for split, (path, _) in sorted(self._found.items()):
        st = os.stat(path)
        h.update(f"{split}|{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode())
      config = tfds.core.BuilderConfig(name=f"local_{h.hexdigest()[:12]}",
                                       description=f"Read from {os.path.abspath(local_dir)}.")
    super().__init__(config=config, file_format="array_record", **kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return LocalDatasetInfo(
        builder=self,
        description=f"{type(self).__doc__.strip()} Answer type: {self.ANSWER_TYPE}.",
        features=tfds.features.FeaturesDict({
            "question": tfds.features.Text(),
            "answers": tfds.features.Sequence(tfds.features.Text())}),
        homepage=self.HOMEPAGE,
        disable_shuffling=True)  # rows in source order

  def _split_generators(self, dl_manager):
    if self._local_dir is not None:
      found = self._found
    else:
      urls = {split: files[0].url for split, files in self.SPLITS.items()}
      try:
        downloaded = dl_manager.download_and_extract(urls)
      except OSError as e:  # requests' errors are OSErrors too
        raise OSError(
            f"{self.name}: could not download {', '.join(sorted(set(urls.values())))} ({e}). "
            "Without network access, fetch the file(s) elsewhere (extracting archives) and pass "
            "their folder as local_dir (config.data.local_dir, evaluate.py --dataset_dir).") from e
      found = {split: (_file_in(str(downloaded[split]), files[0].name), files[0])
               for split, files in self.SPLITS.items()}
    return {split: self._generate_examples(path, qa_file)
            for split, (path, qa_file) in found.items()}

  def _generate_examples(self, path, qa_file):
    for i, ex in enumerate(read_qa_file(path, qa_file, self.ANSWER_TYPE)):
      yield i, ex


class NqOpen(_QaBuilder, skip_registration=True):
  """NQ-Open (Lee et al. 2019): Natural Questions with short answers of at most 5 tokens."""

  HOMEPAGE = "https://github.com/google-research-datasets/natural-questions/tree/master/nq_open"
  SPLITS = {split: (QaFile(name, _read_nq_jsonl, _NQ_URL + name),) for split, name in (
      ("train", "NQ-open.train.jsonl"), ("dev", "NQ-open.dev.jsonl"),
      ("efficientqa_dev", "NQ-open.efficientqa.dev.1.1.jsonl"))}
  SPLITS["train"] += (QaFile("NQ-open.train-sample.jsonl", _read_nq_jsonl, note=(
      "a sample of NQ-Open train (../shared/data's: the 8,757 questions DPR holds out of it as its "
      "dev set), not the whole split: that is NQ-open.train.jsonl (87,925 questions), "
      f"{_NQ_URL}NQ-open.train.jsonl")),)


class TriviaQa(_QaBuilder, skip_registration=True):
  """TriviaQA (Joshi et al. 2017), unfiltered: trivia questions with the aliases of each answer."""

  HOMEPAGE = "http://nlp.cs.washington.edu/triviaqa/"
  SPLITS = {split: (QaFile(f"unfiltered-web-{split}.json", _read_triviaqa_json, _TRIVIA_URL),)
            for split in ("train", "dev")}
  SPLITS["train"] += (QaFile("trivia_qa.unfiltered.dev.jsonl", _read_nq_jsonl, note=(
      "a sample of TriviaQA unfiltered train (../shared/data's: the 8,837 questions ORQA and DPR "
      "hold out of it as their dev set), not the whole split: that is unfiltered-web-train.json "
      f"(87,622 questions) in {_TRIVIA_URL}")),)


class WebQuestions(_QaBuilder, skip_registration=True):
  """WebQuestions (Berant et al. 2013): Google Suggest questions answered from Freebase."""

  HOMEPAGE = "https://nlp.stanford.edu/software/sempre/"
  SPLITS = {split: (
      QaFile(f"webquestions.examples.{split}.json", _read_webquestions_json,
             f"{_WQ_URL}webquestions.examples.{split}.json.bz2"),
      QaFile(f"WebQuestions-{split}.txt", _read_nq_jsonl),
      QaFile(f"{split}.jsonl", _read_nq_jsonl)) for split in ("train", "test")}


class CuratedTrec(_QaBuilder, skip_registration=True):
  """CuratedTREC (Baudis & Sedivy 2015): TREC QA questions with regular-expression answers."""

  HOMEPAGE = "https://github.com/brmson/dataset-factoid-curated"
  ANSWER_TYPE = "regex"
  SPLITS = {split: (QaFile(f"CuratedTrec-{split}.txt", _read_nq_jsonl, _DRQA_TREC_URL),
                    QaFile(f"curated-{split}.tsv", _read_trec_tsv),
                    QaFile(f"{split}.jsonl", _read_nq_jsonl, note=(
                        f"not DrQA's CuratedTrec-{split}.txt (../shared/data's are brmson's "
                        "large2470-train and curated-test), while ORQA, REALM and DPR report on "
                        "DrQA's 1,486 / 694 questions: figures on it do not compare with theirs")))
            for split in ("train", "test")}


BUILDERS: dict[str, type[_QaBuilder]] = {
    b.name: b for b in (NqOpen, TriviaQa, WebQuestions, CuratedTrec)}


def _file_in(path: str, name: str) -> str:
  """`path` itself, or the file called `name` inside the folder an archive extracted to."""
  if not os.path.isdir(path):
    return path
  found = sorted(glob.glob(os.path.join(glob.escape(path), "**", name), recursive=True))
  if not found:
    raise FileNotFoundError(f"The downloaded archive (extracted to {path}) holds no {name}.")
  return found[0]


def _local_files(builder: type[_QaBuilder], local_dir: str) -> dict[str, tuple[str, QaFile]]:
  """{split: (path, QaFile)} for the splits whose file is in `local_dir` (the first accepted name
  that is there); an error if the folder is missing or holds none of them."""
  if os.path.isfile(local_dir):
    raise FileNotFoundError(
        f"{builder.name}: local_dir {local_dir} is a file: pass the folder that holds it (its "
        f"name must be one of {_expected(builder)}).")
  if not os.path.isdir(local_dir):
    raise FileNotFoundError(
        f"{builder.name}: folder {local_dir} does not exist. Put the dataset's files there "
        f"({_expected(builder)}), or leave local_dir unset to download them.")
  found = {}
  for split, files in builder.SPLITS.items():
    for qa_file in files:
      path = os.path.join(local_dir, qa_file.name)
      if os.path.isfile(path):
        found[split] = (path, qa_file)
        break
  if not found:
    raise FileNotFoundError(f"{builder.name}: folder {local_dir} holds none of its files: "
                            f"expected {_expected(builder)}.")
  return found


def _names(builder: type[_QaBuilder], split: str) -> str:
  return " or ".join(f.name for f in builder.SPLITS[split])


def _expected(builder: type[_QaBuilder]) -> str:
  return "; ".join(f"{split}: {_names(builder, split)}" for split in builder.SPLITS)


def _builder_class(name: str, split: str) -> type[_QaBuilder]:
  if name not in BUILDERS:
    raise ValueError(f"Unknown QA dataset {name!r}: use one of {tuple(BUILDERS)}.")
  builder = BUILDERS[name]
  if split not in builder.SPLITS:
    raise ValueError(f"{name} has no split {split!r}: use one of {tuple(builder.SPLITS)}.")
  return builder


def load_questions(name: str, split: str, *, local_dir: str | None = None,
                   data_dir: str | None = None) -> list[dict]:
  """[{"question": str, "answers": [str, ...], "answer_type": "text" | "regex"}] in source order.

  Args:
    name: "nq_open", "trivia_qa", "web_questions" or "curated_trec".
    split: one of the dataset's splits (see the module docstring).
    local_dir: a folder holding the split's file: read directly, nothing is downloaded or built.
      Without it, the TFDS dataset is downloaded and built in `data_dir` (TFDS's default when None).
  """
  builder_cls = _builder_class(name, split)
  if local_dir is not None:
    found = _local_files(builder_cls, local_dir)
    if split not in found:
      url = builder_cls.SPLITS[split][0].url
      extract = " and extract it" if url.endswith((".tar.gz", ".bz2")) else ""
      raise FileNotFoundError(
          f"{name} split {split!r} needs {_names(builder_cls, split)} in {local_dir}, which is not "
          f"there: download it from {url}{extract} into that folder, or leave local_dir unset to "
          "download it.")
    path, qa_file = found[split]
    rows = read_qa_file(path, qa_file, builder_cls.ANSWER_TYPE)
  else:
    builder = prepare(lambda: builder_cls(data_dir=data_dir), name)
    rows = [{"question": _text(ex["question"]), "answers": [_text(a) for a in ex["answers"]]}
            for ex in builder.as_data_source(split=split)]
  return [{**row, "answer_type": builder_cls.ANSWER_TYPE} for row in rows]


def load_qa_jsonl(path: str, limit: int | None = None) -> list[dict]:
  """Questions of a NQ-Open style JSONL file as [{"question", "answer"}]; errors name the file
  and line. (The older form of `load_questions` for any file of that format.)"""
  out = []
  for where, question, answers in _read_nq_jsonl(path):
    _check_length(where, question)
    out.append({"question": question, "answer": answers})
    if limit is not None and len(out) >= limit:
      break
  if not out:
    raise ValueError(f"{path} holds no question.")
  return out


def split_by_hash(questions: Sequence[dict], dev_percent: float,
                  seed_string: str) -> tuple[list[dict], list[dict]]:
  """(train, dev): each question goes to dev iff a stable hash of its normalised text falls in the
  first `dev_percent` percent of the hash range.

  The hash is SHA-256 of `seed_string + "\\0" + normalize_answer(question)`, bucket = its first 8
  bytes (big-endian) mod 10,000; dev iff bucket < round(100 * dev_percent). So the split is the
  same on every machine and Python run, a question's side depends neither on the order nor on the
  other questions, and questions that normalise alike (case, punctuation, articles) share a side,
  so no near-duplicate leaks across. Another `seed_string` gives another, independent split. Both
  lists keep the input order; the dev share is `dev_percent` only in expectation.
  """
  if not 0 <= dev_percent <= 100:
    raise ValueError(f"dev_percent={dev_percent} must be between 0 and 100.")
  threshold = round(100 * dev_percent)
  train, dev = [], []
  for q in questions:
    key = f"{seed_string}\0{normalize_answer(q['question'])}".encode("utf-8")
    bucket = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % 10_000
    (dev if bucket < threshold else train).append(q)
  return train, dev


def _text(v) -> str:
  return v.decode("utf-8") if isinstance(v, bytes) else str(v)
