"""Salient-span pre-training examples: taggers, the built files, and the grain pipeline."""

import json
import os

import numpy as np
import pytest

from realm_jax.data import pretrain
from realm_jax.data.pretrain import (build_examples, pretrain_batches, regex_dates, salient_spans,
                                     special_ids)

LQ, M = 32, 4  # query length and max masked pieces of the tiny examples

PEOPLE = [("Ada Lovelace", "London", "England", "10 December 1815"),
          ("Marie Curie", "Warsaw", "Poland", "7 November 1867"),
          ("Alan Turing", "London", "England", "23 June 1912"),
          ("Niels Bohr", "Copenhagen", "Denmark", "7 October 1885"),
          ("Enrico Fermi", "Rome", "Italy", "29 September 1901"),
          ("Emmy Noether", "Erlangen", "Germany", "23 March 1882"),
          ("Srinivasa Ramanujan", "Erode", "India", "22 December 1887"),
          ("Lise Meitner", "Vienna", "Austria", "7 November 1878"),
          ("Max Planck", "Kiel", "Germany", "23 April 1858"),
          ("Grace Hopper", "New York City", "the United States", "9 December 1906"),
          ("Pierre Curie", "Paris", "France", "15 May 1859"),
          ("Dmitri Mendeleev", "Tobolsk", "Russia", "8 February 1834"),
          ("Rosalind Franklin", "London", "England", "25 July 1920"),
          ("Hideki Yukawa", "Tokyo", "Japan", "23 January 1907"),
          ("Subrahmanyan Chandrasekhar", "Lahore", "India", "19 October 1910"),
          ("Chien-Shiung Wu", "Liuhe", "China", "31 May 1912")]


def _docs():
  docs = []
  for i, (person, city, country, date) in enumerate(PEOPLE):
    other = PEOPLE[(i + 3) % len(PEOPLE)]
    docs.append({"title": person, "text": (
        f"{person} was born in {city}, {country} on {date}. "
        f"In {1930 + i}, {person.split()[-1]} moved to {other[1]} to work with {other[0]}. "
        "The family lived near the river for many years, and the garden was large.")})
  docs.append({"title": "Independence", "text": (
      "On 4 July 1776, the Continental Congress adopted the Declaration of Independence in "
      "Philadelphia. It was written mostly by Thomas Jefferson.")})
  return docs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  pytest.importorskip("tensorflow_datasets")
  from realm_jax.checkpoints import minilm_dir
  from realm_jax.data.corpus import Corpus, CorpusConfig
  from realm_jax.text import BertTokenizer
  try:
    vocab = os.path.join(minilm_dir(), "vocab.txt")
  except FileNotFoundError as e:
    pytest.skip(str(e))
  root = tmp_path_factory.mktemp("pretrain")
  (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in _docs()))
  corpus = Corpus.build(str(root / "corpus"), CorpusConfig(
      source="jsonl", paths=(str(root / "docs.jsonl"),), vocab_file=vocab))
  return root, corpus, BertTokenizer(vocab)


def _build(setup, tagger):
  root, corpus, tok = setup
  out = str(root / f"examples_{tagger}")
  manifest = build_examples(corpus, tok, out, query_length=LQ, max_masked=M, tagger=tagger,
                            heldout_percent=25)
  return out, manifest


@pytest.fixture(scope="module")
def regex_examples(setup):
  return _build(setup, "regex")


def _records(out, split):
  from array_record.python.array_record_module import ArrayRecordReader
  reader = ArrayRecordReader(os.path.join(out, f"{split}.array_record"))
  try:
    return [json.loads(r) for r in reader.read_all()]
  finally:
    reader.close()


def _batches(out, tok, n=None, **kw):
  kw = {"split": "train", "batch_size": 4, "seed": 0, "query_length": LQ, "max_masked": M,
        "tokenizer_ids": special_ids(tok), **kw}
  it = pretrain_batches(out, **kw)
  return it if n is None else [next(it) for _ in range(n)]


def _same(a, b):
  return all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def test_regex_dates_are_exact():
  text = "On 4 July 1776 they met; in May 1990 and in the 1990s, since 1850, on 1 January."
  got = [text[s:e] for s, e, _ in regex_dates(text)]
  assert got == ["4 July 1776", "May 1990", "1990s", "1850", "1 January"]
  text = "Born on January 5, 1920 (a Sunday), he left in c. 1950."
  assert [text[s:e] for s, e, _ in regex_dates(text)] == ["January 5, 1920", "1950"]
  text = "Einstein (14 March 1879 – 18 April 1955) lived in the 19th century, not in 44 BC."
  assert [text[s:e] for s, e, _ in regex_dates(text)] == [
      "14 March 1879", "18 April 1955", "19th century", "44 BC"]
  assert regex_dates("There were 1990 people and 2000 cars.") == []


def test_regex_tagger_finds_names_not_sentence_starts():
  text = "In France, the University of Paris hired Thomas Jefferson in 1785."
  spans = salient_spans([text, "Yesterday it rained."], "regex")
  assert [(text[s:e], lab) for s, e, lab in spans[0]] == [
      ("France", "NAME"), ("University of Paris", "NAME"), ("Thomas Jefferson", "NAME"),
      ("1785", "DATE")]
  assert spans[1] == []
  with pytest.raises(ValueError, match="tagger='bert'"):
    salient_spans([text], "bert")


def test_auto_tagger_falls_back_to_regex_without_spacy(monkeypatch, caplog):
  def missing():
    raise ImportError("No module named 'spacy'")
  monkeypatch.setattr(pretrain, "_spacy_nlp", missing)
  assert pretrain.resolve_tagger("auto") == "regex" and "regex tagger" in caplog.text
  with pytest.raises(ImportError, match="pass tagger='regex'"):
    pretrain.resolve_tagger("spacy")


@pytest.mark.parametrize("tagger", ["regex", "spacy"])
def test_examples_mask_exactly_the_entity_word_pieces(setup, tagger):
  if tagger == "spacy":
    pytest.importorskip("spacy")
    try:
      pretrain.resolve_tagger("spacy")
    except ImportError as e:
      pytest.skip(str(e))
  _, corpus, tok = setup
  out, manifest = _build(setup, tagger)
  assert manifest["tagger"] == tagger and manifest["sentences_without_spans"] >= len(PEOPLE)
  records = _records(out, "train") + _records(out, "heldout")
  assert len(records) == sum(manifest["examples"].values()) > 0
  for r in records:
    text = r["text"]
    assert r["token_ids"] == tok.encode(text)[:LQ - 2]
    block = corpus[r["block_row"]]
    assert r["block_id"] == block["block_id"] and text in block["body"]
    found = set(salient_spans([text], tagger)[0])
    for (s, e), (cs, ce), label in zip(r["spans"], r["char_spans"], r["labels"], strict=True):
      assert 1 <= e - s <= M and (cs, ce, label) in found
      assert tok.encode(text[cs:ce]) == r["token_ids"][s:e], (text[cs:ce], label)
  texts = {(r["text"], tuple(map(tuple, r["char_spans"]))) for r in records}
  july = ("On 4 July 1776, the Continental Congress adopted the Declaration of Independence in "
          "Philadelphia.")
  assert any(t == july and (3, 14) in spans for t, spans in texts)


def test_heldout_blocks_are_not_training_blocks(setup, regex_examples):
  out, manifest = regex_examples
  train, heldout = _records(out, "train"), _records(out, "heldout")
  assert train and heldout
  assert not {r["block_id"] for r in train} & {r["block_id"] for r in heldout}
  assert not {r["block_row"] for r in train} & {r["block_row"] for r in heldout}
  assert sum(manifest["blocks"].values()) == len(setup[1])
  assert all(pretrain.is_heldout(r["block_id"], 25) for r in heldout)
  assert not any(pretrain.is_heldout(r["block_id"], 25) for r in train)


def test_batches_mask_one_span(setup, regex_examples):
  out, _ = regex_examples
  tok = setup[2]
  records = _records(out, "train")
  by_query = {tuple([tok.cls_id] + r["token_ids"] + [tok.sep_id]): r for r in records}
  for b in _batches(out, tok, 6):
    assert b["input_ids"].shape == (4, LQ) and b["input_ids"].dtype == np.int32
    assert b["mlm_positions"].shape == (4, M) and b["mlm_weights"].dtype == np.float32
    assert b["block_row"].dtype == np.int64 and not b["token_type_ids"].any()
    for i in range(4):
      k = int(b["mlm_weights"][i].sum())
      pos, tgt = b["mlm_positions"][i, :k], b["mlm_targets"][i, :k]
      assert 1 <= k <= M and (b["mlm_weights"][i, :k] == 1).all()
      assert not b["mlm_positions"][i, k:].any() and not b["mlm_targets"][i, k:].any()
      ids = b["input_ids"][i]
      assert (ids[pos] == tok.mask_id).all() and (ids == tok.mask_id).sum() == k
      original = ids.copy()
      original[pos] = tgt
      n = int(b["attention_mask"][i].sum())
      r = by_query[tuple(original[:n])]
      assert not original[n:].any() and [pos[0] - 1, pos[-1]] in r["spans"]
      assert (b["block_row"][i], b["block_id"][i]) == (r["block_row"], r["block_id"])


def test_iterator_state_resumes_exactly(setup, regex_examples):
  out, tok = regex_examples[0], setup[2]
  it = _batches(out, tok)
  for _ in range(7):  # past the first epoch
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  want = [next(it) for _ in range(5)]
  resumed = _batches(out, tok)
  resumed.set_state(state)
  assert all(_same(a, b) for a, b in zip(want, [next(resumed) for _ in range(5)]))


def test_same_seed_same_batches_other_seed_other_order(setup, regex_examples):
  out, tok = regex_examples[0], setup[2]
  a, b, c = (_batches(out, tok, 8, seed=s) for s in (3, 3, 4))
  assert all(_same(x, y) for x, y in zip(a, b))
  assert not all(_same(x, y) for x, y in zip(a, c))


def test_host_shards_split_each_global_batch(setup, regex_examples):
  """Two hosts with batch 3 each see, side by side, the very batches one host with batch 6 sees
  (same examples, same masked spans), and together cover a whole epoch without overlap."""
  out, tok = regex_examples[0], setup[2]
  one = list(_batches(out, tok, batch_size=6, seed=5, num_epochs=1))
  hosts = [list(_batches(out, tok, batch_size=3, seed=5, shard_index=h, shard_count=2,
                         num_epochs=1)) for h in (0, 1)]
  assert len(one) == len(hosts[0]) == len(hosts[1]) == len(_records(out, "train")) // 6 > 1
  for whole, a, b in zip(one, *hosts):
    for key in whole:
      np.testing.assert_array_equal(whole[key], np.concatenate([a[key], b[key]]), err_msg=key)
  seen = [int(r) for batch in hosts[0] + hosts[1] for r in batch["block_row"]]
  rows = [int(r) for batch in one for r in batch["block_row"]]
  assert sorted(seen) == sorted(rows)
  with pytest.raises(ValueError, match="global batch"):
    _batches(out, tok, batch_size=len(_records(out, "train")), shard_index=0, shard_count=2)


def test_rebuild_reuses_or_refuses(setup, regex_examples):
  root, corpus, tok = setup
  out, manifest = regex_examples
  mtime = os.path.getmtime(os.path.join(out, "manifest.json"))
  assert _build(setup, "regex")[1] == manifest
  assert os.path.getmtime(os.path.join(out, "manifest.json")) == mtime
  with pytest.raises(ValueError, match=r"examples_regex holds pre-training examples built with "
                                       r"other settings .*query_length"):
    build_examples(corpus, tok, out, query_length=64, max_masked=M, tagger="regex",
                   heldout_percent=25)
  (root / "busy").mkdir()
  (root / "busy" / "notes.txt").write_text("mine")
  with pytest.raises(ValueError, match="not empty and has no manifest.json"):
    build_examples(corpus, tok, str(root / "busy"), tagger="regex")


def test_pipeline_errors_are_clear(setup, regex_examples, tmp_path):
  out, tok = regex_examples[0], setup[2]
  with pytest.raises(FileNotFoundError, match="No pre-training examples in .*build_examples"):
    _batches(str(tmp_path), tok)
  with pytest.raises(ValueError, match="split='dev'"):
    _batches(out, tok, split="dev")
  with pytest.raises(ValueError, match="= 100000 examples must be between 1 and the"):
    _batches(out, tok, batch_size=100_000)
  with pytest.raises(ValueError, match="built with query_length=32"):
    _batches(out, tok, query_length=64)


def test_spacy_entities_never_cut_a_regex_date(monkeypatch):
  """A spaCy entity that straddles a regex date's edge ("BC Caesar" across "44 BC") gives way to
  the date; one inside a date goes, one around a date stays (a fake pipeline supplies them)."""
  from types import SimpleNamespace as NS

  def pipe(sentences, batch_size):
    del batch_size
    for sent in sentences:
      ents = [NS(label_=lab, start_char=sent.index(t), end_char=sent.index(t) + len(t))
              for t, lab in (("BC Caesar", "ORG"), ("the 4 July 1990 Cup", "EVENT"), ("AD", "ORG"))
              if t in sent]
      yield NS(ents=ents)

  monkeypatch.setattr(pretrain, "_spacy_nlp", lambda: NS(pipe=pipe))
  texts = ["In 44 BC Caesar died.", "He won the 4 July 1990 Cup in AD 79."]
  got = [[(t[s:e], lab) for s, e, lab in spans]
         for t, spans in zip(texts, salient_spans(texts, "spacy"))]
  assert got == [[("44 BC", "DATE")], [("4 July 1990 Cup", "EVENT"), ("AD 79", "DATE")]]


def _masked(batch, i):
  k = int(batch["mlm_weights"][i].sum())
  return np.sort(batch["mlm_positions"][i, :k]) - 1  # offsets into the sentence (after [CLS])


def test_random_maskings_hide_as_many_pieces_and_find_entities_only_by_chance(setup,
                                                                             regex_examples):
  """config.masking: the same seed draws the same sentences and the same span length for all
  three maskings; random spans are contiguous runs of that length, random tokens that many
  distinct pieces; and random tokens land in a salient span as often as chance (the share of the
  sentence's pieces inside one), salient masking always."""
  out, _ = regex_examples
  tok = setup[2]
  records = _records(out, "train")
  by_block = {}
  for r in records:
    by_block.setdefault(r["block_id"], []).append(r)
  runs = {m: _batches(out, tok, 60, masking=m) for m in pretrain.MASKINGS}
  inside = {m: [0, 0] for m in pretrain.MASKINGS}
  chance = []
  for step in range(60):
    b = {m: runs[m][step] for m in pretrain.MASKINGS}
    np.testing.assert_array_equal(b["random_tokens"]["block_id"], b["salient_spans"]["block_id"])
    for i in range(4):
      n = int(b["salient_spans"]["attention_mask"][i].sum()) - 2
      ids = b["salient_spans"]["input_ids"][i].copy()
      ids[b["salient_spans"]["mlm_positions"][i, :int(b["salient_spans"]["mlm_weights"][i].sum())]] = 0
      sentence = [r for r in by_block[int(b["salient_spans"]["block_id"][i])]
                  if len(r["token_ids"]) == n and all(
                      x == 0 or x == t for x, t in zip(ids[1:n + 1], r["token_ids"]))][0]
      in_span = np.zeros(n, bool)
      for s, e in sentence["spans"]:
        in_span[s:e] = True
      chance.append(in_span.mean())
      salient = _masked(b["salient_spans"], i)
      for m in pretrain.MASKINGS:
        got = _masked(b[m], i)
        assert len(got) == len(salient) and len(set(got.tolist())) == len(got)
        assert 0 <= got.min() and got.max() < n
        inside[m][0] += int(in_span[got].sum())
        inside[m][1] += len(got)
        ids_m = b[m]["input_ids"][i]
        assert (ids_m[got + 1] == tok.mask_id).all() and (ids_m == tok.mask_id).sum() == len(got)
      run = _masked(b["random_spans"], i)
      np.testing.assert_array_equal(run, np.arange(run[0], run[0] + len(run)))
  rate = {m: hit / total for m, (hit, total) in inside.items()}
  assert rate["salient_spans"] == 1.0
  # 480 masked pieces, chance ~0.46: +- 0.1 is about four standard errors.
  assert abs(rate["random_tokens"] - float(np.mean(chance))) < 0.1, (rate, np.mean(chance))
  assert rate["random_tokens"] < 0.8 and rate["random_spans"] < 0.9, rate
  with pytest.raises(ValueError, match="masking"):
    _batches(out, tok, 1, masking="whole_words")
