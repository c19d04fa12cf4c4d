"""`DocIndex`: top-k inner-product search over block embeddings by block id; saving and loading.

`DocIndex` holds the [N, D] embeddings of the corpus blocks with their unique int64 block ids. It
maps ids to rows and back, checks every query, k and exclusion, and hands the search to one of the
searchers of realm_jax/retrieval/searcher.py (`SEARCHERS`: "exact", "approx", "scann"), chosen by
name. Every searcher can exclude given block ids per query (REALM drops the block a masked sentence
came from), and never returns padding or excluded rows, even for queries with non-finite values
(whose NaN or infinite scores rank below every finite one: a diverged model still gets valid rows,
and its step fails on its own loss, not on an index error).

`save` and `load` write and read the files of realm_jax/retrieval/index_store.py (which also
publishes numbered indexes behind a LATEST pointer) a slice of rows at a time, and an index can be
built from rows that are read in slices (realm_jax/retrieval/rows.py: embedding shards on disk),
so a device searcher's index is never held twice in host memory. `index_options` turns a config's
`index` section into `DocIndex` arguments.
"""

from __future__ import annotations

import os

import numpy as np
from jax.sharding import Mesh

from realm_jax import config_checks
from realm_jax.retrieval.index_store import (DTYPES, arrays_crc32, open_arrays, read_manifest,
                                             write_index)
from realm_jax.retrieval.rows import HostRows, as_rows
from realm_jax.retrieval.searcher import SEARCHERS


class DocIndex:
  """Top-k maximum-inner-product search over block embeddings with unique int64 block ids.

  Args:
    embeddings: [N, D] float array (float32 or bfloat16), N >= 1, or `HostRows` of them (read a
      slice at a time: e.g. `ConcatRows` of embedding shard files).
    block_ids: [N] unique non-negative int64 ids (hashes, not 0..N-1); results are given as these.
    searcher: a name in `SEARCHERS` ("exact", "approx" or "scann"; realm_jax/retrieval/searcher.py).
    mesh: devices a device searcher shards the embeddings over, on an axis named "data" (default:
      all devices).
    dtype: storage dtype, "float32" or "bfloat16". Scores are always computed in float32.
    **options: the searcher's own settings, as its class takes them (e.g. `query_batch_size` of
      `ExactSearcher`, `recall_target` of `ApproxSearcher`, `dims_per_block` of `ScannSearcher`).

  Once built, `index.searcher` is the searcher object itself, an instance of SEARCHERS[searcher].
  """

  def __init__(self, embeddings: np.ndarray | HostRows, block_ids: np.ndarray,
               searcher: str = "exact", *, mesh: Mesh | None = None, dtype: str = "float32",
               **options):
    if not isinstance(embeddings, HostRows):
      embeddings = np.asarray(embeddings)
    block_ids = np.asarray(block_ids)
    if searcher not in SEARCHERS:
      raise ValueError(f"Unknown searcher {searcher!r}: use one of {tuple(SEARCHERS)}.")
    if str(dtype) not in DTYPES:
      raise ValueError(f"Unknown storage dtype {dtype!r}: use one of {tuple(DTYPES)}.")
    if len(embeddings.shape) != 2:
      raise ValueError(f"embeddings must be [N, D]; got shape {embeddings.shape}.")
    if len(embeddings) == 0:
      raise ValueError("Cannot build an empty index: embeddings has no rows. Embed a corpus first.")
    if len(embeddings) >= 2**31:
      raise ValueError(f"{len(embeddings)} rows do not fit int32 row indices; split the index.")
    if block_ids.shape != (len(embeddings),) or not np.issubdtype(block_ids.dtype, np.integer):
      raise ValueError(f"block_ids must be [N] = [{len(embeddings)}] integers; got "
                       f"{block_ids.dtype} of shape {block_ids.shape}.")
    block_ids = block_ids.astype(np.int64)
    order = np.argsort(block_ids, kind="stable")
    sorted_ids = block_ids[order]
    duplicated = sorted_ids[1:][sorted_ids[1:] == sorted_ids[:-1]]
    if len(duplicated):
      raise ValueError(f"{len(duplicated)} duplicate block ids, e.g. {duplicated[:5].tolist()}: "
                       "every block needs its own id (check how block ids are hashed).")
    if sorted_ids[0] < 0:
      raise ValueError(f"Block ids must be non-negative (-1 means 'nothing' in exclude_ids); got "
                       f"{sorted_ids[0]}.")
    if SEARCHERS[searcher].needs_finite_rows:
      bad = np.concatenate([lo + np.flatnonzero(~np.isfinite(part).all(axis=1))
                            for lo, part in as_rows(embeddings).chunks()])
      if len(bad):
        raise ValueError(f"{len(bad)} embedding rows are not finite (NaN or infinite), e.g. block "
                         f"ids {block_ids[bad[:5]].tolist()}: the model that embedded them has "
                         "diverged; re-embed the corpus with finite weights.")

    self.count, self.dim = embeddings.shape
    self.dtype = DTYPES[str(dtype)]
    self.block_ids = block_ids  # [N] row -> block id
    self._sorted_ids, self._sorted_rows = sorted_ids, order  # block id -> row, via searchsorted
    self.manifest: dict | None = None  # set by `load`, with the directory it came from
    self.directory: str | None = None
    self.searcher = SEARCHERS[searcher](embeddings, self.dtype, mesh, **options)

  def embeddings(self) -> np.ndarray:
    """The stored [N, D] embeddings on the host, in the storage dtype."""
    return self.searcher.embeddings()

  def arrays_crc32(self) -> str:
    """The CRC-32 that a save of this index records (index_store.arrays_crc32 of the stored rows
    and the ids), computed a slice of rows at a time."""
    return arrays_crc32(self._stored_rows(), self.block_ids)

  def _stored_rows(self) -> HostRows:
    """The searcher's stored rows, read a slice at a time."""
    return _SearcherRows(self.searcher, (self.count, self.dim), self.dtype)

  def _rows(self, ids: np.ndarray) -> np.ndarray:
    """Row of each block id (same shape), -1 for ids not in the index (and for -1)."""
    pos = np.minimum(np.searchsorted(self._sorted_ids, ids), self.count - 1)
    return np.where(self._sorted_ids[pos] == ids, self._sorted_rows[pos], -1)

  def _check(self, queries, k, exclude_ids):
    """Validated float32 queries [Q, D] and int32 excluded rows [Q, E]."""
    if not isinstance(k, (int, np.integer)) or k < 1:
      raise ValueError(f"k must be a positive integer; got {k!r}.")
    queries = np.asarray(queries)
    if queries.ndim != 2:
      raise ValueError(f"queries must be [Q, D]; got shape {queries.shape}. For one query pass "
                       "queries[None].")
    if queries.shape[1] != self.dim:
      raise ValueError(f"Query dimension {queries.shape[1]} does not match the index dimension "
                       f"{self.dim}: embed queries with the same retriever as the index.")
    num_queries = len(queries)
    if exclude_ids is None:
      exclude_rows = np.full((num_queries, 1), -1, np.int32)
    else:
      exclude_ids = np.asarray(exclude_ids)
      if exclude_ids.size and not np.issubdtype(exclude_ids.dtype, np.integer):
        raise ValueError(f"exclude_ids must be integer block ids; got dtype {exclude_ids.dtype} "
                         "(a float cannot hold every int64 id exactly).")
      if exclude_ids.ndim == 1:
        exclude_ids = exclude_ids[:, None]
      if exclude_ids.ndim != 2 or len(exclude_ids) != num_queries or exclude_ids.shape[1] == 0:
        raise ValueError(f"exclude_ids must be [Q] or [Q, E] with Q = {num_queries} and E >= 1 "
                         f"(-1 for 'nothing'); got shape {exclude_ids.shape}.")
      exclude_rows = self._rows(exclude_ids.astype(np.int64)).astype(np.int32)
    # Each query can return the rows it does not exclude (an id listed twice counts once).
    ordered = np.sort(exclude_rows, axis=1)
    distinct = (ordered >= 0) & np.concatenate(
        [np.ones((num_queries, 1), bool), ordered[:, 1:] != ordered[:, :-1]], axis=1)
    returnable = self.count - distinct.sum(1).max(initial=0)
    if k > returnable:
      raise ValueError(f"k = {k} is more than the {returnable} rows a query can return (index of "
                       f"{self.count} rows, minus excluded ones); ask for k <= {returnable}.")
    return queries.astype(np.float32, copy=False), exclude_rows

  def search(self, queries: np.ndarray, k: int, exclude_ids: np.ndarray | None = None):
    """Top-k blocks for each query, by inner product.

    Args:
      queries: [Q, D] float queries.
      k: results per query; at most N minus the blocks excluded for any query.
      exclude_ids: None, or int64 block ids [Q] or [Q, E] never to return for that query (-1 and ids
        not in the index exclude nothing).

    Returns:
      scores [Q, k] float32 in descending order and their block ids [Q, k] int64.
    """
    queries, exclude_rows = self._check(queries, k, exclude_ids)
    if len(queries) == 0:
      return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
    scores, rows = self.searcher.search(queries, k, exclude_rows)
    return scores, self.block_ids[rows]

  def save(self, directory: str | os.PathLike, *, step: int, model_fingerprint: str,
           corpus_fingerprint: str, embeddings: np.ndarray | None = None,
           extra: dict | None = None) -> None:
    """Writes `index.safetensors` and `manifest.json` into `directory`, atomically (replacing it).

    Args:
      directory: where the index goes, local or gs://; it appears complete or not at all (on gs://
        the manifest is uploaded after the arrays: an index without one is not complete).
      step: training step of the retriever that embedded the corpus.
      model_fingerprint: identifies those retriever weights.
      corpus_fingerprint: identifies the blocks (text and order); `load` can insist on it.
      embeddings: the [N, D] rows this index was built from, when the caller still has them: an
        index sharded over several hosts holds only its own rows on each.
      extra: more manifest fields (e.g. build_index's `embedding_settings`).
    """
    config_checks.whole_number("step", step, 0, None, " (the training step)")
    if embeddings is None:
      rows = self._stored_rows()
    elif np.shape(embeddings) != (self.count, self.dim):
      raise ValueError(f"embeddings has shape {np.shape(embeddings)}; this index is "
                       f"[{self.count}, {self.dim}].")
    else:
      rows = np.asarray(embeddings).astype(self.dtype, copy=False)
    write_index(directory, {**(extra or {}), "step": int(step),
                            "model_fingerprint": str(model_fingerprint),
                            "corpus_fingerprint": str(corpus_fingerprint),
                            "dtype": self.dtype.name, "count": self.count, "dim": self.dim},
                rows, self.block_ids)

  @classmethod
  def load(cls, directory: str | os.PathLike, *, expected_dim: int | None = None,
           expected_corpus_fingerprint: str | None = None,
           expected_model_fingerprint: str | None = None, searcher: str = "exact",
           mesh: Mesh | None = None, dtype: str | None = None, remedy: str | None = None,
           **options) -> "DocIndex":
    """Reads an index written by `save`; `options` go to the constructor. Its arrays must have
    the CRC-32 its manifest records (indexes saved before manifests had one are not checked).

    Args:
      expected_dim / expected_corpus_fingerprint / expected_model_fingerprint: if given, must
        match the manifest (the last: the document tower that embedded the blocks).
      dtype: storage dtype to use (default: the saved one).
      remedy: what the error for damaged arrays tells the user to do (default:
        `index_store.rebuild_advice`, for REALM's block indexes); a RETRO database or a kNN-LM
        datastore says how it is built again.
    """
    directory = os.fspath(directory)
    manifest = read_manifest(directory)
    if expected_dim is not None and manifest["dim"] != expected_dim:
      raise ValueError(f"The index in {directory} has dimension {manifest['dim']}, but "
                       f"{expected_dim} was expected: rebuild it with the current retriever.")
    for key, expected, what, fix in (
        ("corpus_fingerprint", expected_corpus_fingerprint, "built from corpus",
         "rebuild the index for this corpus."),
        ("model_fingerprint", expected_model_fingerprint, "embedded by retriever weights",
         "rebuild the index with these weights (experiments/build_index.py), or configure the "
         "weights that built it.")):
      if expected is not None and manifest[key] != expected:
        raise ValueError(f"The index in {directory} was {what} {manifest[key]!r}, but "
                         f"{expected!r} was expected: {fix}")
    # Read into the searcher a slice at a time.
    with open_arrays(directory, manifest, remedy) as (rows, ids):
      index = cls(rows, ids, searcher, mesh=mesh, dtype=dtype or manifest["dtype"], **options)
    index.manifest, index.directory = manifest, directory
    return index


class _SearcherRows(HostRows):
  """A searcher's stored rows, read a slice at a time (what `DocIndex.save` writes)."""

  def __init__(self, searcher, shape, dtype):
    self.searcher, self.shape, self.dtype = searcher, shape, np.dtype(dtype)

  def read(self, lo: int, hi: int) -> np.ndarray:
    self._check(lo, hi)
    return self.searcher.rows(lo, hi)


def index_options(index_config) -> dict:
  """`DocIndex` keyword arguments from a config's `index` section: `searcher`, `dtype` and the
  non-zero settings of that searcher's own section, `index.<searcher>` (0: DocIndex's default).
  The section of every searcher that has one is checked, chosen or not."""
  for key, allowed in (("searcher", tuple(SEARCHERS)), ("dtype", tuple(DTYPES))):
    if index_config[key] not in allowed:
      raise ValueError(f"--config.index.{key}={index_config[key]!r}: use one of {allowed}.")
  options = dict(searcher=index_config.searcher, dtype=index_config.dtype)
  for name, searcher in SEARCHERS.items():
    if not searcher.config_keys:
      continue
    settings = dict(index_config.get(name) or {})  # absent in configs written before it existed
    unknown = sorted(set(settings) - set(searcher.config_keys))
    if unknown:
      raise ValueError(f"Unknown config.index.{name} setting(s) {unknown}: use "
                       f"{searcher.config_keys}.")
    for key, value in settings.items():
      config_checks.whole_number(f"--config.index.{name}.{key}", value, 0, None,
                                 " (0: DocIndex's default)")
    if name == index_config.searcher:
      options.update({key: value for key, value in settings.items() if value})
  return options
