"""Corpus blocks: sentence packing by hand, the TFDS builder, random access, bad input files."""

import json
import logging
import os

import numpy as np
import pytest

from realm_jax.data import blocks
from realm_jax.data.blocks import block_id, pack_blocks, split_sentences
from realm_jax.data.corpus import Corpus, CorpusConfig
from realm_jax.data.sources import documents, read_jsonl
from realm_jax.text import BertTokenizer

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "paris", "is", "the", "capital", "of",
         "france", "it", "has", "a", "river", "seine", "city", "lyon", "second", "big", "berlin",
         "germany", "##s"]


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
  path.write_text("\n".join(WORDS) + "\n")
  return str(path)


@pytest.fixture(scope="module")
def tok(vocab_file):
  return BertTokenizer(vocab_file)


def write_jsonl(path, docs):
  path.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
  return str(path)


def test_sentence_splitter_handles_abbreviations():
  text = "Dr. Smith went to Washington D.C. in 1990. He met Mr. Jones there! Did they talk? Yes."
  assert split_sentences(text) == ["Dr. Smith went to Washington D.C. in 1990.",
                                   "He met Mr. Jones there!", "Did they talk?", "Yes."]


def test_pack_blocks_greedy_by_hand(tok):
  # Title "paris" = 1 piece; block_length 14 -> budget 14 - 3 - 1 = 10 pieces of body.
  text = "Paris is the capital of France. It has a river. Seine is a river. Lyon is second."
  blocks = list(pack_blocks("Paris", text, tok, block_length=14))
  # Sentences: 6 + 5 + 5 + 4 pieces (with the final "."): [6] [5 5] [4] under a budget of 10.
  assert [b["body"] for b in blocks] == ["Paris is the capital of France.",
                                         "It has a river. Seine is a river.", "Lyon is second."]
  assert list(blocks[1]["sentence_starts"]) == [0, 5]
  assert list(blocks[1]["token_ids"]) == tok.encode("It has a river. Seine is a river.")
  assert list(blocks[0]["title_token_ids"]) == tok.encode("Paris")
  assert blocks[0]["block_id"] == block_id("Paris", "Paris is the capital of France.")
  assert all(len(b["token_ids"]) + len(b["title_token_ids"]) + 3 <= 14 for b in blocks)
  whole = list(pack_blocks("Paris", text, tok, blocking="article"))
  assert len(whole) == 1 and len(whole[0]["sentence_starts"]) == 4


def test_overlong_sentence_is_cut_into_budget_pieces(tok):
  text = " ".join(["paris"] * 25) + "."
  blocks = list(pack_blocks("", text, tok, block_length=13))  # budget 10
  assert [len(b["token_ids"]) for b in blocks] == [10, 10, 6]
  assert blocks[2]["body"] == "paris paris paris paris paris."
  with pytest.raises(ValueError, match="block_length=10 leaves fewer than 8 word pieces"):
    list(pack_blocks("", "Lyon.", tok, block_length=10))


def test_overlong_sentence_is_cut_between_words_keeping_its_text(tok):
  # 17 pieces: paris has river ##s [UNK](,) lyon has river ##s [UNK](and) berlin has capital ##s
  # of germany . -- block_length 11 leaves 8 for text. Cutting at 8 would start the second block
  # on "##s"; the cut goes back to the space before "rivers" (7 pieces), then before "Germany".
  text = "Paris has rivers, Lyon has rivers and Berlin has capitals of Germany."
  blocks = list(pack_blocks("", text, tok, block_length=11))
  assert [b["body"] for b in blocks] == [
      "Paris has rivers, Lyon has", "rivers and Berlin has capitals of", "Germany."]
  assert [len(b["token_ids"]) for b in blocks] == [7, 8, 2]
  assert [t for b in blocks for t in b["token_ids"]] == tok.encode(text)
  assert not any(tok.continuation[b["token_ids"][0]] for b in blocks)
  assert blocks[1]["block_id"] == block_id("", "rivers and Berlin has capitals of")
  # A short lead-in, then a run without spaces (one word piece per character): cut inside the
  # run, not after "Paris is" (a block of 2 pieces).
  run = "Paris is " + "\u6771\u4eac" * 12 + "."
  assert len(tok.encode(run)) == 27
  cut = list(pack_blocks("", run, tok, block_length=13))  # budget 10
  assert [len(b["token_ids"]) for b in cut] == [10, 10, 7]
  assert cut[0]["body"] == "Paris is " + "\u6771\u4eac" * 4
  assert [t for b in cut for t in b["token_ids"]] == tok.encode(run)
  # One word of 12 pieces (capital + 10 x ##s, then "."): cut inside it, as nothing else fits.
  word = list(pack_blocks("", "Capitalssssssssss.", tok, block_length=11))
  assert [(b["body"], len(b["token_ids"])) for b in word] == [("Capitalsssssss", 8), ("sss.", 4)]


def test_overlong_title_is_cut_with_a_warning_naming_the_document(tok, caplog):
  # Title: paris is the capital of france [UNK](,) it has a river = 11 pieces; block_length 14
  # keeps 8 for text, so the title keeps 3: cut at the space before "capital".
  title = "Paris is the capital of France, it has a river"
  with caplog.at_level("WARNING"):
    blocks = list(pack_blocks(title, "Lyon is the second city. It is big.", tok, block_length=14,
                              where="docs.jsonl:7"))
  assert "docs.jsonl:7: the title 'Paris is the capital" in caplog.text
  assert "has 11 word pieces" in caplog.text and "cut to its first 3" in caplog.text
  assert [b["title"] for b in blocks] == ["Paris is the", "Paris is the"]
  assert list(blocks[0]["title_token_ids"]) == tok.encode("Paris is the")
  assert [b["body"] for b in blocks] == ["Lyon is the second city.", "It is big."]
  assert all(3 + len(b["title_token_ids"]) + len(b["token_ids"]) <= 14 for b in blocks)
  assert blocks[0]["block_id"] == block_id("Paris is the", "Lyon is the second city.")


def test_block_id_is_stable_and_positive():
  a = block_id("Paris", "Paris is big.")
  assert a == block_id("Paris", "Paris is big.") and 0 < a < 2**63
  assert a != block_id("Paris ", "Paris is big.") and a != block_id("Paris", "Paris is big!")


def corpus_block(corpus, row):
  ex = corpus[row]
  return list(ex["title_token_ids"]), list(ex["token_ids"])


def test_corpus_builds_and_gives_random_access(tmp_path, vocab_file, caplog):
  docs = [{"title": "Paris", "text": "Paris is the capital of France. It has a river."},
          {"title": "Berlin", "text": "Berlin is the capital of Germany."},
          {"title": "Paris", "text": "Paris is the capital of France. It has a river."},  # duplicate
          {"text": "Lyon is the second city of France."},
          {"title": "", "text": "\ufeff\u200b"}]  # no word pieces: no block
  path = write_jsonl(tmp_path / "docs.jsonl", docs)
  config = CorpusConfig(source="jsonl", paths=(path,), vocab_file=vocab_file, block_length=288)
  with caplog.at_level("WARNING"):
    corpus = Corpus.build(str(tmp_path / "data"), config)
  assert len(corpus) == 3  # the duplicate block is skipped
  assert "Skipped 1 duplicate blocks" in caplog.text
  assert f"Skipped 1 documents without text, e.g. {path}:5." in caplog.text
  assert [corpus[i]["title"] for i in range(3)] == ["Paris", "Berlin", ""]
  b = corpus.get(corpus.block_ids[1])
  assert b["body"] == "Berlin is the capital of Germany." and b["title"] == "Berlin"
  assert list(corpus.rows_of([corpus.block_ids[2], 12345])) == [2, -1]
  with pytest.raises(KeyError, match="Block id 12345 is not in the corpus"):
    corpus.get(12345)
  # Rows as in a list: iteration ends at the IndexError past the end; negative rows from the end.
  assert [b["title"] for b in corpus] == ["Paris", "Berlin", ""]
  assert corpus[-3]["body"] == "Paris is the capital of France. It has a river."
  for row in (3, -4):
    with pytest.raises(IndexError, match=f"Row {row} is out of range: the corpus at .* has 3"):
      corpus[row]
  inputs = corpus.model_inputs([1, 2], 16, BertTokenizer(vocab_file))
  tok = BertTokenizer(vocab_file)
  want = [tok.cls_id] + tok.encode("Berlin") + [tok.sep_id] + tok.encode(
      "Berlin is the capital of Germany.") + [tok.sep_id]
  assert list(inputs["input_ids"][0][:len(want)]) == want
  assert list(inputs["token_type_ids"][0][:len(want)]) == [0, 0, 0] + [1] * (len(want) - 3)
  # An untitled block is [CLS] [SEP] body [SEP], the body in segment 1: the layout the
  # pre-training step gives the document tower, so that the index scores what the step scores.
  lyon = tok.encode("Lyon is the second city of France.")
  want = [tok.cls_id, tok.sep_id] + lyon + [tok.sep_id]
  assert list(inputs["input_ids"][1][:len(want)]) == want
  assert list(inputs["token_type_ids"][1][:len(want)]) == [0, 0] + [1] * (len(want) - 2)
  from realm_jax.train.candidates import CandidateBuilder
  assert CandidateBuilder(corpus, tok.cls_id, tok.sep_id, 2, 16, 32)._doc(*corpus_block(
      corpus, 2)) == (want, [0, 0] + [1] * (len(want) - 2))
  # ... and its body is cut to fit, like a titled block's.
  short = corpus.model_inputs([2], 6, tok)
  assert list(short["input_ids"][0]) == [tok.cls_id, tok.sep_id] + lyon[:3] + [tok.sep_id]
  # Opening it again reuses the built dataset and the stored ids.
  again = Corpus.build(str(tmp_path / "data"), config)
  np.testing.assert_array_equal(again.block_ids, corpus.block_ids)
  # Another corpus (a changed file) is built beside it, not mixed in.
  write_jsonl(tmp_path / "docs.jsonl", docs[:2])
  changed = Corpus.build(str(tmp_path / "data"), CorpusConfig(source="jsonl", paths=(path,),
                                                              vocab_file=vocab_file))
  assert len(changed) == 2 and changed.data_dir != corpus.data_dir



def test_routine_tfds_warnings_of_a_build_are_dropped_and_its_own_lines_shown(tmp_path,
                                                                             vocab_file, caplog):
  """TFDS warns at every first build of a realm_jax dataset that it takes a custom config (the
  config printed whole, twice) and that the version folder has no dataset_info.json yet: the log
  filter of every entry point (cli.keep_log_record) drops exactly those, not the build's own."""
  from realm_jax import cli
  docs = [{"title": "Paris", "text": "Paris is the capital of France."}] * 2
  config = CorpusConfig(source="jsonl", paths=(write_jsonl(tmp_path / "d.jsonl", docs),),
                        vocab_file=vocab_file)
  with caplog.at_level("INFO"):
    Corpus.build(str(tmp_path / "data"), config)
  dropped = [r for r in caplog.records if not cli.keep_log_record(r)]
  assert {(r.levelname, r.msg) for r in dropped} == {
      ("WARNING", "Using custom data configuration: %s"),
      ("WARNING", "Variant folder %s has no %s")}
  assert all(f"{os.sep}tensorflow_datasets{os.sep}" in r.pathname for r in dropped)
  shown = [r.getMessage() for r in caplog.records if cli.keep_log_record(r)]
  assert any("Skipped 1 duplicate blocks" in m for m in shown)
  assert any("Generating dataset realm_blocks" in m for m in shown)  # TFDS's INFO line stays
  # The same text logged by another library is shown; orbax and grain lose INFO, not warnings.
  def record(lib, level, msg):
    path = os.path.join(os.sep, "site-packages", lib, "x.py")
    return logging.LogRecord("absl", level, path, 1, msg, ("a", "b"), None)
  assert cli.keep_log_record(record("realm_jax", logging.WARNING, "Variant folder %s has no %s"))
  for lib in cli.CHATTY_LIBRARIES:
    assert not cli.keep_log_record(record(lib, logging.INFO, "Saved %s %s"))
    assert cli.keep_log_record(record(lib, logging.WARNING, "Waiting for %s %s"))

KILLED_BUILD = """
import os, signal, sys
from realm_jax.data import corpus as c
generate = c.RealmBlocks._generate_examples
def killed_midway(self):
  for i, example in enumerate(generate(self)):
    if i == 1:
      os.kill(os.getpid(), signal.SIGKILL)
    yield example
c.RealmBlocks._generate_examples = killed_midway
config = c.CorpusConfig(source="jsonl", paths=(sys.argv[1],), vocab_file=sys.argv[2])
c.Corpus.build(sys.argv[3], config)
"""


def test_building_leaves_nothing_in_the_temporary_directory(tmp_path, vocab_file, monkeypatch):
  """TFDS looks a builder's dataset up in its public bucket through a temporary directory that it
  makes and never removes; realm_jax's own datasets skip that lookup."""
  import tempfile

  from realm_jax.data.qa import WebQuestions
  temp = tmp_path / "temp"
  temp.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(temp))
  path = write_jsonl(tmp_path / "docs.jsonl", [{"title": "Paris", "text": "Paris is big."}])
  config = CorpusConfig(source="jsonl", paths=(path,), vocab_file=vocab_file, block_length=288)
  assert len(Corpus.build(str(tmp_path / "data"), config)) == 1
  (tmp_path / "webq").mkdir()
  (tmp_path / "webq" / "webquestions.examples.test.json").write_text(json.dumps([
      {"url": "", "targetValue": "(list (description Paris))", "utterance": "where?"}]))
  builder = WebQuestions(local_dir=str(tmp_path / "webq"), data_dir=str(tmp_path / "qa"))
  builder.download_and_prepare()
  assert builder.info.splits["test"].num_examples == 1
  assert sorted(os.listdir(temp)) == []


def test_a_killed_build_leaves_nothing_behind_the_next_one(tmp_path, vocab_file, caplog):
  """SIGKILLed mid-build, TFDS leaves its incomplete.* folder; the next build deletes it, saying
  so, and builds the whole corpus."""
  import subprocess
  import sys
  from realm_jax.data.corpus import RealmBlocks
  docs = [{"title": "Paris", "text": "Paris is the capital of France."},
          {"title": "Berlin", "text": "Berlin is the capital of Germany."},
          {"title": "Lyon", "text": "Lyon is the second city of France."}]
  path = write_jsonl(tmp_path / "docs.jsonl", docs)
  data = tmp_path / "data"
  proc = subprocess.run([sys.executable, "-c", KILLED_BUILD, path, vocab_file, str(data)],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == -9, proc.stderr[-3000:]
  config = CorpusConfig(source="jsonl", paths=(path,), vocab_file=vocab_file)
  config_dir = os.path.dirname(RealmBlocks(corpus_config=config, data_dir=str(data)).data_dir)
  left = [name for name in os.listdir(config_dir) if name.startswith("incomplete.")]
  assert len(left) == 1, os.listdir(config_dir)
  with caplog.at_level("WARNING"):
    corpus = Corpus.build(str(data), config)
  assert f"Deleting {os.path.join(config_dir, left[0])}, left by a build of the jsonl corpus" in (
      caplog.text)
  assert [corpus[i]["title"] for i in range(len(corpus))] == ["Paris", "Berlin", "Lyon"]
  assert not [name for name in os.listdir(config_dir) if name.startswith("incomplete.")]


def test_a_second_build_of_the_same_corpus_waits_for_the_first(tmp_path, vocab_file, caplog):
  """While another process holds the build lock (here: this test), a build waits, then finds the
  corpus that process built instead of building it again."""
  import threading
  import time
  from realm_jax.data.corpus import RealmBlocks
  from realm_jax.data.prepare import LOCK, exclusive_lock
  path = write_jsonl(tmp_path / "docs.jsonl", [{"title": "Paris", "text": "Paris is a city."}])
  config = CorpusConfig(source="jsonl", paths=(path,), vocab_file=vocab_file)
  data = str(tmp_path / "data")
  builder = RealmBlocks(corpus_config=config, data_dir=data)
  got = {}
  with caplog.at_level("INFO"):
    with exclusive_lock(os.path.join(os.path.dirname(builder.data_dir), LOCK), "a test"):
      waiting = threading.Thread(target=lambda: got.update(corpus=Corpus.build(data, config)))
      waiting.start()
      deadline = time.monotonic() + 120  # (however busy the machine: it waits, then says so)
      while "Waiting for another process building the jsonl corpus" not in caplog.text:
        assert waiting.is_alive() and time.monotonic() < deadline
        time.sleep(0.05)
      assert waiting.is_alive()
      builder.download_and_prepare()  # the other process's build
      built = {f: os.stat(os.path.join(builder.data_dir, f)).st_mtime_ns
               for f in os.listdir(builder.data_dir)}
    waiting.join(timeout=120)
  assert not waiting.is_alive() and len(got["corpus"]) == 1
  assert all(os.stat(os.path.join(builder.data_dir, f)).st_mtime_ns == t
             for f, t in built.items())  # found, not built again


def test_index_layout_of_a_title_longer_than_the_document_is_the_training_steps(tmp_path,
                                                                                  vocab_file):
  """A title of 9 word pieces in 8-piece documents: cut to 5, as CandidateBuilder (the layout the
  pre-training step re-embeds) cuts it, instead of an error."""
  from realm_jax.text import BertTokenizer
  from realm_jax.train.candidates import CandidateBuilder
  title = "paris is the capital of france it has a"
  path = write_jsonl(tmp_path / "docs.jsonl", [{"title": title, "text": "Lyon is second."},
                                               {"title": "Berlin", "text": "Berlin is big."}])
  corpus = Corpus.build(str(tmp_path / "data"), CorpusConfig(source="jsonl", paths=(path,),
                                                             vocab_file=vocab_file))
  tok = BertTokenizer(vocab_file)
  got = corpus.model_inputs([0, 1], 8, tok)
  assert list(got["input_ids"][0]) == [tok.cls_id, *tok.encode(title)[:5], tok.sep_id, tok.sep_id]
  builder = CandidateBuilder(corpus, tok.cls_id, tok.sep_id, 2, 8, 16)
  for row in (0, 1):
    ids, segments = builder._doc(*builder._block(row))
    n = len(ids)
    assert list(got["input_ids"][row][:n]) == ids and list(got["token_type_ids"][row][:n]) == (
        segments) and got["attention_mask"][row].sum() == n


def test_folder_of_jsonl_files_is_read_in_sorted_order(tmp_path):
  os.makedirs(tmp_path / "docs" / "sub")
  write_jsonl(tmp_path / "docs" / "b.jsonl", [{"title": "B", "text": "b"}])
  write_jsonl(tmp_path / "docs" / "sub" / "c.jsonl", [{"title": "C", "text": "c"}])
  write_jsonl(tmp_path / "docs" / "a.jsonl", [{"title": "A", "text": "a"}])
  assert [d["title"] for d in documents("jsonl", [str(tmp_path / "docs")])] == ["A", "B", "C"]


def test_folder_reads_jsonl_in_any_case_and_warns_of_other_files(tmp_path, caplog):
  docs = tmp_path / "docs"
  os.makedirs(docs)
  write_jsonl(docs / "a.jsonl", [{"title": "A", "text": "a"}])
  write_jsonl(docs / "C.JSONL", [{"title": "C", "text": "c"}])
  write_jsonl(docs / "d.json", [{"title": "D", "text": "d"}])
  (docs / "b.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00")
  with caplog.at_level("WARNING"):
    got = [(d["title"], d["where"]) for d in documents("jsonl", [str(docs)])]
  assert got == [("C", f"{docs}/C.JSONL:1"), ("A", f"{docs}/a.jsonl:1")]  # sorted by name
  assert (f"Corpus folder {docs}: skipped 2 file(s) not named *.jsonl: b.jsonl.gz, d.json "
          "(compressed files are not read: decompress them first)") in caplog.text
  for path in (docs / "b.jsonl.gz", docs / "*.gz"):
    with pytest.raises(ValueError, match=r"b.jsonl.gz is compressed; compressed files are not "
                                         r"read. Decompress it first"):
      list(documents("jsonl", [str(path)]))


def test_unprepared_tfds_wikipedia_is_an_error_not_a_download(tmp_path, monkeypatch):
  import tensorflow_datasets as tfds

  def download(*args, **kwargs):
    raise AssertionError("the Wikipedia dump download was started")

  monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", download)
  monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
  with pytest.raises(FileNotFoundError, match=(
      r"wikipedia/20230601.en is not prepared in .*tfds/wikipedia/20230601.en.*"
      r"`tfds build wikipedia/20230601.en`, with `--data_dir=DIR` and TFDS_DATA_DIR=DIR")):
    next(documents("tfds_wikipedia"))


def test_corpus_paths_need_source_jsonl(vocab_file):
  with pytest.raises(ValueError, match=(
      r"The corpus paths \(a.jsonl, b\) are read only with --config.corpus.source=jsonl, but the "
      r"source is 'wiki_vital': set --config.corpus.source=jsonl .* drop --config.corpus.paths")):
    CorpusConfig(paths=("a.jsonl", "b"), vocab_file=vocab_file)
  with pytest.raises(ValueError, match=r"--config.corpus.block_length=10 leaves fewer than 8"):
    CorpusConfig(vocab_file=vocab_file, block_length=10)


def test_cased_checkpoint_gets_its_own_cased_corpus(tmp_path, vocab_file):
  cased = tmp_path / "cased"
  os.makedirs(cased)
  (cased / "vocab.txt").write_text("\n".join(WORDS + ["Paris"]) + "\n")
  (cased / "tokenizer_config.json").write_text('{"do_lower_case": false}')
  uncased = tmp_path / "uncased"
  os.makedirs(uncased)
  (uncased / "vocab.txt").write_text("\n".join(WORDS + ["Paris"]) + "\n")
  path = write_jsonl(tmp_path / "docs.jsonl", [{"title": "Paris", "text": "Paris is big."}])
  built = {}
  for name, d in (("cased", cased), ("uncased", uncased)):
    config = CorpusConfig(source="jsonl", paths=(path,), vocab_file=str(d / "vocab.txt"))
    built[name] = Corpus.build(str(tmp_path / "data"), config)
  assert built["cased"].fingerprint != built["uncased"].fingerprint
  # An explicit do_lower_case: true is the same corpus as no tokenizer_config.json at all.
  (uncased / "tokenizer_config.json").write_text('{"do_lower_case": true}')
  assert CorpusConfig(source="jsonl", paths=(path,), vocab_file=str(uncased / "vocab.txt")
                      ).fingerprint == built["uncased"].fingerprint
  assert built["cased"].data_dir != built["uncased"].data_dir
  # "Paris" is id 24 in the cased vocab; lowercased it is "paris", id 6.
  assert list(built["cased"][0]["title_token_ids"]) == [24]
  assert list(built["cased"][0]["token_ids"]) == [24, 7, 20, 5]
  assert list(built["uncased"][0]["token_ids"]) == [6, 7, 20, 5]


def test_bad_corpus_files_name_file_and_line(tmp_path, vocab_file):
  bad = tmp_path / "bad.jsonl"
  bad.write_bytes(b'{"title": "ok", "text": "fine"}\n{"title": "x", "text": "caf\xe9"}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid UTF-8"):
    list(read_jsonl(str(bad)))
  (tmp_path / "notext.jsonl").write_text('{"title": "a", "text": "b"}\n\n{"title": "no text"}\n')
  with pytest.raises(ValueError, match=r'notext.jsonl:3: each line must be an object with a "text"'):
    list(read_jsonl(str(tmp_path / "notext.jsonl")))
  # Valid JSON, but a half of a UTF-16 surrogate pair is no text (the tokenizer refuses it).
  (tmp_path / "surr.jsonl").write_text(
      '{"text": "ok"}\n{"title": "x", "text": "Broken \\ud800 x"}\n')
  with pytest.raises(ValueError, match=r'surr.jsonl:2: "text" holds a lone UTF-16 surrogate '
                                       r"'\\ud800' at character 7"):
    list(read_jsonl(str(tmp_path / "surr.jsonl")))
  # A byte-order mark at the start is read as UTF-8 (its line 1 intact); a gzip file, named .jsonl
  # or not, is refused.
  (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"title": "t", "text": "a"}\n')
  assert [d["text"] for d in read_jsonl(str(tmp_path / "bom.jsonl"))] == ["a"]
  import gzip
  (tmp_path / "packed.jsonl").write_bytes(gzip.compress(b'{"text": "a"}\n'))
  with pytest.raises(ValueError, match=r"packed.jsonl is gzip-compressed; decompress it first"):
    list(read_jsonl(str(tmp_path / "packed.jsonl")))
  (tmp_path / "broken.jsonl").write_text('{"text": "a"\n')
  with pytest.raises(ValueError, match=r"broken.jsonl:1:13: not valid JSON \(Expecting ',' "):
    list(read_jsonl(str(tmp_path / "broken.jsonl")))
  with pytest.raises(FileNotFoundError, match="Corpus file .*missing.jsonl does not exist"):
    list(documents("jsonl", [str(tmp_path / "missing.jsonl")]))
  os.makedirs(tmp_path / "empty_dir")
  with pytest.raises(FileNotFoundError, match="holds no \\*.jsonl file"):
    list(documents("jsonl", [str(tmp_path / "empty_dir")]))
  if os.geteuid() != 0:  # root reads anything
    locked = tmp_path / "locked.jsonl"
    locked.write_text('{"text": "a"}\n')
    locked.chmod(0)
    with pytest.raises(OSError, match="Cannot read corpus file .*locked.jsonl"):
      list(read_jsonl(str(locked)))
  (tmp_path / "blank.jsonl").write_text("\n\n")
  with pytest.raises(ValueError, match="holds no text: nothing to index"):
    Corpus.build(str(tmp_path / "data2"), CorpusConfig(
        source="jsonl", paths=(str(tmp_path / "blank.jsonl"),), vocab_file=vocab_file))
  with pytest.raises(ValueError, match="corpus source='web'"):
    CorpusConfig(source="web", vocab_file=vocab_file)


def test_no_text_is_lost_when_the_splitter_fails():
  # pysbd returns no sentence at all for this Wikipedia summary.
  text = ("The Symphony No. 3 in E\u266d major, Op. 55, titled as the Eroica Symphony, is a symphony "
          "in four movements by Ludwig van Beethoven. It was first performed in 1805.")
  assert split_sentences(text) == [
      "The Symphony No. 3 in E\u266d major, Op. 55, titled as the Eroica Symphony, is a symphony in "
      "four movements by Ludwig van Beethoven.", "It was first performed in 1805."]


class _CountingSegmenter:
  """pysbd's segmenter `pysbd` that records the length of each text it is given."""

  def __init__(self, pysbd, lengths: list[int]):
    self._pysbd, self._lengths = pysbd, lengths

  def segment(self, text):
    self._lengths.append(len(text))
    return self._pysbd.segment(text)

  def processor(self, text):
    self._lengths.append(len(text))
    return self._pysbd.processor(text)


@pytest.mark.slow
def test_a_long_document_is_split_in_linear_work_and_keeps_its_text(tok, articles, monkeypatch,
                                                                    caplog):
  """pysbd's time grows with the square of a line's length: one 5 MB document stalled a corpus
  build for hours, without a word. The work is counted, not timed: pysbd is never given more than
  a piece of `_PIECE_CHARS` characters, and each character once (work that grows with the
  document's length, not its square). Real summaries, once with line breaks between them and once
  without (the worst case), past the length that is logged."""
  texts = [a["text"] for a in articles[:1000]]
  text = ""
  while len(text) <= blocks._LOG_CHARS:
    text += "\n".join(texts) + "\n" + " ".join(texts) + " "
  lengths, pysbd = [], blocks._segmenter()
  monkeypatch.setattr(blocks, "_segmenter", lambda: _CountingSegmenter(pysbd, lengths))
  with caplog.at_level(logging.INFO):
    bodies = [b["body"] for b in pack_blocks("Big", text, tok, where="big.jsonl:1")]
  assert "big.jsonl:1: splitting the document 'Big' of 1." in caplog.text  # a word of progress
  assert max(lengths) <= blocks._PIECE_CHARS and sum(lengths) == len(text)
  assert "".join("".join(bodies).split()) == "".join(text.split())


@pytest.mark.slow
def test_documents_up_to_the_limit_keep_their_sentences_and_blocks(tok, articles, monkeypatch):
  """Block ids are SHA-1s of their text, and corpora and indexes are named after them: a document
  of up to 50,000 characters is still split by one pysbd call over all of it, as it always was."""
  import pysbd
  segmenter = pysbd.Segmenter(language="en", clean=False, char_span=True)
  texts = [a["text"] for a in articles[::50]]
  long = ""  # real text just under the limit (blocks._WHOLE_TEXT_CHARS), without a line break
  for a in articles:
    if len(long) + len(a["text"]) + 1 > 50_000:
      break
    long += a["text"].replace("\n", " ") + " "
  texts.append(long)
  whole = {t: [s.sent.strip() for s in segmenter.segment(t) if s.sent.strip()] for t in texts}
  # (Where pysbd loses some of a text, both take a plain punctuation split instead.)
  texts = [t for t in texts if "".join("".join(whole[t]).split()) == "".join(t.split())]
  assert len(texts) > 150 and len(texts[-1]) > 45_000

  def made(text):
    return [(b["block_id"], list(b["sentence_starts"])) for b in pack_blocks("T", text, tok)]

  got = [made(t) for t in texts]
  monkeypatch.setattr(blocks, "split_sentences", whole.__getitem__)
  assert got == [made(t) for t in texts]


def test_a_long_text_is_split_in_pieces_that_keep_all_of_it(articles):
  """Above 50,000 characters a text goes to pysbd in pieces of at most 2,000, cut at a line break,
  a sentence end or a space, and a run without one (a long URL, text without spaces) at 2,000."""
  prose = " ".join(a["text"] for a in articles[:100])
  text = (prose + "\r\n" + "x" * 4_500 + " " + " ".join(["word"] * 700) + ".\n\n") * 2
  assert len(text) > 50_000
  sentences = split_sentences(text)
  assert "".join("".join(sentences).split()) == "".join(text.split())
  assert max(len(s) for s in sentences) <= 2_000
  # The summaries' own sentences come out whole: no piece was cut inside one.
  assert {s for a in articles[:100] for s in split_sentences(a["text"])} <= set(sentences)
