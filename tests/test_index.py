"""DocIndex: sharded exact/approx search and ScaNN against numpy brute force; save/load; publish."""

import json
import os
import re

import chex
import jax
import numpy as np
import pytest
from conftest import importorskip_scann
from jax.sharding import Mesh

from realm_jax.retrieval import exact, index_store
from realm_jax.retrieval import rows as rows_lib
from realm_jax.retrieval.exact import ApproxSearcher, brute_force_top_k
from realm_jax.retrieval.index import DocIndex, index_options
from realm_jax.retrieval.index_store import (arrays_crc32, index_dirs, latest_index_dir,
                                             point_latest, prune_indexes, publish_index,
                                             read_manifest)
from realm_jax.retrieval.rows import HostRows

DIM = 16


def untied_data(seed, n, q, dim=DIM):
  """Embeddings [n, dim], unique 63-bit ids [n] and queries [q, dim] with no tied scores.

  Entries are dyadic (12-bit embeddings, 10-bit queries), so float32 products and sums are exact:
  every implementation gets identical scores, ties can be ruled out exactly, and bfloat16 storage
  (8 bits) really rounds the embeddings.
  """
  rng = np.random.default_rng(seed)
  while True:
    emb = (rng.integers(-2**11, 2**11, size=(n, dim)) / 2**11).astype(np.float32)
    queries = (rng.integers(-2**9, 2**9, size=(q, dim)) / 2**9).astype(np.float32)
    stored_as = (emb, emb.astype(jax.numpy.bfloat16).astype(np.float32))
    if all(len(np.unique(row)) == n for stored in stored_as for row in queries @ stored.T):
      return emb, rng.choice(2**63 - 1, n, replace=False).astype(np.int64), queries


def brute_force(queries, emb, ids, k, exclude=None):
  """Reference: full float32 score matrix, excluded ids at -inf, sorted."""
  scores = queries @ emb.astype(np.float32).T  # [Q, N]
  if exclude is not None:
    for q, row in enumerate(np.reshape(exclude, (len(queries), -1))):
      scores[q, np.isin(ids, row)] = -np.inf
  order = np.argsort(-scores, axis=1)[:, :k]
  return np.take_along_axis(scores, order, axis=1), ids[order]


def clustered(seed, n, dim, clusters=100):
  rng = np.random.default_rng(seed)
  centers = rng.normal(size=(clusters, dim))
  emb = (centers[rng.integers(0, clusters, n)] + 0.5 * rng.normal(size=(n, dim))).astype(np.float32)
  return emb, rng.choice(2**62, n, replace=False).astype(np.int64), rng


def recall(found, truth):
  return np.mean([len(set(f) & set(t)) / len(t) for f, t in zip(found, truth)])


@pytest.fixture(autouse=True, scope="module")
def eight_devices():
  if jax.device_count() < 8:
    pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (set by conftest)")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [1, 13, pytest.param(301, marks=pytest.mark.slow),
                               pytest.param(1029, marks=pytest.mark.slow)])
def test_exact_sharded_equals_brute_force(n, dtype):
  emb, ids, queries = untied_data(n, n, q=5)
  index = DocIndex(emb, ids, dtype=dtype)
  stored = index.embeddings()
  assert stored.dtype == np.dtype(dtype) and stored.shape == (n, DIM)
  np.testing.assert_array_equal(stored.astype(np.float32), emb.astype(dtype).astype(np.float32))

  rng = np.random.default_rng(0)
  top = brute_force(queries, stored, ids, n)[1]  # every id, best first
  unknown = np.int64(2**62 + 7)  # not in the index: excludes nothing
  exclusions = [None, np.full(5, -1)]
  if n > 1:
    exclusions += [top[:, 0],  # [Q]: each query's best block
                   np.stack([top[:, 1], np.full(5, -1), top[:, 0], top[:, 1], np.full(5, unknown)],
                            axis=1)]  # [Q, E] with padding, a repeat and an unknown id
  for exclude in exclusions:
    distinct = 0 if exclude is None else max(len(set(row) & set(ids)) for row in
                                             np.reshape(exclude, (5, -1)))
    for k in sorted({1, min(4, n - distinct), n - distinct}):
      scores, found = index.search(queries, k, exclude_ids=exclude)
      want_scores, want_ids = brute_force(queries, stored, ids, k, exclude)
      assert scores.dtype == np.float32 and found.dtype == np.int64
      assert scores.shape == found.shape == (5, k)
      np.testing.assert_array_equal(found, want_ids, err_msg=f"k={k} exclude={exclude}")
      np.testing.assert_allclose(scores, want_scores, atol=1e-5, rtol=1e-5)


def test_embeddings_are_sharded_over_all_devices_and_padded():
  emb, ids, _ = untied_data(0, 13, q=1)
  index = DocIndex(np.abs(emb) + 0.1, ids)
  assert len(index.searcher.emb.sharding.device_set) == 8
  assert index.searcher.emb.shape == (16, DIM)  # 13 rows padded to 2 per device
  assert {s.data.shape for s in index.searcher.emb.addressable_shards} == {(2, DIM)}
  # Every row scores below 0 here, so an unmasked (zero) padding row would come first.
  scores, found = index.search(-np.ones((2, DIM), np.float32), 13)
  assert (scores < 0).all() and set(found[0]) == set(ids)


def test_explicit_mesh_of_three_devices():
  emb, ids, queries = untied_data(1, 13, q=4)
  index = DocIndex(emb, ids, mesh=Mesh(np.array(jax.devices()[:3]), ("data",)))
  assert len(index.searcher.emb.sharding.device_set) == 3
  scores, found = index.search(queries, 5)
  want_scores, want_ids = brute_force(queries, emb, ids, 5)
  np.testing.assert_array_equal(found, want_ids)
  np.testing.assert_allclose(scores, want_scores, atol=1e-5)


def test_many_queries_are_batched_and_not_recompiled(monkeypatch):
  chex.clear_trace_counter()
  monkeypatch.setattr(exact, "_sharded_top_k", chex.assert_max_traces(exact._sharded_top_k, n=1))
  emb, ids, queries = untied_data(2, 301, q=11)
  index = DocIndex(emb, ids, query_batch_size=4)
  for q, exclude in [(queries, None), (queries[:8], ids[:8]), (queries[3:], None)]:
    scores, found = index.search(q, 3, exclude_ids=exclude)  # batches of 4 queries, E = 1
    want_scores, want_ids = brute_force(q, emb, ids, 3, exclude)
    np.testing.assert_array_equal(found, want_ids)
    np.testing.assert_allclose(scores, want_scores, atol=1e-5)
  with pytest.raises(AssertionError, match="traced > 1 times"):
    index.search(queries, 4)  # a new k is a new program: the counter does see traces


@pytest.mark.parametrize("devices,n,block", [(8, 301, 8), (1, 301, 40), (3, 1000, 64),
                                              (8, 13, 8)])
def test_blocked_scoring_equals_brute_force(devices, n, block):
  """Shards scored in blocks of rows (max_score_bytes small) find what one score matrix finds,
  with exclusions in other blocks, in the same block and in the padding's block."""
  emb, ids, queries = untied_data(n, n, q=4)
  index = DocIndex(emb, ids, mesh=Mesh(np.array(jax.devices()[:devices]), ("data",)),
                   query_batch_size=4, max_score_bytes=4 * 4 * block)
  shard_rows = index.searcher.emb.shape[0] // devices
  assert index.searcher.block_rows <= max(block, 8) and shard_rows % index.searcher.block_rows == 0
  assert shard_rows - -(-n // devices) < 8 * (shard_rows // index.searcher.block_rows)  # padding
  assert (shard_rows > index.searcher.block_rows) == (-(-n // devices) > max(block, 8))
  top = brute_force(queries, emb, ids, n)[1]
  exclude = np.stack([top[:, 0], top[:, 2], np.full(4, -1)], axis=1)
  for k in (1, 7, n - 3):
    scores, found = index.search(queries, k, exclude_ids=exclude)
    want_scores, want_ids = brute_force(queries, emb, ids, k, exclude)
    np.testing.assert_array_equal(found, want_ids, err_msg=f"k={k}")
    np.testing.assert_allclose(scores, want_scores, atol=1e-5)


@pytest.mark.parametrize("block_rows", [7, 64, 1 << 18])
@pytest.mark.parametrize("dtype", [np.float32, jax.numpy.bfloat16])
def test_numpy_reference_in_blocks_equals_one_score_matrix(block_rows, dtype):
  emb, ids, queries = untied_data(5, 64, q=6)
  emb = emb.astype(dtype)
  rows = np.arange(64)
  top = brute_force(queries, emb, rows, 64)[1]
  exclude = np.stack([top[:, 0], top[:, 5], np.full(6, -1)], axis=1)  # [Q, 3] rows
  for k, ex in [(1, None), (10, exclude), (61, exclude)]:
    scores, found = brute_force_top_k(queries, emb, k, ex, batch_size=4, block_rows=block_rows)
    want_scores, want_rows = brute_force(queries, emb, rows, k, ex)
    np.testing.assert_array_equal(found, want_rows, err_msg=f"k={k}")
    np.testing.assert_allclose(scores, want_scores, atol=1e-5)


def test_shard_layout():
  for count, shards, most in [(10, 1, 100), (13, 8, 2), (1000, 3, 64), (13_353_718, 1, 262_144),
                              (13_353_718, 8, 262_144), (7, 8, 8)]:
    shard_rows, block_rows = exact.shard_layout(count, shards, most)
    assert shard_rows * shards >= count and shard_rows % block_rows == 0
    if shard_rows > block_rows:
      assert block_rows <= most and block_rows % 8 == 0
    assert shard_rows - -(-count // shards) < 8 * (shard_rows // block_rows)


class CountedRows(HostRows):
  """An array's rows that records the size of every read."""

  def __init__(self, array):
    self.array, self.shape, self.dtype, self.reads = array, array.shape, array.dtype, []

  def read(self, lo, hi):
    self.reads.append(hi - lo)
    return self.array[lo:hi]


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_built_saved_and_loaded_a_slice_at_a_time(tmp_path, monkeypatch, devices, dtype):
  """With 3-row slices, the index is filled from rows read 3 at a time, saved 3 rows at a time
  and loaded 3 rows at a time, and equals the index of the whole array, on disk and in search."""
  monkeypatch.setattr(rows_lib, "CHUNK_BYTES", 3 * DIM * 2)  # 3 bfloat16 rows, 1 float32 row
  emb, ids, queries = untied_data(11, 50, q=3)
  mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
  counted = CountedRows(emb.astype(dtype))
  index = DocIndex(counted, ids, mesh=mesh, dtype=dtype)
  whole = DocIndex(emb, ids, mesh=mesh, dtype=dtype)
  row_bytes = DIM * np.dtype(dtype).itemsize
  assert max(counted.reads) == max(1, 3 * DIM * 2 // row_bytes) and sum(counted.reads) == 50
  np.testing.assert_array_equal(index.embeddings(), whole.embeddings())
  for a, b in zip(index.search(queries, 6, ids[:3]), whole.search(queries, 6, ids[:3])):
    np.testing.assert_array_equal(a, b)

  written = []
  real_write = rows_lib.write_safetensors

  def spy(path, tensors, metadata=None):
    def chunks_of(name, chunks):
      for part in chunks():
        written.append((name, len(part)))
        yield part
    real_write(path, {name: (shape, dt, lambda name=name, c=chunks: chunks_of(name, c))
                      for name, (shape, dt, chunks) in tensors.items()}, metadata)

  monkeypatch.setattr(index_store, "write_safetensors", spy)
  index.save(tmp_path / "a", step=0, model_fingerprint="m", corpus_fingerprint="c")
  whole.save(tmp_path / "b", step=0, model_fingerprint="m", corpus_fingerprint="c",
             embeddings=emb.astype(dtype))
  assert max(n for name, n in written if name == "embeddings") <= 3
  manifests = [read_manifest(tmp_path / d) for d in "ab"]
  assert manifests[0]["arrays_crc32"] == manifests[1]["arrays_crc32"] == arrays_crc32(
      emb.astype(dtype), ids) == index.arrays_crc32()
  reads = []
  real_read = rows_lib.FileRows.read
  monkeypatch.setattr(rows_lib.FileRows, "read", lambda self, lo, hi: reads.append(
      (self.shape[1], hi - lo)) or real_read(self, lo, hi))
  loaded = DocIndex.load(tmp_path / "a", mesh=mesh)
  row_reads = [n for width, n in reads if width == DIM]  # not the ids' reads
  assert max(row_reads) <= 3 and sum(row_reads) == 2 * 50  # the checksum's pass, then the fill
  np.testing.assert_array_equal(loaded.embeddings(), whole.embeddings())
  np.testing.assert_array_equal(loaded.block_ids, ids)


def test_approx_recall():
  emb, ids, rng = clustered(3, 5000, 32)
  queries = (emb[rng.integers(0, 5000, 64)] + 0.3 * rng.normal(size=(64, 32))).astype(np.float32)
  exact = DocIndex(emb, ids).search(queries, 10)[1]
  scores, found = DocIndex(emb, ids, "approx", recall_target=0.95).search(queries, 10)
  assert recall(found, exact) >= 0.9
  assert (np.diff(scores, axis=1) <= 0).all()


@pytest.mark.parametrize("searcher", ["exact", "approx", "scann", "scann with a tree"])
def test_non_finite_queries_still_get_valid_rows(searcher):
  """A diverged model's NaN or infinite query: every searcher returns k distinct ids of real,
  not excluded rows, ranked after the finite scores (none here), and no padding row (301 rows over
  8 devices leave 3 of them, which an unguarded top-k picks: NaN sorts above -inf)."""
  options = {}
  if searcher.startswith("scann"):
    importorskip_scann()
    if searcher != "scann":  # ScaNN itself fails on non-finite queries when it has a tree
      searcher, options = "scann", dict(num_leaves=10, num_leaves_to_search=3)
  emb, ids, queries = untied_data(6, 301, q=4)
  queries[0] = np.nan
  queries[1, 0] = np.inf
  queries[2] = 0.0
  queries[2, 0], queries[2, 1] = np.inf, -np.inf  # inf - inf: NaN for most rows
  queries[3] = -np.inf
  index = DocIndex(emb, ids, searcher, **options)
  exclude = ids[:4]  # one per query
  for k in (1, 10, 300):
    scores, found = index.search(queries, k, exclude_ids=exclude)
    assert found.shape == (4, k) and np.isin(found, ids).all()
    assert all(len(set(row)) == k for row in found)
    assert not (found == exclude[:, None]).any()
    assert not np.isnan(scores).any() and not np.isposinf(scores).any()
  _, rows = brute_force_top_k(queries, emb, 300, np.arange(4)[:, None])
  assert not (rows == np.arange(4)[:, None]).any() and all(len(set(r)) == 300 for r in rows)


@pytest.fixture(scope="module")
def scann_case():
  importorskip_scann()
  emb, ids, rng = clustered(4, 20000, 64)
  sources = rng.integers(0, 20000, 200)
  queries = (emb[sources] + 0.3 * rng.normal(size=(200, 64))).astype(np.float32)
  # A tree as REALM's (sqrt(N) leaves, a tenth searched); the default for 20k rows has none.
  tree = DocIndex(emb, ids, "scann", num_leaves=141, num_leaves_to_search=14)
  return dict(tree=tree, default=DocIndex(emb, ids, "scann"), exact=DocIndex(emb, ids),
              # Codes half the size: a coarser first pass, corrected by re-ordering more rows.
              coarse=DocIndex(emb, ids, "scann", dims_per_block=4, reorder_num_neighbors=200),
              queries=queries, sources=ids[sources])


@pytest.mark.parametrize("variant", ["tree", "default", "coarse"])
def test_scann_recall(scann_case, variant):
  exact_scores, exact_ids = scann_case["exact"].search(scann_case["queries"], 10)
  scores, found = scann_case[variant].search(scann_case["queries"], 10)
  assert recall(found, exact_ids) >= 0.95
  # Hits are re-scored exactly: a block found by both has the same score in both.
  same = found == exact_ids
  np.testing.assert_allclose(scores[same], exact_scores[same], atol=1e-4)


def test_scann_excludes_blocks(scann_case):
  scann_index, exact_index = scann_case["tree"], scann_case["exact"]
  queries, sources = scann_case["queries"], scann_case["sources"]
  # Without the exclusion most queries find the block they were made from.
  assert (scann_index.search(queries, 10)[1] == sources[:, None]).any(1).mean() > 0.9
  _, found = scann_index.search(queries, 10, exclude_ids=sources)
  assert not (found == sources[:, None]).any()
  assert recall(found, exact_index.search(queries, 10, exclude_ids=sources)[1]) >= 0.95


def test_scann_retuned_at_query_time(scann_case):
  """Searching fewer leaves loses recall, searching all of them (with a deep re-ordering) finds
  what exact search finds; no rebuild, and the settings say what is used."""
  tree, queries = scann_case["tree"], scann_case["queries"]
  exact_ids = scann_case["exact"].search(queries, 10)[1]
  try:
    tree.searcher.retune(num_leaves_to_search=1)
    assert tree.searcher.settings["num_leaves_to_search"] == 1
    one_leaf = recall(tree.search(queries, 10)[1], exact_ids)
    tree.searcher.retune(num_leaves_to_search=141, reorder_num_neighbors=1000)
    every_leaf = recall(tree.search(queries, 10)[1], exact_ids)
    assert one_leaf < 0.9 < 0.99 <= every_leaf, (one_leaf, every_leaf)
    for bad in (dict(num_leaves_to_search=142), dict(num_leaves_to_search=0),
                dict(reorder_num_neighbors=0)):
      with pytest.raises(ValueError, match=next(iter(bad))):
        tree.searcher.retune(**bad)
  finally:
    tree.searcher.retune(num_leaves_to_search=14, reorder_num_neighbors=100)


def test_scann_rejects_bad_dims_per_block_and_reorder_num_neighbors():
  importorskip_scann()
  emb, ids, _ = untied_data(6, 50, q=1)
  for bad in (0, emb.shape[1] + 1, 2.5, True):
    with pytest.raises(ValueError, match="dims_per_block"):
      DocIndex(emb, ids, "scann", dims_per_block=bad)
  for bad in (0, -3, 2.5, True):
    with pytest.raises(ValueError, match="reorder_num_neighbors"):
      DocIndex(emb, ids, "scann", reorder_num_neighbors=bad)
    for name in ("num_leaves", "num_leaves_to_search", "training_sample_size"):
      with pytest.raises(ValueError, match=f"{name}="):
        DocIndex(emb, ids, "scann", **{name: bad})


def test_scann_re_orders_more_candidates_for_more_exclusions(scann_case):
  """Each query excludes its 60 best blocks: the re-ordering goes 60 rows deeper, so recall
  against exact search with the same exclusions holds (re-ordering only the default 100 would
  leave 40 usable rows and lose recall)."""
  queries, exact_index = scann_case["queries"], scann_case["exact"]
  excluded = exact_index.search(queries, 60)[1]
  want = exact_index.search(queries, 10, exclude_ids=excluded)[1]
  _, found = scann_case["default"].search(queries, 10, exclude_ids=excluded)
  assert not (found[:, :, None] == excluded[:, None, :]).any()
  assert recall(found, want) >= 0.95


def test_scann_refuses_non_finite_rows():
  importorskip_scann()
  emb, ids, _ = untied_data(6, 50, q=1)
  emb[7, 3] = np.nan
  with pytest.raises(ValueError, match=rf"1 embedding rows are not finite.*\[{ids[7]}\]"):
    DocIndex(emb, ids, "scann")


def test_bad_search_settings_and_float_exclusions_are_refused():
  emb, ids, queries = untied_data(6, 50, q=2)
  for bad in (0, -1, 2.0):
    with pytest.raises(ValueError, match="query_batch_size"):
      DocIndex(emb, ids, query_batch_size=bad)
  with pytest.raises(ValueError, match="recall_target=1.5"):
    DocIndex(emb, ids, "approx", recall_target=1.5)
  with pytest.raises(ValueError, match="exclude_ids must be integer block ids; got dtype float64"):
    DocIndex(emb, ids).search(queries, 3, exclude_ids=ids[:2].astype(np.float64))


def test_small_query_counts_share_a_few_compiled_shapes():
  """1..40 queries run as 1, 2, 4, 8, 16, 32 and 64 padded queries: seven programs, not forty."""
  emb, ids, queries = untied_data(6, 50, q=40)
  index = DocIndex(emb, ids)
  for q in range(1, 41):
    scores, found = index.search(queries[:q], 3)
    assert found.shape == (q, 3)
    np.testing.assert_array_equal(found, brute_force(queries[:q], emb, ids, 3)[1])
  assert index.searcher._search_fn._cache_size() == 7


def test_index_options_from_a_config():
  """config.index -> DocIndex arguments: ScaNN's non-zero settings only for searcher "scann"; a
  config saved before `index.scann` existed still works; a misspelt setting is refused."""
  from ml_collections import ConfigDict
  settings = dict(num_leaves=0, num_leaves_to_search=0, reorder_num_neighbors=50, dims_per_block=4)
  config = ConfigDict(dict(searcher="scann", dtype="bfloat16", scann=settings))
  assert index_options(config) == dict(searcher="scann", dtype="bfloat16",
                                       reorder_num_neighbors=50, dims_per_block=4)
  config.searcher = "exact"
  assert index_options(config) == dict(searcher="exact", dtype="bfloat16")
  old = ConfigDict(dict(searcher="scann", dtype="float32"))
  assert index_options(old) == dict(searcher="scann", dtype="float32")
  typo = ConfigDict(dict(searcher="scann", dtype="float32", scann=dict(dims_per_blok=4)))
  with pytest.raises(ValueError, match="dims_per_blok"):
    index_options(typo)
  negative = ConfigDict(dict(searcher="exact", dtype="float32", scann=dict(num_leaves=-5)))
  with pytest.raises(ValueError, match=r"--config.index.scann.num_leaves=-5: give a whole number"):
    index_options(negative)
  with pytest.raises(ValueError, match="--config.index.searcher='faiss'"):
    index_options(ConfigDict(dict(searcher="faiss", dtype="float32")))


def test_scann_too_few_candidates_falls_back_to_exact():
  importorskip_scann()
  emb, ids, queries = untied_data(5, 301, q=4)
  # One leaf of four searched holds ~75 rows: fewer than k, so those queries are brute-forced.
  index = DocIndex(emb, ids, "scann", num_leaves=4, num_leaves_to_search=1,
                   reorder_num_neighbors=10)
  exclude = brute_force(queries, emb, ids, 1)[1][:, 0]
  scores, found = index.search(queries, 200, exclude_ids=exclude)
  want_scores, want_ids = brute_force(queries, emb, ids, 200, exclude)
  np.testing.assert_array_equal(found, want_ids)
  np.testing.assert_allclose(scores, want_scores, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_load_round_trip(tmp_path, dtype):
  emb, ids, queries = untied_data(6, 29, q=3)
  index = DocIndex(emb, ids, dtype=dtype)
  index.save(tmp_path / "idx", step=7, model_fingerprint="m1", corpus_fingerprint="c1")
  assert sorted(os.listdir(tmp_path)) == ["idx"]  # no temporary directory left behind
  assert sorted(os.listdir(tmp_path / "idx")) == ["index.safetensors", "manifest.json"]
  manifest = read_manifest(tmp_path / "idx")
  save_id = manifest.pop("save_id")
  assert manifest == {"format_version": 1, "step": 7, "model_fingerprint": "m1",
                      "corpus_fingerprint": "c1", "dtype": dtype, "count": 29, "dim": DIM,
                      "arrays_crc32": arrays_crc32(index.embeddings(), ids)}
  manifest["save_id"] = save_id
  loaded = DocIndex.load(tmp_path / "idx", expected_dim=DIM, expected_corpus_fingerprint="c1")
  assert loaded.manifest == manifest and loaded.dtype == index.dtype
  np.testing.assert_array_equal(loaded.embeddings(), index.embeddings())
  np.testing.assert_array_equal(loaded.block_ids, ids)
  for a, b in zip(loaded.search(queries, 5, ids[:3]), index.search(queries, 5, ids[:3])):
    np.testing.assert_array_equal(a, b)
  # Saving again replaces the directory whole.
  DocIndex(emb[:5], ids[:5]).save(tmp_path / "idx", step=8, model_fingerprint="m2",
                                  corpus_fingerprint="c2")
  assert DocIndex.load(tmp_path / "idx").count == 5
  assert sorted(os.listdir(tmp_path)) == ["idx"]
  assert read_manifest(tmp_path / "idx")["save_id"] != save_id  # a new id for each save


def test_load_into_another_searcher_and_dtype(tmp_path):
  emb, ids, queries = untied_data(7, 50, q=3)
  DocIndex(emb, ids).save(tmp_path, step=0, model_fingerprint="m", corpus_fingerprint="c")
  loaded = DocIndex.load(tmp_path, searcher="approx", dtype="bfloat16")
  assert isinstance(loaded.searcher, ApproxSearcher)
  assert loaded.embeddings().dtype == jax.numpy.bfloat16


def test_load_mismatches_and_broken_manifests(tmp_path):
  emb, ids, _ = untied_data(8, 10, q=1)
  path = tmp_path / "idx"
  DocIndex(emb, ids).save(path, step=1, model_fingerprint="m", corpus_fingerprint="wiki-a")
  with pytest.raises(ValueError, match=rf"{path}.*dimension {DIM}.*128 was expected"):
    DocIndex.load(path, expected_dim=128)
  with pytest.raises(ValueError, match=rf"{path}.*'wiki-a'.*'wiki-b' was expected"):
    DocIndex.load(path, expected_corpus_fingerprint="wiki-b")

  manifest = json.loads((path / "manifest.json").read_text())
  (path / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
  with pytest.raises(ValueError, match="format_version 99.*reads version 1"):
    DocIndex.load(path)
  (path / "manifest.json").write_text('{"format_version": 1, "st')
  with pytest.raises(ValueError, match="manifest.json is corrupt: not valid JSON"):
    DocIndex.load(path)
  (path / "manifest.json").write_text(json.dumps({**manifest, "count": 11}))
  with pytest.raises(ValueError, match=r"does not hold the \[11, 16\] float32 embeddings"):
    DocIndex.load(path)
  (path / "manifest.json").write_text(json.dumps({**manifest, "dtype": "bfloat16"}))
  with pytest.raises(ValueError, match=r"does not hold the \[10, 16\] bfloat16 embeddings"):
    DocIndex.load(path)
  for key, bad in (("dim", "16"), ("count", True), ("step", -1), ("count", 0)):
    (path / "manifest.json").write_text(json.dumps({**manifest, key: bad}))
    with pytest.raises(ValueError, match=rf"invalid {key}={bad!r} .*rebuild"):
      DocIndex.load(path)
  # The manifest of another save of the directory (a reader racing a writer): refused.
  (path / "manifest.json").write_text(json.dumps({**manifest, "save_id": "0" * 32}))
  with pytest.raises(ValueError, match="saved again while it was being read.*load it again"):
    DocIndex.load(path)
  # An index saved before save_id existed (neither file has one) still loads.
  from safetensors.numpy import save_file
  save_file({"embeddings": emb, "block_ids": ids}, str(path / "index.safetensors"))
  (path / "manifest.json").write_text(json.dumps(
      {k: v for k, v in manifest.items() if k != "save_id"}))
  np.testing.assert_array_equal(DocIndex.load(path).embeddings(), emb)
  # A truncated array file.
  data = (path / "index.safetensors").read_bytes()
  (path / "index.safetensors").write_bytes(data[:len(data) // 2])
  with pytest.raises(ValueError, match=r"index.safetensors cannot be read .*truncated or corrupt"):
    DocIndex.load(path)
  with pytest.raises(ValueError, match="step=2.5"):
    DocIndex(emb, ids).save(tmp_path / "other", step=2.5, model_fingerprint="m",
                            corpus_fingerprint="c")
  (path / "manifest.json").unlink()
  with pytest.raises(FileNotFoundError, match="manifest.json does not exist.*not a saved index"):
    DocIndex.load(path)


def damage(path, start, size):
  """Flips every bit of `size` bytes of the file `path` from byte `start`: same size, new bytes."""
  data = bytearray(path.read_bytes())
  data[start:start + size] = bytes(b ^ 0xFF for b in data[start:start + size])
  path.write_bytes(bytes(data))


def test_index_damaged_after_saving_is_refused(tmp_path):
  """Bytes overwritten in the middle of index.safetensors (the file keeps its size, its header
  stays valid) were searched as embeddings; the manifest's checksum refuses them."""
  emb, ids, _ = untied_data(11, 200, q=1)
  path = tmp_path / "index-00000000"
  DocIndex(emb, ids).save(path, step=0, model_fingerprint="m", corpus_fingerprint="c")
  arrays = path / "index.safetensors"
  size = arrays.stat().st_size
  damage(arrays, size // 2, size // 4)  # in the embeddings, well past the header
  assert arrays.stat().st_size == size
  with pytest.raises(ValueError, match=(
      rf"{arrays} is corrupt: its arrays' CRC-32 is [0-9a-f]{{8}}, but its manifest says "
      rf"[0-9a-f]{{8}} .*Delete {path} and rebuild the index \(e\.g\. experiments/build_index.py")):
    DocIndex.load(path)


def test_a_damaged_index_says_what_its_owner_advises(tmp_path):
  """The index of a RETRO database or a kNN-LM datastore is not built by build_index.py, which
  its error advised: the one that owns an index passes what to do."""
  emb, ids, _ = untied_data(11, 200, q=1)
  path = tmp_path / "db" / "index"
  DocIndex(emb, ids).save(path, step=0, model_fingerprint="m", corpus_fingerprint="c")
  arrays = path / "index.safetensors"
  data = arrays.read_bytes()
  remedy = "Delete the database db and build it again (experiments/retro_train.py)."
  for damaged, says in ((data[:-8] + bytes(b ^ 0xFF for b in data[-8:]), "is corrupt"),
                        (data[:len(data) // 2], "cannot be read")):
    arrays.write_bytes(damaged)
    with pytest.raises(ValueError, match=rf"{says}.*\. {re.escape(remedy)}$") as e:
      DocIndex.load(path, remedy=remedy)
    assert "build_index" not in str(e.value)
    with pytest.raises(ValueError, match=rf"{says}.*Delete {path} and rebuild the index \(e\.g\. "
                                         r"experiments/build_index\.py\)\.$"):
      DocIndex.load(path)  # a REALM block index: the default advice


def test_index_saved_without_a_checksum_still_loads(tmp_path):
  """Indexes saved before manifests held a checksum load as before, unverified."""
  from safetensors.numpy import save_file
  emb, ids, _ = untied_data(12, 20, q=1)
  path = tmp_path / "idx"
  path.mkdir()
  save_file({"embeddings": emb, "block_ids": ids}, str(path / "index.safetensors"))
  (path / "manifest.json").write_text(json.dumps(
      {"format_version": 1, "step": 0, "model_fingerprint": "m", "corpus_fingerprint": "c",
       "dtype": "float32", "count": 20, "dim": DIM}))
  loaded = DocIndex.load(path)
  np.testing.assert_array_equal(loaded.embeddings(), emb)
  np.testing.assert_array_equal(loaded.block_ids, ids)


def test_corrupt_manifest_is_reported_as_corrupt_not_as_no_index(tmp_path):
  """latest_index_dir took an index whose manifest is not JSON for an unfinished one: with no
  other index, callers said "No index". The error names the file, line and column."""
  emb, ids, _ = untied_data(13, 10, q=1)
  path = publish_index(tmp_path, DocIndex(emb, ids), 5, model_fingerprint="m",
                       corpus_fingerprint="c")
  manifest = os.path.join(path, "manifest.json")
  with open(manifest, "w") as f:
    f.write('{"format_version": 1,\n "step": 5,,\n')
  message = (rf"{manifest} is corrupt: not valid JSON \(.*: line 2, column 12\)\. Delete "
             rf"{path} and rebuild the index\.")
  with pytest.raises(ValueError, match=message):
    latest_index_dir(tmp_path)
  with pytest.raises(ValueError, match=message):
    DocIndex.load(path)
  # A complete older index is still found (the damaged one is logged).
  older = publish_index(tmp_path, DocIndex(emb, ids), 4, model_fingerprint="m",
                        corpus_fingerprint="c")
  assert latest_index_dir(tmp_path) == older


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_saved_index_has_the_umask_permissions(tmp_path, umask):
  """Index directories and files were 0700 / 0600 (temporary directory, safetensors' file) while
  the rest of a work directory follows the umask."""
  emb, ids, _ = untied_data(14, 10, q=1)
  old = os.umask(umask)
  try:
    path = publish_index(tmp_path / "index", DocIndex(emb, ids), 0, model_fingerprint="m",
                         corpus_fingerprint="c")
  finally:
    os.umask(old)
  mode = lambda p: os.stat(p).st_mode & 0o777
  assert mode(path) == 0o777 & ~umask
  for name in ("index.safetensors", "manifest.json"):
    assert mode(os.path.join(path, name)) == 0o666 & ~umask, name


def test_prune_keeps_the_newest_latest_and_protected_indexes(tmp_path):
  emb, ids, _ = untied_data(9, 10, q=1)
  index = DocIndex(emb, ids)
  for step in (0, 100, 200, 300, 400):
    publish_index(tmp_path, index, step, model_fingerprint="m", corpus_fingerprint="c")
  names = lambda: sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("index-"))
  assert prune_indexes(tmp_path, 0) == [] and len(names()) == 5  # 0: keep all
  deleted = prune_indexes(tmp_path, 2, protect=[str(tmp_path / "index-00000100")])
  assert sorted(deleted) == [str(tmp_path / "index-00000000"), str(tmp_path / "index-00000200")]
  assert names() == ["index-00000100", "index-00000300", "index-00000400"]
  # A run resumed from an older checkpoint republished an older step: LATEST names it, it stays,
  # and the steps above it (left by the run before) are not among the newest kept.
  publish_index(tmp_path, index, 250, model_fingerprint="m", corpus_fingerprint="c")
  assert prune_indexes(tmp_path, 1, protect=["index-00000100"]) == [
      str(tmp_path / "index-00000400"), str(tmp_path / "index-00000300")]
  assert names() == ["index-00000100", "index-00000250"]
  assert latest_index_dir(tmp_path) == str(tmp_path / "index-00000250")
  with pytest.raises(ValueError, match="keep=-1"):
    prune_indexes(tmp_path, -1)


def test_indexes_above_latest_go_first(tmp_path):
  """A run that published steps 100-300 resumed from step 100 (LATEST points back at it): 200 and
  300 are not among the newest it keeps; then it publishes 150 and goes on from there."""
  emb, ids, _ = untied_data(9, 10, q=1)
  index = DocIndex(emb, ids)
  for step in (0, 100, 200, 300):
    publish_index(tmp_path, index, step, model_fingerprint="m", corpus_fingerprint="c")
  assert [name for _, name in index_dirs(tmp_path)] == [
      "index-00000300", "index-00000200", "index-00000100", "index-00000000"]
  point_latest(tmp_path, tmp_path / "index-00000100")
  assert latest_index_dir(tmp_path) == str(tmp_path / "index-00000100")
  assert prune_indexes(tmp_path, 2, protect=["index-00000300"]) == [
      str(tmp_path / "index-00000200")]
  publish_index(tmp_path, index, 150, model_fingerprint="m", corpus_fingerprint="c")
  assert prune_indexes(tmp_path, 1) == [str(tmp_path / "index-00000300"),
                                        str(tmp_path / "index-00000100"),
                                        str(tmp_path / "index-00000000")]
  assert [name for _, name in index_dirs(tmp_path)] == ["index-00000150"]
  with pytest.raises(ValueError, match="LATEST.json is not an index-<step> directory"):
    point_latest(tmp_path, tmp_path / "LATEST.json")


def test_publish_and_latest(tmp_path):
  emb, ids, _ = untied_data(9, 10, q=1)
  index = DocIndex(emb, ids)
  assert latest_index_dir(tmp_path) is None
  assert latest_index_dir(tmp_path / "missing") is None
  for step in (100, 200):
    path = publish_index(tmp_path, index, step, model_fingerprint="m", corpus_fingerprint="c")
    assert path == str(tmp_path / f"index-{step:08d}")
  assert json.loads((tmp_path / "LATEST").read_text())["directory"] == "index-00000200"
  assert latest_index_dir(tmp_path) == str(tmp_path / "index-00000200")

  # A writer that crashed mid-save left its temporary directory: never returned.
  crashed = tmp_path / ".tmp-index-00000300-abc123"
  crashed.mkdir()
  (crashed / "index.safetensors").write_bytes(b"partial")
  assert latest_index_dir(tmp_path) == str(tmp_path / "index-00000200")

  # Without a usable LATEST, the newest complete index directory.
  (tmp_path / "LATEST").write_text("{not json")
  assert latest_index_dir(tmp_path) == str(tmp_path / "index-00000200")
  (tmp_path / "LATEST").unlink()
  assert latest_index_dir(tmp_path) == str(tmp_path / "index-00000200")

  # A run resumed from an older checkpoint republishes an older step: LATEST follows it.
  publish_index(tmp_path, index, 150, model_fingerprint="m", corpus_fingerprint="c")
  assert latest_index_dir(tmp_path) == str(tmp_path / "index-00000150")
  assert DocIndex.load(latest_index_dir(tmp_path)).manifest["step"] == 150


def test_bad_inputs():
  emb, ids, queries = untied_data(10, 13, q=2)
  index = DocIndex(emb, ids)
  with pytest.raises(ValueError, match="k must be a positive integer; got 0"):
    index.search(queries, 0)
  with pytest.raises(ValueError, match="k = 14 is more than the 13 rows"):
    index.search(queries, 14)
  with pytest.raises(ValueError, match="k = 13 is more than the 12 rows"):
    index.search(queries, 13, exclude_ids=np.array([ids[0], -1]))
  with pytest.raises(ValueError, match="Query dimension 8 does not match the index dimension 16"):
    index.search(queries[:, :8], 1)
  with pytest.raises(ValueError, match=r"queries must be \[Q, D\]; got shape \(16,\)"):
    index.search(queries[0], 1)
  with pytest.raises(ValueError, match=r"exclude_ids must be \[Q\] or \[Q, E\] with Q = 2"):
    index.search(queries, 1, exclude_ids=ids[:3])
  with pytest.raises(ValueError, match="1 duplicate block ids"):
    DocIndex(emb, np.concatenate([ids[:12], ids[:1]]))
  with pytest.raises(ValueError, match="empty index"):
    DocIndex(np.zeros((0, DIM), np.float32), np.zeros(0, np.int64))
  with pytest.raises(ValueError, match="must be non-negative"):
    DocIndex(emb, np.arange(-1, 12))
  with pytest.raises(ValueError, match=r"block_ids must be \[N\] = \[13\]"):
    DocIndex(emb, ids[:12])
  with pytest.raises(ValueError, match="Unknown searcher 'faiss'"):
    DocIndex(emb, ids, "faiss")
  with pytest.raises(ValueError, match="Unknown storage dtype 'float16'"):
    DocIndex(emb, ids, dtype="float16")


def test_scann_is_imported_without_tensorflow():
  """scann_searcher.scann_ops imports ScaNN's searcher module without the `scann` package's
  __init__, which imports TensorFlow when it is installed (8.5 s); an `import scann` after it
  still gives the whole package, with the same searcher module (TensorFlow kept out of that
  import too, as when it is not installed: it would take as long)."""
  import importlib.util
  import subprocess
  import sys
  importorskip_scann()
  if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("TensorFlow is not installed: nothing to leave out")
  code = ("import sys\n"
          "from realm_jax.retrieval.scann_searcher import scann_ops\n"
          "ops = scann_ops()\n"
          "assert 'tensorflow' not in sys.modules and 'scann' not in sys.modules\n"
          "assert scann_ops() is ops\n"
          "sys.modules['tensorflow'] = None\n"
          "import scann\n"
          "assert scann.scann_ops_pybind is ops\n"
          "assert scann.ScannBuilder and scann_ops() is ops\n")
  got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert got.returncode == 0, got.stderr[-3000:]
