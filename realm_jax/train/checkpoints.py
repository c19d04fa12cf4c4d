"""Orbax checkpoints of a training run: the train state, the data iterator's position and a JSON
record (index version, config) saved together, asynchronously, keeping the last N.

A run resumes from its work directory by itself: `restore_latest` returns the newest complete
step (orbax finalises a step by an atomic rename, or in GCS by writing a commit_success file last,
so a run killed while saving leaves at worst an ignored unfinished step). Orbax takes gs://
directories itself: arrays through TensorStore's GCS driver, the rest through etils.epath.
"""

from __future__ import annotations

import logging
import os

import grain
import grain.checkpoint  # noqa: F401
import jax
import orbax.checkpoint as ocp

from realm_jax.io_utils import absolute, as_path, read_json


def checkpoint_manager(directory: str, keep: int = 3, asynchronous: bool = True,
                       data: bool = True) -> ocp.CheckpointManager:
  handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
  if data:
    handlers["data"] = grain.checkpoint.CheckpointHandler()
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                         enable_async_checkpointing=asynchronous)
  return ocp.CheckpointManager(absolute(directory), options=options, item_handlers=handlers)


def save(manager: ocp.CheckpointManager, step: int, state, meta: dict, data_iterator=None,
         force: bool = False) -> bool:
  items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
  if data_iterator is not None:
    items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
  return manager.save(step, args=ocp.args.Composite(**items), force=force)


def restore_latest(manager: ocp.CheckpointManager, state, data_iterator=None):
  """(state, meta) of the newest checkpoint, restoring `data_iterator` in place; None if none.

  `state` is a template with the shapes and shardings to restore into. A checkpoint made with
  another model config is a clear error.
  """
  step = manager.latest_step()
  if step is None:
    return None
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  items = {"state": ocp.args.StandardRestore(abstract), "meta": ocp.args.JsonRestore()}
  if data_iterator is not None:
    items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
  try:
    restored = manager.restore(step, args=ocp.args.Composite(**items))
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(
        f"The checkpoint at {manager.directory}/{step} does not fit this run's model ({e}). It was "
        "probably made with another config: use another --workdir, or the config it was made "
        "with.") from e
  logging.info("Restored step %d from %s", step, manager.directory)
  return restored["state"], restored["meta"]


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
