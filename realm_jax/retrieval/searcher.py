"""What a searcher of the index is, and the registry `DocIndex` builds them from by name.

A searcher answers top-k inner-product queries over the rows of one [N, D] embedding matrix (given
as an array or as `HostRows`, realm_jax/retrieval/rows.py, read a slice at a time). It
knows nothing of block ids, files or configs: `DocIndex` (realm_jax/retrieval/index.py) maps ids to
rows, checks queries, k and exclusions before calling it, and saves and loads the index.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import numpy as np

from realm_jax.retrieval.exact import ApproxSearcher, ExactSearcher
from realm_jax.retrieval.scann_searcher import ScannSearcher


class Searcher(Protocol):
  """Top-k maximum-inner-product search, built as `cls(embeddings, dtype, mesh, **options)`:
  the [N, D] float rows (an array or `HostRows`), their storage `np.dtype`, a `Mesh` or None, and
  its own settings.

  To add a searcher: write its class in its own file (exact.py shows the shape), then add it to
  SEARCHERS below under the name that `--config.index.searcher` will take.
  """

  on_device: ClassVar[bool]  # its rows live in device memory (train/memory.py counts them there)
  needs_finite_rows: ClassVar[bool]  # it cannot index NaN or infinite rows: DocIndex refuses them
  # Its whole-number settings under config.index.<name> (0: its default), read by index_options.
  config_keys: ClassVar[tuple[str, ...]]

  def search(self, queries: np.ndarray, k: int,
             exclude_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The k best rows of each query.

    Args:
      queries: [Q, D] float32, Q >= 1; values may be NaN or infinite (a diverged model's).
      k: results per query, at most N minus the rows excluded for any query.
      exclude_rows: [Q, E] int32 rows never to return for that query (-1: nothing).

    Returns:
      scores [Q, k] float32 in descending order and their rows [Q, k] (integers); never an
      excluded row, and non-finite scores rank below every finite one (`exact.finite_scores`).
    """

  def embeddings(self) -> np.ndarray:
    """The stored [N, D] rows on the host, in the storage dtype."""

  def rows(self, lo: int, hi: int) -> np.ndarray:
    """The stored rows [lo, hi) on the host, in the storage dtype (`DocIndex.save` writes an
    index a slice at a time)."""


SEARCHERS: dict[str, type[Searcher]] = {
    "exact": ExactSearcher,
    "approx": ApproxSearcher,
    "scann": ScannSearcher,
}
