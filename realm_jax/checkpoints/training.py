"""Orbax checkpoints of a training run: the train state, the data iterator's position and a JSON
record (index version, config) saved together, asynchronously, keeping the last N. The trainers
write them; the index refresher and the open-QA system (the model kept in best/) read them too,
so they sit below train/ and eval/.

A run resumes from its work directory by itself: `restore_latest` returns the newest complete
step (orbax finalises a step by an atomic rename, or in GCS by writing a commit_success file last,
so a run killed while saving leaves at worst an ignored unfinished step). Orbax takes gs://
directories itself: arrays through TensorStore's GCS driver, the rest through etils.epath.

A finished step can still be damaged afterwards (a file deleted, truncated or with bytes changed,
a disk or bucket mishap). Each step's meta records the CRC-32 of every array of the state as it
was saved, and a restore checks the arrays it read against it: a file whose bytes changed can
still decode (orbax's compression carries no checksum) into other numbers, NaN among them.
`restore_latest` falls back to the newest step that reads and matches its CRCs (a step saved
before the CRCs were recorded is taken as it reads), and moves the damaged ones to
`<directory>-damaged/<step>-<time>`: never deleted, but out of orbax's sight, so that neither the
next resume nor the index refresher takes them for the latest, orbax's max_to_keep does not count
or delete them, and the run saves those steps afresh as it gets there. A checkpoint of another
model (another config) is an error, never passed over.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import time
import zlib

import grain
import grain.checkpoint  # noqa: F401
import jax
import numpy as np
import orbax.checkpoint as ocp

from realm_jax import distributed
from realm_jax.io_utils import absolute, as_path, read_json


def checkpoint_manager(directory: str, keep: int = 3, asynchronous: bool = True,
                       data: bool = True) -> ocp.CheckpointManager:
  handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
  if data:
    handlers["data"] = grain.checkpoint.CheckpointHandler()
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                         enable_async_checkpointing=asynchronous)
  return ocp.CheckpointManager(absolute(directory), options=options, item_handlers=handlers)


# The meta key that holds the CRC-32 of each array of the state saved, by its path.
CRC_KEY = "state_crc32"


def save(manager: ocp.CheckpointManager, step: int, state, meta: dict, data_iterator=None,
         force: bool = False) -> bool:
  """Saves `state`, `meta` (with the CRC-32 of each array of `state` added under CRC_KEY) and the
  data iterator's position as checkpoint `step`; False when the manager skips the step."""
  meta = {**meta, CRC_KEY: state_crc32(state)}
  items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
  if data_iterator is not None:
    items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
  return manager.save(step, args=ocp.args.Composite(**items), force=force)


def restore_latest(manager: ocp.CheckpointManager, state, data_iterator=None, *,
                   set_aside: bool = True, hint: str = ""):
  """(state, meta) of the newest usable checkpoint, restoring `data_iterator` in place; None if
  there is no checkpoint. `meta` is what `save` was given (without CRC_KEY).

  `state` is a template with the shapes and shardings to restore into. A damaged checkpoint
  (files missing or unreadable, or arrays that read but differ from the CRC-32 recorded when it
  was saved) is passed over, with one warning line, for the one before it; with `set_aside` (a
  run that goes on writing there) the damaged ones are then moved aside (see the module
  docstring), else left as they are (a reader). Raises ValueError, changing nothing, when
  a checkpoint was made for another model (another config), or when none of them reads (naming
  the directory and each one's problem, then `hint`: what the user can do).
  """
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  items = {"state": ocp.args.StandardRestore(abstract), "meta": ocp.args.JsonRestore()}
  if data_iterator is not None:
    items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
  damaged = []  # (step, problem), newest first
  previous = sys.unraisablehook
  sys.unraisablehook = _dropping_late_reads(previous)
  asyncio_log = logging.getLogger("asyncio")
  asyncio_log.addFilter(_LATE_READS)  # (once: a logger holds a filter once)
  try:
    for step in sorted(manager.all_steps(), reverse=True):
      restored, meta, problem = _read(manager, step, abstract, items)
      # Every host goes on with the same step (they read the same files, but not all of them).
      if not distributed.allgather_rows(np.array([problem is None], np.int8)).all():
        damaged.append((step, problem or "unreadable on another host"))
        continue
      if damaged:
        _passed_over(manager, damaged, step, set_aside)
      logging.info("Restored step %d from %s", step, manager.directory)
      return restored, meta
  finally:
    if not damaged:  # every read succeeded: none can call back late
      sys.unraisablehook = previous
      asyncio_log.removeFilter(_LATE_READS)
  if not damaged:
    return None
  listed = "; ".join(f"step {s}: {p}" for s, p in damaged)
  raise ValueError(
      f"No checkpoint in {manager.directory} can be read ({listed}). Nothing was changed. "
      + (hint or f"Restore {manager.directory} from a backup, or move it away to start the run "
         "from step 0."))


def _read(manager: ocp.CheckpointManager, step: int, abstract, items: dict):
  """(state, meta without CRC_KEY, None) of checkpoint `step`, or (None, None, why it is
  damaged); ValueError when it holds another model (see _unreadable_or_misfit)."""
  problem = _unreadable_or_misfit(manager, step, abstract)
  if problem is not None:
    return None, None, problem
  try:
    restored = manager.restore(step, args=ocp.args.Composite(**items))
  except Exception as e:  # noqa: BLE001  (orbax wraps TensorStore's errors in Exception)
    if _read_error(e) is None:
      raise
    return None, None, _reason(_read_error(e))  # the model fits: a file is missing or unreadable
  meta = dict(restored["meta"])
  problem = _crc_mismatch(meta.pop(CRC_KEY, None), restored["state"])
  return (None, None, problem) if problem else (restored["state"], meta, None)


def _unreadable_or_misfit(manager: ocp.CheckpointManager, step: int, abstract) -> str | None:
  """Why checkpoint `step` is damaged by its saved tree (None: its tree reads and fits);
  ValueError when it reads but holds another model: that is the user's config, not damage."""
  try:
    saved = manager.item_metadata(step)["state"]
  except _READ_ERRORS as e:
    return _reason(e)
  if saved is None:  # no tree metadata (orbax restores without it): the restore tells
    return None
  misfit = _misfit(getattr(saved, "tree", saved), abstract)
  if misfit:
    raise ValueError(
        f"The checkpoint at {manager.directory}/{step} does not fit this run's model ({misfit}). "
        "It was probably made with another config: use another --workdir, or the config it was "
        "made with.")
  return None


def _misfit(saved, abstract) -> str:
  """How the arrays of a saved tree differ from the model's ("" when their paths and shapes
  agree; dtypes are orbax's to cast)."""
  def shapes(tree):
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(_key_name(k) for k in path): tuple(leaf.shape) for path, leaf in leaves}

  have, want = shapes(saved), shapes(abstract)
  missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
  some = lambda keys: ", ".join(keys[:2]) + (", ..." if len(keys) > 2 else "")
  if missing or extra:
    return "; ".join(
        ([f"{len(missing)} of the model's arrays are not there ({some(missing)})"] if missing
         else []) +
        ([f"it holds {len(extra)} arrays the model lacks ({some(extra)})"] if extra else []))
  differ = [k for k in want if want[k] != have[k]]
  return f"{differ[0]} is {have[differ[0]]} there, {want[differ[0]]} here" if differ else ""


def state_crc32(state) -> dict[str, str]:
  """{path: CRC-32 as 8 hex digits} of each array of `state` as this host holds it: the whole
  array when it is replicated or on this host's devices alone (the trainers' state is replicated);
  an array split over hosts is left out, each host holding other bytes of it."""
  crcs = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    if isinstance(leaf, jax.Array):
      if leaf.is_fully_replicated:
        leaf = leaf.addressable_data(0)
      elif not leaf.is_fully_addressable:
        continue
    data = np.ascontiguousarray(np.asarray(leaf)).reshape(-1).view(np.uint8)
    crcs["/".join(_key_name(k) for k in path)] = f"{zlib.crc32(data):08x}"
  return crcs


def _crc_mismatch(saved: dict | None, restored) -> str | None:
  """Why the arrays restored are not those saved (None: they are, or no CRCs were recorded)."""
  if not saved:
    return None
  read = state_crc32(restored)
  differ = sorted(k for k in saved.keys() & read.keys() if saved[k] != read[k])
  if not differ:
    return None
  return (f"{len(differ)} of its arrays read other bytes than were saved, by the CRC-32 recorded "
          f"then ({', '.join(differ[:2])}{', ...' if len(differ) > 2 else ''})")


def partial_read_problem(step_dir: str, restored: dict) -> str | None:
  """Why `restored`, a part of checkpoint `step_dir`'s state read by itself (e.g. the retriever's
  parameters alone, {"params": {"retriever": ...}}), is not what was saved, by the CRC-32 its
  meta recorded; None when it is, or when none were recorded."""
  try:
    meta = read_json(os.path.join(step_dir, "meta", "metadata"))
  except (OSError, ValueError) as e:
    return f"its meta does not read ({e})"
  return _crc_mismatch(meta.get(CRC_KEY), restored)


def _key_name(key) -> str:
  """A tree key as orbax names it on disk (dict key, attribute name or sequence index)."""
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


# What reading a damaged checkpoint raises: files missing (OSError), unreadable or cut short
# (TensorStore's ValueError), metadata that does not parse (ValueError, KeyError, TypeError).
_READ_ERRORS = (OSError, ValueError, KeyError, TypeError)


def _read_error(e: BaseException) -> BaseException | None:
  """The first read error in the chain of `e` (orbax raises a bare Exception from it); None when
  there is none: then `e` is not about the checkpoint's files."""
  while e is not None:
    if isinstance(e, _READ_ERRORS):
      return e
    e = e.__cause__ or e.__context__
  return None


def _dropping_late_reads(previous):
  """`previous` (a sys.unraisablehook) without the noise of a failed read: when one read fails
  (of the arrays, or of their metadata: one per array), orbax closes its event loop while
  TensorStore's other reads are under way, and each of them, done, calls back into the closed
  loop; Python prints that RuntimeError's traceback at any time up to the exit, around the one
  clear warning. A read still waiting is closed with the loop instead, and orbax turns the
  GeneratorExit it gets into an Exception ("Encountered error while reading array index"), which
  Python prints the same way. Every other unraisable exception still prints."""
  if getattr(previous, "drops_late_reads", False):
    return previous

  def hook(unraisable):
    e = unraisable.exc_value
    late = isinstance(e, RuntimeError) and str(e) == "Event loop is closed"
    closed = (inspect.iscoroutine(unraisable.object) and isinstance(e, Exception)
              and isinstance(e.__cause__, GeneratorExit))
    if not (late or closed):
      previous(unraisable)

  hook.drops_late_reads = True
  return hook


class _LateReadsFilter(logging.Filter):
  """Drops asyncio's "... exception was never retrieved" records of a failed checkpoint read: when
  one read fails, orbax gives up on the others gathered with it, and the gathering futures that
  hold their errors are logged with a traceback (pages of TensorStore spec) whenever the garbage
  collector finalises them, up to the exit. The warning that names the damaged step is the
  report; every other asyncio record still shows."""

  def filter(self, record: logging.LogRecord) -> bool:
    e = record.exc_info[1] if record.exc_info else None
    return not ("exception was never retrieved" in str(record.msg)
                and e is not None and _read_error(e) is not None)


_LATE_READS = _LateReadsFilter()


def _reason(e: BaseException) -> str:
  """An exception as a short clause: TensorStore's errors end in pages of JSON spec."""
  text = " ".join(str(e).split("[tensorstore_spec")[0].split())
  return f"{type(e).__name__}: {text[:300]}"


def _passed_over(manager: ocp.CheckpointManager, damaged: list[tuple[int, str]], used: int,
                 set_aside: bool) -> None:
  """Warns about the damaged steps newer than the `used` one; moves them aside if `set_aside`."""
  aside = as_path(f"{manager.directory}-damaged")
  stamp = time.strftime("%Y%m%dT%H%M%S")
  for step, problem in damaged:
    where = manager.directory / str(step)
    if set_aside:
      to = aside / f"{step}-{stamp}"
      if jax.process_index() == 0:
        try:
          aside.mkdir(parents=True, exist_ok=True)
          where.rename(to)
        except OSError as e:
          raise OSError(f"Could not move the damaged checkpoint {where} to {to} ({e}): move it "
                        "yourself, then resume.") from e
      fate = (f"it is kept at {to} (delete it when you no longer need it); step {step} is saved "
              "again when the run gets there")
    else:
      fate = "it is left as it is"
    logging.warning("The checkpoint %s is damaged (%s): step %d is used instead; %s.",
                    where, problem, used, fate)
  if set_aside:
    distributed.sync("realm_jax:damaged_checkpoints")
    manager.reload()  # orbax forgets the moved steps


def indexes_in_use(directory: str) -> set[str]:
  """The index paths that the checkpoints in `directory` name (what a resume would load): none
  of them may be pruned.

  Reads each finished checkpoint's small meta item as a file (`<step>/meta/metadata`, orbax's
  layout for the JSON item saved as "meta"), not through a CheckpointManager: creating one is a
  collective across hosts, and this runs on the first host only.
  """
  root = as_path(directory)
  if not root.is_dir():
    return set()
  paths = set()
  for step_dir in root.iterdir():
    if not step_dir.name.isdigit():  # orbax's temporary directories have other names
      continue
    try:
      meta = read_json(os.path.join(directory, step_dir.name, "meta", "metadata"))
    except (OSError, ValueError) as e:  # unfinished (gs://) or being deleted by the trainer
      logging.info("No meta in checkpoint %s/%s (%s).", directory, step_dir.name, e)
      continue
    if isinstance(meta, dict) and meta.get("index_path"):
      paths.add(meta["index_path"])
  return paths
