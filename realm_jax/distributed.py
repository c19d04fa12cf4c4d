"""Several hosts (processes) on one job: start-up, barriers and host-level gathers.

On a TPU pod every worker runs the same command; `initialize` finds the peers by itself. Elsewhere
(several GPU machines, or several processes on one CPU machine as the tests do) give the coordinator
and the process count and id, by config or by environment:

    REALM_COORDINATOR_ADDRESS=10.0.0.1:1234 REALM_NUM_PROCESSES=2 REALM_PROCESS_ID=0 python ...

With one process every function here is a no-op (or the identity), so single-host code paths stay
the same code.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

import jax
import numpy as np

T = TypeVar("T")
_ENV = {"coordinator_address": "REALM_COORDINATOR_ADDRESS", "num_processes": "REALM_NUM_PROCESSES",
        "process_id": "REALM_PROCESS_ID"}


def initialize(coordinator_address: str = "", num_processes: int = 0, process_id: int = -1) -> None:
  """`jax.distributed.initialize`, with settings from the arguments, else REALM_* variables, else
  JAX's own detection (TPU pods, SLURM, ...). Must run before any other JAX call."""
  if jax.distributed.is_initialized():
    return
  kwargs = {}
  for name, value, unset in (("coordinator_address", coordinator_address, ""),
                             ("num_processes", num_processes, 0), ("process_id", process_id, -1)):
    if value == unset and os.environ.get(_ENV[name]):
      raw = os.environ[_ENV[name]]
      try:
        value = raw if name == "coordinator_address" else int(raw)
      except ValueError:
        raise ValueError(f"{_ENV[name]}={raw!r} is not an integer.") from None
    if value != unset:
      kwargs[name] = value
  # CPU processes need a collectives backend to talk to each other (TPU/GPU have their own).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(**kwargs)
  logging.info("Process %d of %d: %d local / %d global devices", jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())


def sync(name: str) -> None:
  """A barrier over all processes (no-op with one)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def first_host_first(name: str, fn: Callable[[], T]) -> T:
  """Runs `fn` on process 0, then (after a barrier) on the others: for work that writes shared
  files (building a corpus), which the others then only open."""
  if jax.process_index() == 0:
    out = fn()
    sync(name)
    return out
  sync(name)
  return fn()


def allgather_rows(x: np.ndarray) -> np.ndarray:
  """Every host's [n, ...] rows, concatenated in process order ([hosts * n, ...]) on every host."""
  if jax.process_count() == 1:
    return np.asarray(x)
  from jax.experimental import multihost_utils
  x = np.ascontiguousarray(x)
  # Gathered as raw bytes: JAX would narrow int64 block ids to int32 (x64 is off).
  raw = x.reshape(len(x), -1).view(np.uint8)  # [n, bytes per row]
  out = np.asarray(multihost_utils.process_allgather(raw, tiled=True))
  return out.view(x.dtype).reshape((-1,) + x.shape[1:])


def host_rows(x: np.ndarray, rows_per_host: int) -> np.ndarray:
  """This host's rows of an array laid out in process order (as `allgather_rows` returns)."""
  lo = jax.process_index() * rows_per_host
  return x[lo:lo + rows_per_host]
