"""A run's scalars: TensorBoard events in `workdir/tb` and JSON lines in `workdir/metrics.jsonl`,
in a local or a gs:// work directory.

Objects in GCS cannot be appended to. So `metrics.jsonl` is rewritten whole at each log (atomically:
see realm_jax/io_utils.py) from the lines kept in memory, which start as those of the file that was
there (a resumed run continues the same history, as appending did; a few hundred bytes per log),
and TensorBoard event files on gs:// are rewritten whole at each flush (scalars only: small).
tensorboardX writes events from a background thread, so as locally an event reaches the file at
that thread's next flush (within two minutes) or when the writer closes.
"""

from __future__ import annotations

import io
import json
import os
import sys
import uuid

from realm_jax import io_utils

METRICS = "metrics.jsonl"
TENSORBOARD = "tb"


class _ObjectRecordFile:
  """An event file for tensorboardX's RecordWriter in an object store, written through
  etils.epath (tf.io.gfile or gcsfs): the bytes stay in memory and each flush uploads them all."""

  def __init__(self, path: str):
    self._path, self._data = path, io.BytesIO()

  def write(self, data: bytes) -> None:
    self._data.write(data)

  def flush(self) -> None:
    io_utils.write_bytes(self._path, self._data.getvalue())

  def close(self) -> None:
    self.flush()


class _ObjectRecordFactory:
  """tensorboardX's writer factory interface (`open`, `directory_check`) for gs:// log dirs."""

  def open(self, path: str) -> _ObjectRecordFile:
    return _ObjectRecordFile(path)

  def directory_check(self, path: str) -> None:
    del path  # an object store has no directories to create


def _summary_writer_class():
  """tensorboardX's SummaryWriter, imported without PyTorch. tensorboardX imports torch whenever
  it is installed (the test and demo extras install it), ~1 s of every run's start, only to accept
  torch tensors; the values written here are floats. A torch imported already is left alone."""
  hide = "torch" not in sys.modules
  if hide:
    sys.modules["torch"] = None  # `import torch` raises ImportError: tensorboardX goes without
  try:
    from tensorboardX import SummaryWriter
  finally:
    if hide:
      del sys.modules["torch"]
  return SummaryWriter


def _summary_writer(logdir: str, purge_step: int | None = None):
  """tensorboardX's writer; `purge_step`: TensorBoard hides the events of earlier files from that
  step on (those of a run that stopped after its last checkpoint)."""
  SummaryWriter = _summary_writer_class()  # noqa: N806 (a class)
  if logdir.startswith("gs://"):
    from tensorboardX import record_writer
    io_utils.as_path(logdir)  # a clear error now if there is no gs:// backend
    # tensorboardX's own gs:// writer needs google-cloud-storage; this one uses epath's backend.
    record_writer.register_writer_factory("gs", _ObjectRecordFactory())
  # Event files are named by the second and the host: a random suffix keeps a writer started
  # within the same second from replacing the file of the one before.
  return SummaryWriter(logdir, filename_suffix=f".{uuid.uuid4().hex[:8]}", purge_step=purge_step)


class MetricsWriter:
  """Writes a run's scalars; `write` on the first host only (the trainers see to it)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, METRICS)
    self.logdir = os.path.join(workdir, TENSORBOARD)
    self._tb = None
    self._text: list[str] | None = None  # metrics.jsonl: what was there, then one line a write
    self._drop_from: int | None = None

  def resume_at(self, step: int) -> None:
    """The run resumed from `step`'s checkpoint: rows of later steps in metrics.jsonl were logged
    by a run that stopped before checkpointing them, and go (this run logs those steps again);
    TensorBoard is told to hide their events. At step 0 (no checkpoint: the run starts over and
    evaluates its starting point again) the rows of step 0 go too."""
    # The first step whose rows this run logs again (None: not resumed).
    self._drop_from = int(step) + 1 if step else 0

  def write(self, step: int, metrics: dict[str, float], split: str) -> None:
    """Adds `metrics` of `step` as TensorBoard scalars `split/name` and one line of
    metrics.jsonl: {"step": step, "split": split, **metrics}."""
    if self._tb is None:
      self._tb = _summary_writer(self.logdir, self._drop_from)
    for k, v in metrics.items():
      self._tb.add_scalar(f"{split}/{k}", v, step)
    self._tb.flush()
    if self._text is None:
      path = io_utils.as_path(self.path)
      old = path.read_text() if path.exists() else ""
      # A line cut short by a run killed while appending (before this writer) stays on its own.
      self._text = [line if line.endswith("\n") else line + "\n"
                    for line in old.splitlines(keepends=True) if not self._later(line)]
    self._text.append(json.dumps({"step": step, "split": split, **metrics}) + "\n")
    io_utils.write_text(self.path, "".join(self._text))

  def _later(self, line: str) -> bool:
    """Whether a row of metrics.jsonl is of a step this run logs again (`_drop_from` on)."""
    if self._drop_from is None:
      return False
    try:
      return int(json.loads(line)["step"]) >= self._drop_from
    except (ValueError, TypeError, KeyError):  # not a row: kept as it was
      return False

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
      self._tb = None
