"""A trace of a few training steps, and where their time went.

With `config.profile_steps` > 0 the training loop (realm_jax/train/loop.py) records a
`jax.profiler` trace of steps profile_start .. profile_start + profile_steps - 1 (or the run's
last): batch making, retrieval and the jitted step, into `<workdir>/tb/plugins/profile/<time>/`,
which TensorBoard's Profile tab opens (and https://ui.perfetto.dev, from
`perfetto_trace.json.gz`). When the last of them is done it logs the wall time and CPU cores busy
per step, and the XLA operations that took the most time, summed over the threads (or devices)
that ran them. The pre-training demo's, on 2 AMD EPYC cores (`--config.profile_start=8
--config.profile_steps=6`):

    Profile of steps 8-13 (6 steps): 2,546 ms a step, 1.93 CPU cores busy; trace in ...
      ynn_fusion                          2,183.6 ms a step  64.2%  (1,490 calls)
      copy_bitcast_fusion                   151.3 ms a step   4.4%  (477 calls)
      ...

Op kinds are the HLO names without their number (`ynn_fusion.675` -> `ynn_fusion`), so the
table reads as "matmuls vs element-wise fusions vs copies"; the trace itself has each one.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import logging
import os
import re
import time

import jax

# An HLO operation's name ("ynn_fusion.675", "all-reduce", "dot"); the runtime's own events on
# the same threads ("ThunkExecutor::Execute", "Wait: pending_threads=3/8", "end: dot.2") are not.
_HLO_NAME = re.compile(r"^[a-z][a-z0-9_\-]*(\.\d+)?$")
# Operations that only run others (their bodies' operations are counted themselves).
_CONTAINERS = ("while", "conditional", "call")


def op_times(trace: dict) -> dict[str, tuple[float, int]]:
  """{op kind: (microseconds, calls)} of the XLA operations in a perfetto trace (the JSON that
  `jax.profiler.start_trace(..., create_perfetto_trace=True)` writes): complete events ("X") in a
  device's process (named "/device:...") and those named like an HLO operation on XLA:CPU's
  threads (named "tf_XLA..."), summed by name with its ".N" suffix dropped. Control flow
  (while, conditional, call) is left out: its bodies' operations are counted."""
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") in ("thread_name", "process_name"):
      names[(e["name"], e["pid"], e.get("tid"))] = e["args"]["name"]
  out: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
  for e in events:
    if e.get("ph") != "X":
      continue
    thread = names.get(("thread_name", e["pid"], e.get("tid")), "")
    device = names.get(("process_name", e["pid"], None), "").startswith("/device:")
    if device or (thread.startswith("tf_XLA") and _HLO_NAME.match(e["name"])):
      kind = re.sub(r"\.\d+$", "", e["name"])
      if kind in _CONTAINERS:
        continue
      out[kind][0] += float(e["dur"])
      out[kind][1] += 1
  return {k: (v[0], v[1]) for k, v in out.items()}


def newest_trace(logdir: str) -> str | None:
  """The newest `perfetto_trace.json.gz` jax.profiler wrote under `logdir`, or None."""
  found = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "perfetto_trace.json.gz"))
  return max(found, key=os.path.getmtime) if found else None


def format_table(times: dict[str, tuple[float, int]], steps: int, top: int = 12) -> list[str]:
  """Lines of the `top` op kinds by time: ms per step, share of all ops' time, calls per step."""
  total = sum(t for t, _ in times.values()) or 1.0
  rows = sorted(times.items(), key=lambda kv: -kv[1][0])[:top]
  return [f"  {kind:<32} {t / 1e3 / steps:10,.1f} ms a step {100 * t / total:5.1f}%  "
          f"({n / steps:,.0f} calls)" for kind, (t, n) in rows]


def op_table(logdir: str, steps: int, top: int = 12) -> list[str] | None:
  """`format_table` of the newest trace under `logdir` over `steps` steps; None when jax wrote no
  perfetto trace (only the xplane file)."""
  path = newest_trace(logdir)
  return None if path is None else _trace_table(path, steps, top)


def _trace_table(path: str, steps: int, top: int = 12) -> list[str]:
  with gzip.open(path, "rt") as f:
    return format_table(op_times(json.load(f)), steps, top)


class StepProfiler:
  """Starts and stops the trace around the configured steps (see the module docstring)."""

  def __init__(self, config, logdir: str):
    self.first = int(config.get("profile_start", 0))
    # Steps past the run's last are not there to trace: the trace ends with the run's last step.
    self.count = max(0, min(int(config.get("profile_steps", 0)), config.num_steps - self.first))
    self.logdir = logdir
    self._started = None

  def before(self, step: int) -> None:
    if self.count and step == self.first:
      jax.profiler.start_trace(self.logdir, create_perfetto_trace=True)
      self._started = (time.perf_counter(), os.times())

  def after(self, step: int, state) -> None:
    if self._started is None or step != self.first + self.count - 1:
      return
    jax.block_until_ready(state)
    wall = time.perf_counter() - self._started[0]
    t0, t1 = self._started[1], os.times()
    cores = (t1.user - t0.user + t1.system - t0.system) / wall
    jax.profiler.stop_trace()
    self._started = None
    path = newest_trace(self.logdir)
    if path is None:  # jax wrote only the xplane file (no perfetto support in this jaxlib)
      logging.info("Profile of steps %d-%d in %s", self.first, step, self.logdir)
      return
    logging.info("Profile of steps %d-%d (%d steps): %s ms a step, %.2f CPU cores busy; trace in "
                 "%s\n%s", self.first, step, self.count, f"{1e3 * wall / self.count:,.0f}", cores,
                 os.path.dirname(path), "\n".join(_trace_table(path, self.count)))
