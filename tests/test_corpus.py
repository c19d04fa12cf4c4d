"""Corpus blocks: sentence packing by hand, the TFDS builder, random access, bad input files."""

import json
import os

import numpy as np
import pytest

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
  with pytest.raises(ValueError, match="leaves fewer than 8 for text"):
    list(pack_blocks("paris is the capital of france it has", "Lyon.", tok, block_length=12))


def test_block_id_is_stable_and_positive():
  a = block_id("Paris", "Paris is big.")
  assert a == block_id("Paris", "Paris is big.") and 0 < a < 2**63
  assert a != block_id("Paris ", "Paris is big.") and a != block_id("Paris", "Paris is big!")


def corpus_block(corpus, row):
  ex = corpus[row]
  return list(ex["title_token_ids"]), list(ex["token_ids"])


def test_corpus_builds_and_gives_random_access(tmp_path, vocab_file):
  docs = [{"title": "Paris", "text": "Paris is the capital of France. It has a river."},
          {"title": "Berlin", "text": "Berlin is the capital of Germany."},
          {"title": "Paris", "text": "Paris is the capital of France. It has a river."},  # duplicate
          {"text": "Lyon is the second city of France."},
          {"title": "", "text": "\ufeff\u200b"}]  # no word pieces: no block
  path = write_jsonl(tmp_path / "docs.jsonl", docs)
  config = CorpusConfig(source="jsonl", paths=(path,), vocab_file=vocab_file, block_length=288)
  corpus = Corpus.build(str(tmp_path / "data"), config)
  assert len(corpus) == 3  # the duplicate block is skipped
  assert [corpus[i]["title"] for i in range(3)] == ["Paris", "Berlin", ""]
  b = corpus.get(corpus.block_ids[1])
  assert b["body"] == "Berlin is the capital of Germany." and b["title"] == "Berlin"
  assert list(corpus.rows_of([corpus.block_ids[2], 12345])) == [2, -1]
  with pytest.raises(KeyError, match="Block id 12345 is not in the corpus"):
    corpus.get(12345)
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


def test_folder_of_jsonl_files_is_read_in_sorted_order(tmp_path):
  os.makedirs(tmp_path / "docs" / "sub")
  write_jsonl(tmp_path / "docs" / "b.jsonl", [{"title": "B", "text": "b"}])
  write_jsonl(tmp_path / "docs" / "sub" / "c.jsonl", [{"title": "C", "text": "c"}])
  write_jsonl(tmp_path / "docs" / "a.jsonl", [{"title": "A", "text": "a"}])
  assert [d["title"] for d in documents("jsonl", [str(tmp_path / "docs")])] == ["A", "B", "C"]


def test_bad_corpus_files_name_file_and_line(tmp_path, vocab_file):
  bad = tmp_path / "bad.jsonl"
  bad.write_bytes(b'{"title": "ok", "text": "fine"}\n{"title": "x", "text": "caf\xe9"}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid UTF-8"):
    list(read_jsonl(str(bad)))
  (tmp_path / "notext.jsonl").write_text('{"title": "a", "text": "b"}\n\n{"title": "no text"}\n')
  with pytest.raises(ValueError, match=r'notext.jsonl:3: each line must be an object with a "text"'):
    list(read_jsonl(str(tmp_path / "notext.jsonl")))
  (tmp_path / "broken.jsonl").write_text('{"text": "a"\n')
  with pytest.raises(ValueError, match=r"broken.jsonl:1: not valid JSON"):
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
