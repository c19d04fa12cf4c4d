"""realm_jax/train/profile.py: the op table of a trace, on a trace written here by hand."""

from realm_jax.train import profile


def _meta(kind, pid, tid, name):
  e = {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}
  if tid is not None:
    e["tid"] = tid
  return e


def _op(pid, tid, name, dur):
  return {"ph": "X", "pid": pid, "tid": tid, "ts": 0.0, "dur": dur, "name": name}


TRACE = {"traceEvents": [
    _meta("process_name", 1, None, "/host:CPU"),
    _meta("thread_name", 1, 10, "python"),
    _meta("thread_name", 1, 11, "tf_XLAEigen/123"),
    _meta("thread_name", 1, 12, "tf_XLAEigen/456"),
    _meta("process_name", 2, None, "/device:GPU:0"),
    _meta("thread_name", 2, 20, "Stream #1"),
    _op(1, 10, "PjitFunction(train_step)", 5000.0),     # the host's Python: not an op
    _op(1, 11, "ynn_fusion.3", 100.0),
    _op(1, 12, "ynn_fusion.17", 50.0),
    _op(1, 11, "ynn_fusion", 25.0),
    _op(1, 12, "add_select_fusion.2", 30.0),
    _op(1, 11, "ThunkExecutor::Execute", 900.0),        # the runtime's own events
    _op(1, 12, "ThreadpoolListener::Record", 900.0),
    _op(1, 11, "end: ynn_fusion.3", 1.0),
    _op(1, 12, "Wait: pending_threads=3/8", 40.0),
    _op(1, 12, "all-reduce.1", 9.0),                    # a collective is an op
    _op(1, 11, "while.4", 160.0),                       # only runs the ops above
    _op(2, 20, "fusion.8", 7.0),                        # a device's op
    {"ph": "i", "pid": 1, "tid": 11, "ts": 0.0, "name": "ynn_fusion.3"},  # not a complete event
]}


def test_op_times_sum_xla_and_device_ops_by_kind():
  assert profile.op_times(TRACE) == {"ynn_fusion": (175.0, 3), "add_select_fusion": (30.0, 1),
                                     "all-reduce": (9.0, 1), "fusion": (7.0, 1)}


def test_the_table_is_per_step_slowest_first_with_shares():
  lines = profile.format_table(profile.op_times(TRACE), steps=2, top=2)
  assert [line.split()[0] for line in lines] == ["ynn_fusion", "add_select_fusion"]
  # 175 us over 2 steps = 0.0875 ms a step, 175 of 221 us = 79.2%; 3 calls over 2 steps = 2.
  assert lines[0].split()[1:] == ["0.1", "ms", "a", "step", "79.2%", "(2", "calls)"]
  assert lines[1].split()[1] == "0.0" and "13.6%" in lines[1]
