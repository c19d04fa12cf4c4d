"""Reader inputs and fine-tuning batches: layout, gold spans (text and regex) located by hand, has-
answer masks equal to the recall definition, retriever-only batches, and answer text cut from the
block's own characters."""

import numpy as np
import pytest

from realm_jax.checkpoints.minilm import load_minilm
from realm_jax.data.qa_batches import (MAX_QUESTION_CHARS, QaBatcher, answer_pieces,
                                       char_spans_to_pieces, doubling_bucket)
from realm_jax.eval.open_qa import is_correct
from realm_jax.text import BertTokenizer
from realm_jax.text.answers import find_subsequences, has_answer, regex_exact_match

BLOCKS = [
    ("Charles Darwin", "Charles Robert Darwin was an English naturalist. He wrote On the Origin of "
     "Species in 1859."),
    ("Mount Everest", "Mount Everest is Earth's highest mountain above sea level, at 8,849 m."),
    ("", "Café au lait is coffee with hot milk; it is popular in France."),
]


class FakeCorpus:
  """Blocks by row, tokenised with the real vocabulary (the fields a built corpus has)."""

  def __init__(self, tok, blocks=BLOCKS):
    self.rows = []
    for title, body in blocks:
      self.rows.append({"title": title, "body": body, "title_token_ids": tok.encode(title) if title
                        else [], "token_ids": tok.encode(body)})
    self.block_ids = np.arange(100, 100 + len(blocks), dtype=np.int64)

  def __len__(self):
    return len(self.rows)

  def __getitem__(self, row):
    return self.rows[int(row)]

  def rows_of(self, ids):
    ids = np.asarray(ids)
    return np.where((ids >= 100) & (ids < 100 + len(self.rows)), ids - 100, -1)


@pytest.fixture(scope="module")
def tok():
  return BertTokenizer(load_minilm()[2])


@pytest.fixture(scope="module")
def batcher(tok):
  return QaBatcher(FakeCorpus(tok), tok, question_length=16, reader_length=64,
                   max_answer_spans=4, max_span_width=6, length_multiple=16)


def test_find_subsequences_and_char_spans_by_hand():
  assert find_subsequences([5, 1, 2, 3, 1, 2], [[1, 2], [3], [9]]) == [(1, 2), (3, 3), (4, 5)]
  assert find_subsequences([1], [[1, 2]]) == []
  offsets = [(0, 3), (4, 7), (7, 9), (10, 12)]        # "abc def|gh ij"
  assert char_spans_to_pieces(offsets, [(4, 9)]) == [(1, 2)]
  assert char_spans_to_pieces(offsets, [(5, 8)]) == [(1, 2)]  # partial pieces are covered
  assert char_spans_to_pieces(offsets, [(10, 12), (3, 4)]) == [(3, 3)]  # a gap matches nothing


def test_reader_layout_and_block_mask(batcher, tok):
  q = batcher.question_ids("who wrote on the origin of species")
  one, lay = batcher.reader_row(q, 0, 64)
  ids = one["input_ids"]
  n = int(one["attention_mask"].sum())
  title, body = BLOCKS[0]
  want = [tok.cls_id, *q, tok.sep_id, *tok.encode(title), tok.sep_id, *tok.encode(body), tok.sep_id]
  assert list(ids[:n]) == want and (ids[n:] == 0).all()
  short = QaBatcher(batcher.corpus, tok, question_length=16, reader_length=24)
  cut, cut_lay = short.reader_row(q, 0, 24)
  assert list(cut["input_ids"]) == want[:23] + [tok.sep_id]  # the body is cut to fit 24
  assert cut_lay.n_body == 24 - 1 - cut_lay.body_start
  assert list(ids[lay.title_start:lay.title_start + lay.n_title]) == tok.encode(title)
  assert one["block_mask"].sum() == lay.n_title + lay.n_body
  assert one["block_mask"][lay.title_start + lay.n_title] == 0  # the [SEP] between title and body
  assert (one["token_type_ids"][:len(q) + 2] == 0).all() and (one["token_type_ids"][len(q) + 2:n]
                                                               == 1).all()
  # A block without a title: [CLS] q [SEP] body [SEP]
  one, lay = batcher.reader_row(q, 2, 64)
  assert lay.n_title == 0 and lay.body_start == len(q) + 2


def test_a_long_title_is_cut_to_fit_the_reader_input(tok):
  """A title longer than the reader input is cut to fit (it was written past the input's end: a
  crash), leaving no body; a title that fits is kept whole, as before."""
  title = "The Very Long Title Of A Block " * 8
  body = "Charles Darwin wrote On the Origin of Species in 1859."
  long = QaBatcher(FakeCorpus(tok, [(title, body), ("Darwin", body)]), tok, question_length=16,
                   reader_length=48, max_span_width=6, length_multiple=16)
  q = long.question_ids("who wrote on the origin of species")
  assert len(tok.encode(title)) > 48
  inputs, lays = long.reader_inputs([q, q], np.array([[0], [1]]))
  lay, ids = lays[0][0], inputs["input_ids"][0, 0]
  assert ids.shape == (48,) and inputs["attention_mask"][0, 0].sum() == 48
  # [CLS] q [SEP] title [SEP] [SEP]
  assert lay.n_title == 48 - (1 + len(q) + 1) - 2 and lay.n_body == 0
  assert list(ids) == [tok.cls_id, *q, tok.sep_id, *tok.encode(title)[:lay.n_title], tok.sep_id,
                       tok.sep_id]
  assert inputs["block_mask"][0, 0].sum() == lay.n_title
  spans = long.gold_spans(0, lay, ["Very Long Title"], "text")
  assert spans and all(lay.title_start <= s and e < lay.title_start + lay.n_title
                       for s, e in spans)
  assert long.gold_spans(0, lay, ["Charles Darwin"], "text") == []  # the body is not read
  # The short title beside it: whole, and the whole body.
  lay, ids = lays[1][0], inputs["input_ids"][1, 0]
  assert lay.n_title == 1 and lay.n_body == len(tok.encode(body))
  spans = long.gold_spans(1, lay, ["Charles Darwin"], "text")
  assert [tok.decode(ids[s:e + 1]) for s, e in spans] == ["charles darwin"]


def test_reader_without_titles_reads_and_searches_the_body_only(batcher, tok):
  """reader_title=False (the paper config: ORQA/REALM's `[CLS] q [SEP] block [SEP]`, 320 pieces):
  the title is not read, no gold span or has-answer comes from it; the body's still do."""
  from realm_jax.configs.finetune import get_config
  paper = get_config("paper")
  assert paper.reader_length == 320 and not paper.reader_title
  bare = QaBatcher(batcher.corpus, tok, question_length=16, reader_length=64, max_answer_spans=4,
                   max_span_width=6, length_multiple=16, reader_title=False)
  q = bare.question_ids("who wrote on the origin of species")
  one, lay = bare.reader_row(q, 0, 64)
  n = int(one["attention_mask"].sum())
  assert list(one["input_ids"][:n]) == [tok.cls_id, *q, tok.sep_id, *tok.encode(BLOCKS[0][1]),
                                        tok.sep_id]
  assert lay.n_title == 0 and lay.body_start == len(q) + 2
  assert one["block_mask"].sum() == lay.n_body == len(tok.encode(BLOCKS[0][1]))
  # "Charles Darwin" is the title (the body says "Charles Robert Darwin"): found with titles only.
  _, titled = batcher.reader_row(q, 0, 64)
  assert batcher.gold_spans(0, titled, ["Charles Darwin"], "text") != []
  assert bare.gold_spans(0, lay, ["Charles Darwin"], "text") == []
  assert batcher.has_answer(0, ["Charles Darwin"], "text")
  assert not bare.has_answer(0, ["Charles Darwin"], "text")
  assert not bare.has_answer(0, [r"Charles\s+Darwin"], "regex")
  assert bare.has_answer(0, ["origin of species"], "text")
  spans = bare.gold_spans(0, lay, ["1859"], "text")
  assert [tok.decode(one["input_ids"][s:e + 1]) for s, e in spans] == ["1859"]


def test_gold_spans_text_and_regex(batcher, tok):
  q = batcher.question_ids("who wrote on the origin of species")
  one, lay = batcher.reader_row(q, 0, 64)
  # "Charles Darwin" occurs in the title; "The Origin of Species" (normalised: no article) in the
  # body, as written with "On the Origin..." around it.
  spans = batcher.gold_spans(0, lay, ["Charles Darwin"], "text")
  got = [tok.decode(one["input_ids"][s:e + 1]) for s, e in spans]
  assert got == ["charles darwin"]
  assert spans[0][0] == lay.title_start
  spans = batcher.gold_spans(0, lay, ["The Origin of Species"], "text")
  # Both spans normalise to the answer: with and without the article.
  assert [tok.decode(one["input_ids"][s:e + 1]) for s, e in spans] == [
      "the origin of species", "origin of species"]
  # A regex answer: 18[0-9]{2} matches "1859" in the body.
  spans = batcher.gold_spans(0, lay, [r"18[0-9]{2}"], "regex")
  assert [tok.decode(one["input_ids"][s:e + 1]) for s, e in spans] == ["1859"]
  # Wider than max_span_width (6): dropped.
  assert batcher.gold_spans(0, lay, ["Charles Robert Darwin was an English naturalist"],
                            "text") == []


def test_regex_gold_spans_end_inside_the_cut_body(batcher, tok):
  """A body cut after "robert": a match running past the kept pieces is no gold span (as for a
  text answer), one ending inside them is."""
  cut = QaBatcher(batcher.corpus, tok, question_length=4, reader_length=9, max_span_width=6)
  q = cut.question_ids("who")
  one, lay = cut.reader_row(q, 0, 9)
  body = one["input_ids"][lay.body_start:lay.body_start + lay.n_body]
  assert tok.decode(body) == "charles robert"
  assert cut.gold_spans(0, lay, ["Robert Darwin was"], "text") == []
  assert cut.gold_spans(0, lay, ["Robert Darwin was"], "regex") == []
  assert cut.gold_spans(0, lay, [r"Robert\s+Darwin"], "regex") == []
  # Ending inside the kept pieces, or on the space after the last one: gold.
  for answer, want in (("Charles Robert", "charles robert"), (r"Robert\s", "robert")):
    spans = cut.gold_spans(0, lay, [answer], "regex")
    assert [tok.decode(one["input_ids"][s:e + 1]) for s, e in spans] == [want], answer


def test_an_answer_past_the_cut_is_in_the_block_but_not_readable(batcher, tok):
  """answer_readable: a gold span in what the reader input keeps. The body cut after "charles
  robert" (as above): "Robert" is readable, "1859" is in the block (recall counts it) but past the
  cut, an answer wider than max_span_width is not selectable, a block without it adds nothing."""
  cut = QaBatcher(batcher.corpus, tok, question_length=4, reader_length=9, max_span_width=6)
  ask = lambda answers, kind="text": {"question": "who", "answers": answers, "answer_type": kind}
  assert cut.answer_readable(ask(["Robert"]), [1, 0]) and cut.any_answer_in(ask(["Robert"]), [0])
  assert cut.any_answer_in(ask(["1859"]), [0]) and not cut.answer_readable(ask(["1859"]), [0, -1])
  assert not cut.answer_readable(ask([r"18[0-9]{2}"], "regex"), [0])
  assert not cut.answer_readable(ask(["Robert"]), [1, 2, -1])
  # The whole block fits the fixture's 64 pieces: "1859" is readable there, the long answer not.
  assert batcher.answer_readable(ask(["1859"]), [2, 0])
  assert batcher.any_answer_in(ask(["Charles Robert Darwin was an English naturalist"]), [0])
  assert not batcher.answer_readable(ask(["Charles Robert Darwin was an English naturalist"]), [0])


def test_train_batch_has_answer_matches_recall_definition(batcher, tok):
  qs = [{"question": "highest mountain", "answers": ["Mount Everest"], "answer_type": "text"},
        {"question": "coffee with milk", "answers": ["cafe au lait"], "answer_type": "text"},
        {"question": "when was origin published", "answers": ["18[0-9]{2}"],
         "answer_type": "regex"}]
  beams = np.array([[1, 0, 2], [2, -1, 0], [0, 1, -1]])
  emb = np.arange(3 * 4, dtype=np.float32).reshape(3, 4)
  batch = batcher.train_batch(qs, beams, emb, reader_blocks=2)
  want_has = np.array([[1, 0, 0], [1, 0, 0], [1, 0, 0]])
  np.testing.assert_array_equal(batch["beam_has_answer"], want_has)
  for i, q in enumerate(qs[:2]):
    for j, r in enumerate(beams[i]):
      if r >= 0:
        text = BLOCKS[r][0] + " " + BLOCKS[r][1]
        assert batch["beam_has_answer"][i, j] == has_answer(text, q["answers"])
  np.testing.assert_array_equal(batch["beam_mask"], beams >= 0)
  np.testing.assert_array_equal(batch["beam_embeddings"][0, 0], emb[1])
  assert (batch["beam_embeddings"][1, 1] == 0).all()
  q_ids = [batcher.question_ids(q["question"]) for q in qs]
  longest = max(batcher.layout(q_ids[i], r).body_start + batcher.layout(q_ids[i], r).n_body + 1
                for i in range(3) for r in beams[i, :2] if r >= 0)
  assert batch["reader"]["input_ids"].shape == (3, 2, -(-longest // 16) * 16)
  # Gold spans decode to the answers; the accent-free "cafe au lait" finds "Café au lait".
  ids = batch["reader"]["input_ids"]
  s, e = batch["gold_starts"][1, 0, 0], batch["gold_ends"][1, 0, 0]
  assert tok.decode(ids[1, 0, s:e + 1]) == "cafe au lait"
  s, e = batch["gold_starts"][2, 0, 0], batch["gold_ends"][2, 0, 0]
  assert tok.decode(ids[2, 0, s:e + 1]) == "1859"
  assert (batch["gold_starts"][:, 1] == -1).all()  # read block 2 of each has no answer
  # Retriever-only batch: the same beams and masks, no reader inputs.
  only = batcher.train_batch(qs, beams, emb, reader_blocks=0)
  assert "reader" not in only
  np.testing.assert_array_equal(only["beam_has_answer"], want_has)


def test_padding_follows_the_longest_block(batcher):
  q = batcher.question_ids("coffee")
  inputs, _ = batcher.reader_inputs([q], np.array([[2]]))
  assert inputs["input_ids"].shape[-1] == 32  # 3 + 1 + ~17 pieces -> a multiple of 16


def test_questions_are_padded_to_a_few_doubling_lengths(tok):
  """Every question length from 1 to 62 word pieces pads to one of 4 lengths (8, 16, 32, 64: one
  compiled program each), the smallest that holds [CLS] q [SEP]; a plain loop gives the want."""
  qb = QaBatcher(FakeCorpus(tok), tok, question_length=64, reader_length=128)
  got = {}
  for n in range(1, 63):
    want = next(b for b in (8, 16, 32, 64) if b >= n + 2)
    arrays = qb._questions([[1000] * n, [1000]])
    assert arrays["input_ids"].shape == (2, want), n
    assert arrays["attention_mask"][0].sum() == n + 2 and arrays["attention_mask"][1].sum() == 3
    got[n] = want
  assert sorted(set(got.values())) == [8, 16, 32, 64]
  got = [doubling_bucket(n, 32, 192) for n in (1, 32, 33, 65, 129, 192)]
  assert got == [32, 32, 64, 128, 192, 192]


def test_question_errors(batcher):
  for bad in ("", "   "):
    with pytest.raises(ValueError, match="empty"):
      batcher.question_ids(bad)
  with pytest.raises(ValueError, match="characters"):
    batcher.question_ids("x" * (MAX_QUESTION_CHARS + 1))


def test_answer_pieces_include_the_normalised_form(tok):
  pieces = answer_pieces(tok, ["The Beatles!"])
  assert tuple(tok.encode("beatles")) in pieces and tuple(tok.encode("The Beatles!")) in pieces


def test_regex_exact_match_and_is_correct():
  assert regex_exact_match("1859", [r"18[0-9]{2}"])
  assert not regex_exact_match("in 1859", [r"18[0-9]{2}"])  # anchored at the start (DrQA)
  assert regex_exact_match("Mount Everest", [r"(mount\s+)?everest"])
  assert is_correct("the Everest", {"answers": ["Everest"]})
  assert not is_correct("Everest base camp", {"answers": ["Everest"]})
  with pytest.raises(ValueError, match="regular expression"):
    regex_exact_match("x", ["("])


def test_spans_start_and_end_on_whole_words(batcher, tok):
  """"Café au lait" is cafe / au / lai / ##t: a span may start at cafe, au or lai, and end at
  cafe, au or ##t, never at lai (##t follows) or at ##t's start."""
  q = batcher.question_ids("coffee")
  inputs, lays = batcher.reader_inputs([q], np.array([[2]]))
  lay = lays[0][0]
  ids = inputs["input_ids"][0, 0]
  pieces = [tok.id_to_token(int(i)) for i in ids[lay.body_start:lay.body_start + 4]]
  assert pieces == ["cafe", "au", "lai", "##t"]
  start = inputs["word_start"][0, 0, lay.body_start:lay.body_start + 4]
  end = inputs["word_end"][0, 0, lay.body_start:lay.body_start + 4]
  np.testing.assert_array_equal(start, [1, 1, 1, 0])
  np.testing.assert_array_equal(end, [1, 1, 0, 1])
  # Outside the block nothing may start or end.
  outside = inputs["block_mask"][0, 0] == 0
  assert not inputs["word_start"][0, 0][outside].any() and not inputs["word_end"][0, 0][outside].any()
