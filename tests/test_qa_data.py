"""QA datasets: NQ-Open / TriviaQA / WebQuestions / CuratedTREC files through the TFDS builders and
`load_questions` (../shared/data's files and written ones in each official format), errors that
name the file and line, `split_by_hash`, answer matching by hand."""

import json
import logging
import os
import random

import pytest

from realm_jax.data.qa import (CuratedTrec, NqOpen, TriviaQa, WebQuestions, _iter_json_array,
                               load_questions, split_by_hash)
from realm_jax.text.answers import exact_match, has_answer, normalize_answer, regex_match

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
SHARED_NQ = os.path.join(SHARED, "nq_open")

# brmson/dataset-factoid-curated's TSV: id, type, question, answer pattern (lines of its test file).
TREC_TSV = ("2312\tfactoid\tHow many republics made up the Soviet Union?\t\\b15\\b|fifteen\n"
            "\n"
            "2115\tfactoid\tIn what Canadian province are most people of French descent?"
            "\tQu[eé]bec\n"
            "1622\tfactoid\tWho was Woodrow Wilson's First Lady?\t(Ellen|Edith)(_Axson_Wilson)?\n")
TREC_ROWS = [
    ("How many republics made up the Soviet Union?", ["\\b15\\b|fifteen"]),
    ("In what Canadian province are most people of French descent?", ["Qu[eé]bec"]),
    ("Who was Woodrow Wilson's First Lady?", ["(Ellen|Edith)(_Axson_Wilson)?"])]

# The official WebQuestions file: one JSON array; answers quoted or bare inside (description ...).
WEBQ = [
    {"url": "http://www.freebase.com/view/en/justin_bieber",
     "targetValue": '(list (description "Jazmyn Bieber") (description "Jaxon Bieber"))',
     "utterance": "what is the name of justin bieber brother?"},
    {"url": "http://www.freebase.com/view/en/natalie_portman",
     "targetValue": "(list (description Padm\u00e9) (description \"Anakin's \\\"mother\\\"\"))",
     "utterance": "what character did natalie portman play in star wars?"}]


def build(builder_cls, local_dir, data_dir):
  builder = builder_cls(local_dir=str(local_dir), data_dir=str(data_dir))
  builder.download_and_prepare()
  return builder


def rows_of(builder, split):
  text = lambda v: v.decode("utf-8") if isinstance(v, bytes) else str(v)
  return [{"question": text(ex["question"]), "answers": [text(a) for a in ex["answers"]]}
          for ex in builder.as_data_source(split=split)]


def test_shared_nq_open_folder_through_builder_and_load_questions(tmp_path):
  if not os.path.isdir(SHARED_NQ):
    pytest.skip("../shared/data/nq_open is not here")
  qs = load_questions("nq_open", "dev", local_dir=SHARED_NQ)
  assert len(qs) == 3610
  assert qs[0] == {"question": "when was the last time anyone was on the moon",
                   "answers": ["14 December 1972 UTC", "December 1972"], "answer_type": "text"}
  assert len(load_questions("nq_open", "efficientqa_dev", local_dir=SHARED_NQ)) == 1800

  builder = build(NqOpen, SHARED_NQ, tmp_path)
  assert set(builder.info.splits) == {"train", "dev", "efficientqa_dev"}  # train: the sample
  assert builder.info.splits["dev"].num_examples == 3610
  assert builder.info.splits["train"].num_examples == 8757
  assert rows_of(builder, "dev") == [{k: q[k] for k in ("question", "answers")} for q in qs]


# (dataset, split, questions, first question, its answers, file read) of ../shared/data's files.
SHARED_FILES = [
    ("nq_open", "train", 8757, "who sings does he love me with reba", ["Linda Davis"],
     "NQ-open.train-sample.jsonl"),
    ("trivia_qa", "train", 8837, "The VS-300 was a type of what?", None,
     "trivia_qa.unfiltered.dev.jsonl"),
    ("web_questions", "train", 3778, "what character did natalie portman play in star wars?",
     ["Padmé Amidala"], "train.jsonl"),
    ("web_questions", "test", 2032, "what does jamaican people speak?",
     ["Jamaican Creole English Language", "Jamaican English"], "test.jsonl"),
    ("curated_trec", "train", 1704, "When is Fashion week in NYC?", ["Sept?(ember)?|Feb(ruary)?"],
     "train.jsonl"),
    ("curated_trec", "test", 430, "How tall is Mount McKinley?", None, "test.jsonl"),
]


@pytest.mark.parametrize("name,split,count,first,answers,file", SHARED_FILES,
                         ids=[f"{f[0]}-{f[1]}" for f in SHARED_FILES])
def test_shared_files_load_with_their_counts_and_answers(name, split, count, first, answers, file,
                                                         caplog):
  folder = os.path.join(SHARED, name)
  if not os.path.isdir(folder):
    pytest.skip(f"../shared/data/{name} is not here")
  with caplog.at_level(logging.INFO):
    qs = load_questions(name, split, local_dir=folder)
  assert len(qs) == count and qs[0]["question"] == first
  if answers is not None:
    assert qs[0]["answers"] == answers
  assert {q["answer_type"] for q in qs} == {"regex" if name == "curated_trec" else "text"}
  assert all(q["answers"] and all(a.strip() for a in q["answers"]) for q in qs)
  # The log says which file was read, and whether it is the whole split.
  said = [r.getMessage() for r in caplog.records if file in r.getMessage()]
  assert len(said) == 1 and f"{count} questions" in said[0], caplog.text
  sample = file.endswith(("train-sample.jsonl", "unfiltered.dev.jsonl"))
  assert ("a sample of" in said[0]) == sample
  if name == "curated_trec":
    assert "not DrQA's" in said[0]


def test_shared_trec_regexes_compile_and_match_known_answers():
  folder = os.path.join(SHARED, "curated_trec")
  if not os.path.isdir(folder):
    pytest.skip("../shared/data/curated_trec is not here")
  test = load_questions("curated_trec", "test", local_dir=folder)  # every pattern compiled
  train = load_questions("curated_trec", "train", local_dir=folder)
  mckinley = test[0]["answers"]
  assert regex_match("Denali rises 20,320 feet above sea level.", mckinley)
  assert regex_match("its summit is 6,194-meter high", mckinley)
  assert not regex_match("It is 5,000 feet high.", mckinley)
  mecca = next(q for q in train if q["question"].startswith("What country is the holy city"))
  assert regex_match("Mecca, in Saudi Arabia", mecca["answers"])
  assert not regex_match("Mecca, in Yemen", mecca["answers"])


def test_shared_trivia_qa_keeps_every_alias():
  folder = os.path.join(SHARED, "trivia_qa")
  if not os.path.isdir(folder):
    pytest.skip("../shared/data/trivia_qa is not here")
  qs = load_questions("trivia_qa", "train", local_dir=folder)
  aliases = qs[0]["answers"]
  assert len(aliases) == 14 and aliases[0] == "🚁"
  assert {"Helicopter", "Helicopters", "Copter", "Pescara (helicopter)"} <= set(aliases)
  assert exact_match("a copter", aliases) and has_answer("The VS-300 helicopter", aliases)
  assert sum(len(q["answers"]) > 1 for q in qs) > len(qs) / 2  # most answers have aliases
  # The longest question (1,004 characters) loads: MAX_QUESTION_CHARS leaves room for it.
  assert max(len(q["question"]) for q in qs) == 1004


# The official TriviaQA file: one JSON object; a question's answer has a value and aliases.
TRIVIA = {"Data": [
    {"Answer": {"Aliases": ["Helicopters", "Helicopter", "Copter"], "Value": "Helicopter",
                "NormalizedValue": "helicopter", "Type": "WikipediaEntity"},
     "EntityPages": [], "Question": "The VS-300 was a type of what?", "QuestionId": "tc_1",
     "SearchResults": [{"Description": "Sikorsky's \"first\" ]} helicopter", "Rank": 0}]},
    {"Answer": {"Aliases": ["Paris"], "Value": "Paris"}, "Question": " Capital of France? ",
     "QuestionId": "tc_2"}],
    "Domain": "Web", "VerifiedEval": False, "Version": 1.0}


def test_trivia_qa_official_format_local_and_downloaded(tmp_path, caplog):
  folder = tmp_path / "tq"
  folder.mkdir()
  (folder / "unfiltered-web-train.json").write_text(json.dumps(TRIVIA, indent=4), encoding="utf-8")
  with caplog.at_level(logging.INFO):
    qs = load_questions("trivia_qa", "train", local_dir=str(folder))
  # The value first, then the aliases not already given; the question stripped.
  assert [(q["question"], q["answers"]) for q in qs] == [
      ("The VS-300 was a type of what?", ["Helicopter", "Helicopters", "Copter"]),
      ("Capital of France?", ["Paris"])]
  assert "a sample" not in caplog.text and "unfiltered-web-train.json: 2 questions" in caplog.text
  # Read in pieces of any size: an item cut by a piece's end is read whole (strings with brackets).
  text = json.dumps(TRIVIA)
  (tmp_path / "one_line.json").write_text(text, encoding="utf-8")
  for chunk in (1, 7, 64, len(text)):
    assert list(_iter_json_array(str(tmp_path / "one_line.json"), "Data", chunk)) == TRIVIA["Data"]

  # The official config downloads the unfiltered release, which extracts to a folder.
  inner = tmp_path / "extracted" / "triviaqa-unfiltered"
  inner.mkdir(parents=True)
  for split in ("train", "dev"):
    (inner / f"unfiltered-web-{split}.json").write_text(json.dumps(TRIVIA), encoding="utf-8")
  url = "http://nlp.cs.washington.edu/triviaqa/data/triviaqa-unfiltered.tar.gz"
  dl = FakeDownloads({url: tmp_path / "extracted"})
  generators = TriviaQa(data_dir=str(tmp_path / "data"))._split_generators(dl)
  assert set(dl.urls) == {"train", "dev"} and set(dl.urls.values()) == {url}
  assert [ex["answers"] for _, ex in generators["dev"]][1] == ["Paris"]


@pytest.mark.parametrize("text,error", [
    ('{"Version": 1.0}', r'expected a JSON object with a "Data": \[\.\.\.\] array'),
    ('{"Data": [{"Question": "q?", "Answer": {"Value": "a"}}, {"Question": "r?"', r"not valid JSON"
     r' after item #1 of "Data"'),
    ('{"Data": [{"Question": "q?", "Answer": {"Value": "a"}} ', r'the "Data" array is not closed'),
    ('{"Data": [{"Question": "q?", "QuestionId": "x"}]}',
     r"question #0: expected .*not the test file without them"),
    ('{"Data": [{"Question": "q?", "Answer": {"Value": " ", "Aliases": [""]}}]}',
     r"question #0: the answer is blank"),
])
def test_malformed_trivia_qa_files_say_what_is_wrong(tmp_path, text, error):
  (tmp_path / "unfiltered-web-dev.json").write_text(text, encoding="utf-8")
  with pytest.raises(ValueError, match=r"unfiltered-web-dev\.json: " + error):
    load_questions("trivia_qa", "dev", local_dir=str(tmp_path))


def test_the_whole_train_split_is_read_before_a_sample(tmp_path, caplog):
  line = json.dumps({"question": "who?", "answer": ["me"]}) + "\n"
  (tmp_path / "NQ-open.train-sample.jsonl").write_text(line, encoding="utf-8")
  with caplog.at_level(logging.INFO):
    assert len(load_questions("nq_open", "train", local_dir=str(tmp_path))) == 1
  assert "a sample of NQ-Open train" in caplog.text and "NQ-open.train.jsonl (87,925" in caplog.text
  (tmp_path / "NQ-open.train.jsonl").write_text(line * 2, encoding="utf-8")
  caplog.clear()
  with caplog.at_level(logging.INFO):
    assert len(load_questions("nq_open", "train", local_dir=str(tmp_path))) == 2
  assert "a sample" not in caplog.text and "NQ-open.train.jsonl: 2 questions" in caplog.text
  builder = build(NqOpen, tmp_path, tmp_path / "data")
  assert builder.info.splits["train"].num_examples == 2


def test_curated_trec_regex_answers_round_trip(tmp_path):
  folder = tmp_path / "trec"
  folder.mkdir()
  (folder / "curated-test.tsv").write_text(TREC_TSV, encoding="utf-8")
  # DrQA's CuratedTrec-train.txt: JSON lines whose answers are patterns.
  (folder / "CuratedTrec-train.txt").write_text(json.dumps(
      {"question": "What is the capital of Kentucky?", "answer": ["Frankfort", "\\bKY\\b"]}) + "\n",
      encoding="utf-8")

  test = load_questions("curated_trec", "test", local_dir=str(folder))
  assert [(q["question"], q["answers"]) for q in test] == TREC_ROWS
  assert {q["answer_type"] for q in test} == {"regex"} and CuratedTrec.ANSWER_TYPE == "regex"
  assert load_questions("curated_trec", "train", local_dir=str(folder))[0]["answers"] == [
      "Frankfort", "\\bKY\\b"]

  builder = build(CuratedTrec, folder, tmp_path / "data")
  assert rows_of(builder, "test") == [{"question": q, "answers": a} for q, a in TREC_ROWS]
  patterns = rows_of(builder, "test")[1]["answers"]
  assert regex_match("Most live in QUÉBEC.", patterns) and regex_match("quebec city", patterns)
  assert not regex_match("Ontario", patterns)


def test_web_questions_official_format(tmp_path):
  (tmp_path / "webquestions.examples.test.json").write_text(json.dumps(WEBQ), encoding="utf-8")
  qs = load_questions("web_questions", "test", local_dir=str(tmp_path))
  assert [(q["question"], q["answers"], q["answer_type"]) for q in qs] == [
      ("what is the name of justin bieber brother?", ["Jazmyn Bieber", "Jaxon Bieber"], "text"),
      ("what character did natalie portman play in star wars?",
       ["Padm\u00e9", 'Anakin\'s "mother"'], "text")]
  builder = build(WebQuestions, tmp_path, tmp_path / "data")
  assert set(builder.info.splits) == {"test"}
  assert rows_of(builder, "test") == [{k: q[k] for k in ("question", "answers")} for q in qs]
  # Saved by an editor that writes a UTF-8 byte-order mark: the same questions.
  (tmp_path / "webquestions.examples.test.json").write_text(json.dumps(WEBQ), encoding="utf-8-sig")
  assert load_questions("web_questions", "test", local_dir=str(tmp_path)) == qs


class FakeDownloads:
  """Offline stand-in for TFDS's download manager: maps each URL to a local path."""

  def __init__(self, paths):
    self.paths, self.urls = paths, None

  def download_and_extract(self, urls):
    self.urls = urls
    return {split: self.paths[url] for split, url in urls.items()}


def test_official_config_reads_the_downloaded_files(tmp_path):
  # DrQA's archive extracts to a folder that holds CuratedTrec-<split>.txt somewhere inside.
  inner = tmp_path / "extracted" / "CuratedTrec"
  inner.mkdir(parents=True)
  for split in ("train", "test"):
    (inner / f"CuratedTrec-{split}.txt").write_text(json.dumps(
        {"question": f"{split} question?", "answer": ["Qu[eé]bec"]}) + "\n", encoding="utf-8")
  builder = CuratedTrec(data_dir=str(tmp_path / "data"))
  assert builder.builder_config.name == "official"
  dl = FakeDownloads({"https://dl.fbaipublicfiles.com/drqa/CuratedTrec.tar.gz":
                      tmp_path / "extracted"})
  generators = builder._split_generators(dl)
  assert set(dl.urls) == {"train", "test"}
  assert [ex for _, ex in generators["test"]] == [{"question": "test question?",
                                                   "answers": ["Qu[eé]bec"]}]

  # The .json.bz2 of WebQuestions extracts to a single file (under a name of TFDS's choosing).
  extracted = tmp_path / "ABCDEF.json"
  extracted.write_text(json.dumps(WEBQ), encoding="utf-8")
  base = ("http://nlp.stanford.edu/static/software/sempre/release-emnlp2013/lib/data/webquestions/"
          "dataset_11/webquestions.examples.")
  dl = FakeDownloads({base + "train.json.bz2": extracted, base + "test.json.bz2": extracted})
  generators = WebQuestions(data_dir=str(tmp_path / "data"))._split_generators(dl)
  assert [ex["answers"] for _, ex in generators["train"]][0] == ["Jazmyn Bieber", "Jaxon Bieber"]


class OfflineDownloads:
  """A download manager without network access, failing as requests does."""

  def download_and_extract(self, urls):
    import requests
    raise requests.exceptions.ConnectionError("Failed to resolve 'dl.fbaipublicfiles.com'")


def test_a_failed_download_says_how_to_go_on_offline(tmp_path):
  with pytest.raises(OSError, match=r"curated_trec: could not download https://dl.fbaipublicfiles"
                                    r".com/drqa/CuratedTrec.tar.gz \(Failed to resolve .*pass "
                                    r"their folder as local_dir \(config.data.local_dir"):
    CuratedTrec(data_dir=str(tmp_path / "data"))._split_generators(OfflineDownloads())


def test_missing_folder_file_and_unknown_names(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"nq_open: folder .*nope does not exist.*"
                                              r"NQ-open\.dev\.jsonl"):
    load_questions("nq_open", "dev", local_dir=str(tmp_path / "nope"))
  with pytest.raises(FileNotFoundError, match=r"holds none of its files.*curated-test\.tsv"):
    load_questions("curated_trec", "test", local_dir=str(tmp_path))
  (tmp_path / "NQ-open.dev.jsonl").write_text('{"question": "q", "answer": ["a"]}\n')
  with pytest.raises(FileNotFoundError, match=(
      r"nq_open split 'train' needs NQ-open\.train\.jsonl or NQ-open\.train-sample\.jsonl in .*: "
      r"download it from "
      r"https://raw\.githubusercontent\.com/google-research-datasets/natural-questions/master/"
      r"nq_open/NQ-open\.train\.jsonl")):
    load_questions("nq_open", "train", local_dir=str(tmp_path))
  # The file itself instead of its folder: said so, not "folder ... does not exist".
  with pytest.raises(FileNotFoundError, match=r"nq_open: local_dir .*NQ-open\.dev\.jsonl is a "
                                              r"file: pass the folder that holds it"):
    load_questions("nq_open", "dev", local_dir=str(tmp_path / "NQ-open.dev.jsonl"))
  with pytest.raises(ValueError, match=r"Unknown QA dataset 'squad'.*'nq_open'"):
    load_questions("squad", "dev", local_dir=str(tmp_path))
  with pytest.raises(ValueError, match=r"web_questions has no split 'dev'.*'train', 'test'"):
    load_questions("web_questions", "dev", local_dir=str(tmp_path))


@pytest.mark.parametrize("name,split,file,text,error", [
    ("nq_open", "dev", "NQ-open.dev.jsonl",
     '{"question": "q", "answer": ["a"]}\n\n{"question": "q2", "answer": []}\n',
     r"NQ-open\.dev\.jsonl:3: expected \{\"question\": str, \"answer\""),
    ("nq_open", "dev", "NQ-open.dev.jsonl", '{"question": "q", "answer": ["a"]}\n'
     '{"question": "q2", "answer": ["", " "]}\n',  # no answer to find or compare
     r"NQ-open\.dev\.jsonl:2: expected \{\"question\": str, \"answer\".*at least one answer"),
    ("curated_trec", "test", "CuratedTrec-test.txt",  # would match every text and prediction
     '{"question": "Who?", "answer": ["Paris", ""]}\n',
     r"CuratedTrec-test\.txt:1: answer pattern '' is empty"),
    ("curated_trec", "test", "curated-test.tsv", "1\tfactoid\tWho?\t \n",
     r"curated-test\.tsv:1: answer pattern ' ' is empty"),
    ("nq_open", "dev", "NQ-open.dev.jsonl", '{"question": "q", "answer": ["a"]}\n{"question": \n',
     r"NQ-open\.dev\.jsonl:2:14: not valid JSON"),
    ("nq_open", "dev", "NQ-open.dev.jsonl", '{"question": " ", "answer": ["a"]}\n',
     r"NQ-open\.dev\.jsonl:1: the question is empty"),
    ("nq_open", "dev", "NQ-open.dev.jsonl",
     '{"question": "q", "answer": ["a"]}\n' + json.dumps({"question": "w" * 2001, "answer": ["a"]}),
     r"NQ-open\.dev\.jsonl:2: the question has 2,001 characters, more than the 2,000"),
    ("curated_trec", "test", "curated-test.tsv", "1\tfactoid\tWho?\tx\n2\tfactoid\tWhat?\n",
     r"curated-test\.tsv:2: expected 4 tab-separated columns .*got 3"),
    ("curated_trec", "test", "curated-test.tsv",
     "1\tfactoid\tWho?\tx\n2\tfactoid\tWhat?\t(unclosed\n",
     r"curated-test\.tsv:2: answer pattern '\(unclosed' is not a valid regular expression"),
    ("curated_trec", "test", "CuratedTrec-test.txt", '{"question": "Who?", "answer": ["[a-"]}\n',
     r"CuratedTrec-test\.txt:1: answer pattern '\[a-' is not a valid regular expression"),
    ("web_questions", "train", "webquestions.examples.train.json",
     json.dumps([WEBQ[0], {"utterance": "who?", "targetValue": "(list)", "url": ""}]),
     r"webquestions\.examples\.train\.json: example #1: targetValue '\(list\)' holds no"),
    ("web_questions", "train", "webquestions.examples.train.json", '[{"utterance": "who?"}',
     r"webquestions\.examples\.train\.json: not a valid UTF-8 JSON file"),
])
def test_malformed_files_name_the_file_and_line(tmp_path, name, split, file, text, error):
  (tmp_path / file).write_text(text, encoding="utf-8")
  with pytest.raises(ValueError, match=error):
    load_questions(name, split, local_dir=str(tmp_path))


def test_split_by_hash_is_deterministic_disjoint_and_complete():
  qs = [{"question": f"who won match number {i}?", "answers": [str(i)]} for i in range(2000)]
  train, dev = split_by_hash(qs, 10, "seed")
  assert (train, dev) == split_by_hash(qs, 10, "seed")
  assert len(train) + len(dev) == len(qs)
  assert sorted(q["answers"][0] for q in train + dev) == sorted(q["answers"][0] for q in qs)
  assert 150 < len(dev) < 250  # 10% in expectation
  assert [qs.index(q) for q in dev] == sorted(qs.index(q) for q in dev)  # input order kept

  # A question's side depends only on its normalised text and the seed, not on its neighbours.
  shuffled = qs[::-1]
  random.Random(0).shuffle(shuffled)
  dev_ids = {q["answers"][0] for q in dev}
  assert {q["answers"][0] for q in split_by_hash(shuffled, 10, "seed")[1]} == dev_ids
  assert {q["answers"][0] for q in split_by_hash(qs[:100], 10, "seed")[1]} == {
      a for a in dev_ids if int(a) < 100}
  assert {q["answers"][0] for q in split_by_hash(qs, 10, "other seed")[1]} != dev_ids
  # Questions that normalise alike share a side.
  for q in qs[:50]:
    twin = {"question": "  THE " + q["question"].upper().replace("?", " !"), "answers": []}
    assert normalize_answer(twin["question"]) == normalize_answer(q["question"])
    assert (q in dev) == (len(split_by_hash([twin], 10, "seed")[1]) == 1)

  assert split_by_hash(qs, 0, "seed") == (qs, []) and split_by_hash(qs, 100, "seed") == ([], qs)
  with pytest.raises(ValueError, match="dev_percent=101"):
    split_by_hash(qs, 101, "seed")


def test_split_by_hash_is_pinned():
  # The hash is part of the data: a change would silently move questions between train and dev.
  qs = [{"question": q} for q in ("who wrote hamlet", "when did ww2 end",
                                  "what is the capital of peru", "who painted the mona lisa",
                                  "how tall is everest")]
  dev = split_by_hash(qs, 50, "realm")[1]
  assert [q["question"] for q in dev] == ["what is the capital of peru", "how tall is everest"]


@pytest.mark.parametrize("text,want", [
    ("The  Rolling\tStones\n", "rolling stones"),        # article, tab and newline
    ("a Tale of Two Cities", "tale of two cities"),
    ("Ángela Merkel", "angela merkel"),                     # NFD, then the accents dropped
    ("São Paulo, Brazil.", "sao paulo brazil"),
    ("\u00a0Beyoncé\u2003", "beyonce"),                     # non-breaking and em spaces
    ("A.D. 1066", "ad 1066"),
    ("america\u2019s", "america\u2019s"),  # only ASCII punctuation goes (as in SQuAD's script)
])
def test_em_normalisation_by_hand(text, want):
  assert normalize_answer(text) == want


def test_exact_and_regex_match_by_hand():
  assert exact_match("The Rolling Stones!", ["rolling stones", "Beatles"])
  assert exact_match("Sao Paulo", ["São Paulo"])
  assert not exact_match("Rolling Stone", ["The Rolling Stones"])
  # CuratedTREC patterns match anywhere, case-insensitively, any alternative.
  assert regex_match("There were Fifteen republics.", ["\\b15\\b|fifteen"])
  assert regex_match("USSR had 15 of them", ["\\b15\\b|fifteen"])
  assert not regex_match("It had 150 oblasts", ["\\b15\\b|fifteen"])
  assert regex_match("Edith Bolling Galt", ["(Ellen|Edith)(_Axson_Wilson)?"])
  assert regex_match("x", ["nothing", "^x$"]) and not regex_match("x", [])
