"""The asynchronous index refresher (experiments/refresh_index.py), REALM's index-builder job.

Runs beside a trainer on the same work directory: watches `workdir/checkpoints`, and for each
checkpoint newer than the newest published index, restores only the retriever's weights,
re-embeds the corpus with the document tower and publishes `workdir/index/index-<step>`
atomically. The trainer (config.index.refresh = "async") swaps in each finished index between
steps. A refresher killed mid-write leaves only an ignored temporary directory. It holds the work
directory's `refresher.lock`, not the trainer's `run.lock` (realm_jax/workdir_lock.py): one
refresher per work directory.
"""

from __future__ import annotations

import json
import logging
import os
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from realm_jax import workdir_lock
from realm_jax.io_utils import absolute, as_path, read_json
from realm_jax.retrieval.index import index_options
from realm_jax.retrieval.index_store import index_step, latest_index_dir
from realm_jax.checkpoints import training as checkpoints
from realm_jax.train.init import build_models
from realm_jax.train.loop import config_diff
from realm_jax.train.pretrain_workdir import FIXED_SETTINGS, open_data
from realm_jax.train.refresh import DocumentEmbedder, refresh


def read_retriever_params(checkpoint_dir: str, step: int) -> dict:
  """The retriever parameters of checkpoint `step` (host numpy).

  Only they are read (not the encoder or the optimiser state), as numpy arrays: the refresher
  usually sees other devices than the trainer that saved the checkpoint (its own VM, or one GPU
  beside a trainer on all the others), so the saved shardings mean nothing here. Raises
  DamagedCheckpointError when they differ from the CRC-32 recorded when it was saved.
  """
  path = os.path.join(absolute(checkpoint_dir), str(step), "state")
  tree = ocp.StandardCheckpointer().metadata(path).item_metadata
  tree = getattr(tree, "tree", tree)
  try:
    wanted = {"params": {"retriever": tree["params"]["retriever"]}}
  except (KeyError, TypeError) as e:
    raise ValueError(f"{path} holds no params/retriever: not a pre-training checkpoint.") from e
  as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted)
  restored = ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(
      item=wanted, restore_args=as_numpy, partial_restore=True))
  problem = checkpoints.partial_read_problem(os.path.dirname(path), restored)
  if problem:
    raise DamagedCheckpointError(f"Checkpoint {step} in {checkpoint_dir} is damaged: {problem}.")
  return restored["params"]["retriever"]


class DamagedCheckpointError(ValueError):
  """A checkpoint whose retriever parameters read other bytes than were saved."""


# The trainer's settings that decide what an index holds: the retriever's shapes, the corpus and
# its examples (which `open_data` builds), and the block length the blocks are embedded at.
_SAME_AS_TRAINER = tuple(k for k in FIXED_SETTINGS if k != "retriever_learning_rate") + (
    "doc_length",)


def check_trainer_config(config, workdir: str) -> bool:
  """Refuses a config whose index settings differ from the trainer's `workdir/config.json` (its
  checkpoints would not load into these towers, or its indexes would embed other blocks, or the
  same blocks otherwise). Returns False when the trainer has not written its config yet."""
  path = os.path.join(workdir, "config.json")
  if not as_path(path).exists():
    return False
  diff = config_diff(read_json(path), json.loads(config.to_json()), _SAME_AS_TRAINER)
  if diff:
    raise ValueError(
        f"The trainer in {workdir} runs with another config than this refresher ((setting, "
        f"trainer, refresher): {diff}). Start the refresher with the trainer's --config and "
        "--flagfile.")
  return True


# A refresher is often started together with its trainer (`pretrain.py ... &`, or tpu/launch.sh
# then tpu/refresher.sh), which writes config.json once it has started: seconds here, minutes on
# a TPU pod (its hosts find each other, weights come from gs://). That long it is waited for, not
# forever: a misspelt --workdir is refused, not watched.
CONFIG_WAIT_S = 300.0
# While no new checkpoint comes, the refresher says what it waits for this often (not each poll).
REMIND_EVERY_S = 300.0


def wait_for_trainer_config(config, workdir: str, wait_s: float) -> None:
  """Returns once the trainer's `workdir/config.json` is there and agrees with `config` (see
  `check_trainer_config`), waiting up to `wait_s` seconds for a trainer that is starting.

  Raises:
    FileNotFoundError naming --workdir when no config.json comes: no trainer runs there.
  """
  path = os.path.join(workdir, "config.json")
  deadline = time.monotonic() + wait_s
  if check_trainer_config(config, workdir):
    return
  logging.info("No trainer config %s yet: waiting up to %.0f s for experiments/pretrain.py on "
               "this --workdir to write it (a misspelt --workdir: stop and fix it).", path, wait_s)
  while (left := deadline - time.monotonic()) > 0:
    time.sleep(min(1.0, left))
    if check_trainer_config(config, workdir):
      return
  raise FileNotFoundError(
      f"--workdir={workdir}: no pre-training run there ({path} did not appear in {wait_s:.0f} s). "
      "Start experiments/pretrain.py with the same flags first (or together with this, with "
      "--config.index.refresh=async), or fix --workdir.")


def _waiting_for(ckpt_dir: str, indexed: int, newest: int | None, config) -> str:
  """What the refresher waits for, as a log line (`indexed`: the newest index's step, -1: none)."""
  wanted = ("the trainer's first checkpoint" if indexed < 0 else
            f"a checkpoint after step {indexed} (the newest index's)")
  found = "none yet" if newest is None else f"the newest is step {newest}"
  line = (f"Waiting for {wanted} in {ckpt_dir} ({found}; the trainer saves one every "
          f"{config.checkpoint_every} steps).")
  if indexed >= config.num_steps:
    line += (f" The run ends at step {config.num_steps}: nothing more comes unless it is resumed "
             "with more steps (--stop_after_idle_s stops the refresher by itself).")
  return line


def run_refresher(config, workdir: str, *, poll_seconds: float = 10.0,
                  max_refreshes: int | None = None, stop_after_idle_s: float | None = None) -> int:
  """Publishes an index for each new checkpoint; returns how many it published.

  Stops after `max_refreshes` indexes, or after `stop_after_idle_s` seconds without a new
  checkpoint (None: runs until killed, like REALM's index builder). Refuses a work directory in
  which no trainer writes its config within CONFIG_WAIT_S seconds.
  """
  # Bad settings, and a work directory without a trainer, fail before minutes of corpus and
  # examples.
  options = index_options(config.index)
  wait_for_trainer_config(config, workdir, CONFIG_WAIT_S)
  # Beside the trainer (which holds the run lock), but one refresher per work directory.
  with workdir_lock.hold(workdir, workdir_lock.REFRESHER):
    models, _, vocab = build_models(config)
    corpus, tokenizer, _ = open_data(config, workdir, vocab)
    embedder = DocumentEmbedder(models, corpus, tokenizer, config.doc_length,
                                config.index.embed_batch_size)
    root = os.path.join(workdir, "index")
    ckpt_dir = os.path.join(workdir, "checkpoints")
    published, idle_since, manager = 0, time.monotonic(), None
    said_at = None  # when it last said what it waits for; None: not since the last index
    damaged = set()  # steps whose retriever read other bytes than were saved
    while max_refreshes is None or published < max_refreshes:
      if manager is None and as_path(ckpt_dir).is_dir():
        manager = ocp.CheckpointManager(absolute(ckpt_dir),
                                        options=ocp.CheckpointManagerOptions(read_only=True))
      if manager is not None:
        manager.reload()  # only finalised checkpoints count: a half-written one is invisible
      newest = None if manager is None else manager.latest_step()
      indexed = index_step(latest_index_dir(root))
      if newest is not None and newest > indexed and newest not in damaged:
        start = time.perf_counter()
        try:
          params = read_retriever_params(ckpt_dir, newest)
        except DamagedCheckpointError as e:  # no index from it; the trainer sets it aside
          logging.warning("%s Not indexed: waiting for the next checkpoint.", e)
          damaged.add(newest)
          continue
        _, path = refresh(root, embedder, params, newest, options,
                          keep=int(config.index.get("keep", 0)),
                          protect=lambda: checkpoints.indexes_in_use(ckpt_dir))
        published += 1
        idle_since, said_at = time.monotonic(), None
        logging.info("Published %s (checkpoint step %d) in %.1f s", path, newest,
                     time.perf_counter() - start)
        continue
      if stop_after_idle_s is not None and time.monotonic() - idle_since > stop_after_idle_s:
        break
      if said_at is None or time.monotonic() - said_at >= REMIND_EVERY_S:
        logging.info("%s", _waiting_for(ckpt_dir, indexed, newest, config))
        said_at = time.monotonic()
      time.sleep(poll_seconds)
    return published
