"""The host layout of a pre-training batch: null document first, joint inputs, and `span_found`
(the masked span's word pieces are in a retrieved body the encoder sees), checked by hand."""

import numpy as np

from realm_jax.train.candidates import CandidateBuilder

CLS, SEP, MASK = 101, 102, 103


class _Corpus:
  def __init__(self, blocks):
    self.blocks = blocks

  def __getitem__(self, row):
    title, body = self.blocks[row]
    return {"title_token_ids": title, "token_ids": body}


def _queries():
  # Example 0 masks the span [7, 8] at positions 2-3; example 1 masks [9] at position 1.
  ids = np.array([[CLS, 5, MASK, MASK, SEP, 0], [CLS, MASK, 6, SEP, 0, 0]], np.int32)
  return {"input_ids": ids, "attention_mask": (ids > 0).astype(np.int32),
          "token_type_ids": np.zeros_like(ids),
          "mlm_positions": np.array([[3, 2], [1, 0]], np.int32),   # out of order on purpose
          "mlm_targets": np.array([[8, 7], [9, 0]], np.int32),
          "mlm_weights": np.array([[1, 1], [1, 0]], np.float32)}


def test_layout_and_span_found_by_hand():
  corpus = _Corpus({0: ([50], [7, 1, 8]),          # both pieces, not contiguous
                    1: ([51], [2, 7, 8, 3]),       # the span, in order
                    2: ([52], [1, 2, 3, 4, 9])})   # 9 only after the joint input's cut
  builder = CandidateBuilder(corpus, CLS, SEP, num_candidates=3, doc_length=8, joint_length=9)
  rows = np.array([[0, 1], [2, -1]])
  batch = builder.build(_queries(), rows)
  np.testing.assert_array_equal(batch["span_found"], [1.0, 0.0])
  np.testing.assert_array_equal(batch["candidate_mask"], [[1, 1, 1], [1, 1, 0]])
  joint = batch["joint"]["input_ids"]
  # Null document: the query alone; then [CLS] x [SEP] body [SEP], the body cut to fit 9.
  np.testing.assert_array_equal(joint[0, 0], [CLS, 5, MASK, MASK, SEP, SEP, 0, 0, 0])
  np.testing.assert_array_equal(joint[0, 2], [CLS, 5, MASK, MASK, SEP, 2, 7, 8, SEP])
  np.testing.assert_array_equal(joint[1, 1], [CLS, MASK, 6, SEP, 1, 2, 3, 4, SEP])
  np.testing.assert_array_equal(batch["candidates"]["input_ids"][0, 1],
                                [CLS, 50, SEP, 7, 1, 8, SEP, 0])


def test_span_found_ignores_the_null_document_and_missing_candidates():
  corpus = _Corpus({0: ([50], [1, 2])})
  builder = CandidateBuilder(corpus, CLS, SEP, num_candidates=3, doc_length=8, joint_length=12)
  batch = builder.build(_queries(), np.array([[-1, -1], [0, -1]]))
  np.testing.assert_array_equal(batch["span_found"], [0.0, 0.0])
  corpus = _Corpus({0: ([50], [9])})
  builder = CandidateBuilder(corpus, CLS, SEP, num_candidates=3, doc_length=8, joint_length=12)
  batch = builder.build(_queries(), np.array([[-1, -1], [0, -1]]))
  np.testing.assert_array_equal(batch["span_found"], [0.0, 1.0])


def test_a_title_longer_than_the_document_is_cut_as_ict_cuts_it():
  """A title of doc_length - 2 or more word pieces (a corpus built with a longer block_length, or
  blocking='article') is cut to doc_length - 3, the body then empty: `[CLS] title [SEP] [SEP]`."""
  title = list(range(10, 22))                                      # 12 > doc_length
  corpus = _Corpus({0: (title, [7, 8]), 1: (title[:6], [7, 8])})  # 6 = doc_length - 2
  builder = CandidateBuilder(corpus, CLS, SEP, num_candidates=3, doc_length=8, joint_length=12)
  batch = builder.build(_queries(), np.array([[0, 1], [1, -1]]))
  docs = batch["candidates"]
  np.testing.assert_array_equal(docs["input_ids"][0, 1], [CLS, 10, 11, 12, 13, 14, SEP, SEP])
  np.testing.assert_array_equal(docs["token_type_ids"][0, 1], [0, 0, 0, 0, 0, 0, 0, 1])
  np.testing.assert_array_equal(docs["input_ids"][0, 2], [CLS, 10, 11, 12, 13, 14, SEP, SEP])
  np.testing.assert_array_equal(docs["attention_mask"][1, 1], np.ones(8))
  np.testing.assert_array_equal(batch["joint"]["input_ids"][0, 1, :7],
                                [CLS, 5, MASK, MASK, SEP, 7, 8])


def test_without_the_null_document_it_is_masked_unless_nothing_was_retrieved():
  corpus = _Corpus({0: ([50], [7, 8]), 1: ([51], [9])})
  rows = np.array([[0, 1], [-1, -1]])
  on = CandidateBuilder(corpus, CLS, SEP, num_candidates=3, doc_length=8, joint_length=12)
  off = CandidateBuilder(corpus, CLS, SEP, num_candidates=3, doc_length=8, joint_length=12,
                         null_document=False)
  a, b = on.build(_queries(), rows), off.build(_queries(), rows)
  np.testing.assert_array_equal(a["candidate_mask"], [[1, 1, 1], [1, 0, 0]])
  # Example 1 retrieved nothing: the null document stays its only candidate.
  np.testing.assert_array_equal(b["candidate_mask"], [[0, 1, 1], [1, 0, 0]])
  for name in ("candidates", "joint"):  # the inputs themselves do not change
    np.testing.assert_array_equal(a[name]["input_ids"], b[name]["input_ids"])
