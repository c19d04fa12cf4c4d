"""WordPiece tokenisation against HF's BertTokenizerFast, and REALM's input layouts by hand."""

import json

import numpy as np
import pytest

from realm_jax.text import BertTokenizer, batch_join, join_bert

TEXTS = ["Hello, world!", "Unaffable Québec naïve café", "The 2018-12-20 Wikipedia dump.",
         "  spaces\tand\nnewlines  ", "東京 is Tokyo", "don't stop-believing"]


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
  words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", ",", "world", "!", "un", "##aff",
           "##able", "the", "wikipedia", "dump", ".", "2018", "-", "12", "20", "spaces", "and",
           "newlines", "is", "tokyo", "don", "'", "t", "stop", "believing", "que", "##bec", "nai",
           "##ve", "cafe", "東", "京"]
  path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
  path.write_text("\n".join(words) + "\n", encoding="utf-8")
  return str(path)


def test_matches_hf_bert_tokenizer(vocab_file):
  transformers = pytest.importorskip("transformers")
  ours = BertTokenizer(vocab_file)
  hf = transformers.BertTokenizerFast(vocab_file, do_lower_case=True)
  for text in TEXTS:
    assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"], text
  assert ours.encode_batch(TEXTS) == [ours.encode(t) for t in TEXTS]
  assert ours.encode("Unaffable") == [9, 10, 11]
  assert ours.decode(ours.encode("hello world")) == "hello world"


def test_join_bert_layout_by_hand():
  out = join_bert([10, 11], [20, 21, 22], max_length=9, cls_id=2, sep_id=3)
  np.testing.assert_array_equal(out["input_ids"], [2, 10, 11, 3, 20, 21, 22, 3, 0])
  np.testing.assert_array_equal(out["token_type_ids"], [0, 0, 0, 0, 1, 1, 1, 1, 0])
  np.testing.assert_array_equal(out["attention_mask"], [1, 1, 1, 1, 1, 1, 1, 1, 0])
  single = join_bert([10, 11], None, max_length=5, cls_id=2, sep_id=3)
  np.testing.assert_array_equal(single["input_ids"], [2, 10, 11, 3, 0])
  assert single["input_ids"].dtype == np.int32


def test_truncation_cuts_the_block_not_the_query():
  out = join_bert([10, 11], list(range(20, 30)), max_length=8, cls_id=2, sep_id=3)
  np.testing.assert_array_equal(out["input_ids"], [2, 10, 11, 3, 20, 21, 22, 3])
  longest = join_bert(list(range(10, 16)), [20, 21], max_length=7, cls_id=2, sep_id=3,
                      truncate="longest")
  np.testing.assert_array_equal(longest["input_ids"], [2, 10, 11, 3, 20, 21, 3])


def test_bad_input_errors(vocab_file, tmp_path):
  tok = BertTokenizer(vocab_file)
  with pytest.raises(ValueError, match="Empty first segment"):
    join_bert(tok.encode("   "), None, 8, tok.cls_id, tok.sep_id)
  with pytest.raises(ValueError, match="Empty first segment"):
    join_bert([], [], 8, tok.cls_id, tok.sep_id)
  # An empty first segment before a second is a block without a title: [CLS] [SEP] b [SEP].
  np.testing.assert_array_equal(join_bert([], [7, 8], 6, 2, 3)["input_ids"], [2, 3, 7, 8, 3, 0])
  with pytest.raises(ValueError, match="First segment of 7 word pieces does not fit max_length=6"):
    join_bert(list(range(7)), [1, 2], 6, 2, 3)
  with pytest.raises(ValueError, match="does not fit max_length=5.*shorten it"):
    join_bert(list(range(7)), None, 5, 2, 3, truncate="none")
  with pytest.raises(ValueError, match="1,000,001 characters"):
    tok.encode("a" * 1_000_001)
  with pytest.raises(ValueError, match="list of texts is empty"):
    batch_join([], 8, tok)
  with pytest.raises(FileNotFoundError, match="Vocab file .*missing.txt does not exist"):
    BertTokenizer(tmp_path / "missing.txt")
  (tmp_path / "words.txt").write_text("a\nb\nc\n")
  with pytest.raises(ValueError, match=r"lacks the BERT special tokens \['\[PAD\]'"):
    BertTokenizer(tmp_path / "words.txt")


def test_casing_follows_the_checkpoints_tokenizer_config(tmp_path):
  words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "paris", "Paris", "cafe", "Café"]
  uncased, cased = tmp_path / "uncased", tmp_path / "cased"
  for d in (uncased, cased):
    d.mkdir()
    (d / "vocab.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
  (cased / "tokenizer_config.json").write_text('{"do_lower_case": false}')
  # No tokenizer_config.json: uncased, as MiniLM and REALM (lowercased, accents stripped).
  assert BertTokenizer(uncased / "vocab.txt").encode("Paris Café") == [5, 7]
  assert not BertTokenizer(cased / "vocab.txt").lowercase
  assert BertTokenizer(cased / "vocab.txt").encode("Paris Café") == [6, 8]
  assert BertTokenizer(cased / "vocab.txt", lowercase=True).encode("Paris Café") == [5, 7]
  (uncased / "tokenizer_config.json").write_text('{"do_lower_case": true, "model_max_length": 512}')
  assert BertTokenizer(uncased / "vocab.txt").lowercase
  (cased / "tokenizer_config.json").write_text('{"do_lower_case": "no"}')
  with pytest.raises(ValueError, match=r"cased/tokenizer_config.json: do_lower_case='no' must be"):
    BertTokenizer(cased / "vocab.txt")


def test_strip_accents_follows_the_checkpoint_as_in_hugging_face(tmp_path):
  """`strip_accents` of tokenizer_config.json, against transformers' BertTokenizer given the same
  settings: null follows lowercasing; false keeps accents of lowercased text; true strips them of
  cased text."""
  transformers = pytest.importorskip("transformers")
  words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "paris", "Paris", "cafe", "café", "Cafe",
           "Café", "é", "e", "##e", "##é", "."]
  (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
  text = "Paris Café. Éte PARIS café"
  for lower, strip in [(True, None), (True, False), (False, None), (False, True), (True, True)]:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"do_lower_case": lower, "strip_accents": strip}))
    hf = transformers.BertTokenizer(str(tmp_path / "vocab.txt"), do_lower_case=lower,
                                    strip_accents=strip)
    ours = BertTokenizer(tmp_path / "vocab.txt")
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False), (lower, strip)
    assert ours.strip_accents is (lower if strip is None else strip)
  assert BertTokenizer(tmp_path / "vocab.txt", lowercase=True).strip_accents  # as BERT uncased
  (tmp_path / "tokenizer_config.json").write_text('{"strip_accents": "yes"}')
  with pytest.raises(ValueError, match=r"tokenizer_config.json: strip_accents='yes' must be true, "
                                       "false or null"):
    BertTokenizer(tmp_path / "vocab.txt")


def test_lone_surrogate_is_a_clear_error(vocab_file):
  tok = BertTokenizer(vocab_file)
  with pytest.raises(ValueError, match=r"text #1 holds a lone UTF-16 surrogate '\\ud800' at "
                                       "character 7"):
    tok.encode_batch(["hello", "Broken \ud800 x"])
