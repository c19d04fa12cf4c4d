"""Builds a TFDS dataset once per data directory, whatever number of processes ask for it.

TFDS writes a dataset into `<config>/incomplete.<random>_<version>/` and renames it into place when
complete. Two processes building the same dataset at once (say `build_index.py` and a pre-training
run started on the same data directory) would both do the whole work; a build that is killed leaves
its `incomplete.*` folder behind for good (the next one starts over in a new one). So `prepare`
holds an exclusive lock beside the dataset while it builds: a second process waits, then finds the
dataset built; and under the lock no other build is running, so `incomplete.*` folders are left by
killed builds and are deleted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator

import tensorflow_datasets as tfds
import tensorflow_datasets.core  # noqa: F401  (tfds.core is not imported by the package itself)

from realm_jax.io_utils import is_remote

LOCK = ".realm_jax-build.lock"


class LocalDatasetInfo(tfds.core.DatasetInfo):
  """The DatasetInfo of a dataset that realm_jax builds itself: it is never in TFDS's public
  bucket, so the lookup there is skipped. (Making a builder whose dataset is not built yet looks
  it up, and TFDS makes an empty temporary directory for that lookup each time and leaves it: a
  test suite's run left ~110 of them in the temporary directory.)"""

  def initialize_from_bucket(self) -> None:
    pass


@contextlib.contextmanager
def exclusive_lock(path: str, what: str) -> Iterator[None]:
  """Holds an exclusive lock on the local file `path` (made if missing) while the block runs,
  waiting (and saying so) while another process holds it. The system releases the lock when its
  holder ends, so a killed process never leaves it held."""
  import fcntl  # POSIX: Linux and macOS, where realm_jax runs

  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "a") as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      logging.info("Waiting for another process building %s (it holds %s).", what, path)
      fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def prepare(make_builder: Callable[[], object], what: str):
  """`make_builder()` (a TFDS builder), with its dataset built.

  The builder is made again once the lock is held: a builder reads the dataset info that is there
  when it is made, and another process may have finished the dataset meanwhile.
  """
  builder = make_builder()
  if builder.is_prepared():
    return builder
  version_dir = os.fspath(builder.data_dir)
  if is_remote(version_dir):  # no lock in an object store: TFDS builds it there as it is
    builder.download_and_prepare()
    return builder
  config_dir, version = os.path.split(version_dir.rstrip("/"))
  with exclusive_lock(os.path.join(config_dir, LOCK), what):
    builder = make_builder()
    if not builder.is_prepared():
      leftover = re.compile(r"incomplete\.[A-Z0-9]+_" + re.escape(version))
      for name in sorted(os.listdir(config_dir)):
        if leftover.fullmatch(name):
          logging.warning("Deleting %s, left by a build of %s that did not finish.",
                          os.path.join(config_dir, name), what)
          shutil.rmtree(os.path.join(config_dir, name))
      builder.download_and_prepare()
  return builder
