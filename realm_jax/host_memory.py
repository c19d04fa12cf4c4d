"""Keep freed host memory in the process instead of handing it back to the OS (glibc only).

By default glibc serves every allocation above its mmap threshold (128 KiB, rising to at most
32 MiB) with a fresh `mmap` and returns it to the kernel on `free`. A jitted step on the CPU
allocates its large temporaries anew on every call, so every step page-faults them back in. On
this project's 2-core machine that cost ~8% of realm_jax's forward pass over B x K = 64
sequences (not measurable in its whole step), and ~40% of the HF PyTorch port's training step,
whose eager ops allocate one activation at a time (benchmarks/README.md). With mmap off and
no trimming, freed blocks stay in the heap and the next step reuses them; the price is that the
process keeps its peak size (resident memory does not shrink after a large step).

`KEEP_FREED_ENV` (`MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=<large>`) in the environment does the
same for a whole process from its start (glibc reads it then; children inherit it);
`keep_freed_memory()` does it from the call on.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

_M_TRIM_THRESHOLD = -1   # mallopt parameters, from glibc's malloc.h
_M_MMAP_MAX = -4
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int
KEEP_FREED_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(10**11)}


def keep_freed_memory() -> bool:
  """Turns off glibc's mmap allocations and heap trimming for the rest of the process.

  Returns False (and changes nothing) where the C library is not glibc.
  """
  name = ctypes.util.find_library("c")
  try:
    libc = ctypes.CDLL(name)
    mallopt = libc.mallopt
  except (OSError, AttributeError, TypeError):
    logging.info("keep_freed_memory: no glibc mallopt (%s); allocator left as it is.", name)
    return False
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  ok = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
  if not ok:
    logging.warning("keep_freed_memory: mallopt refused the settings; allocator left as it is.")
  return ok


def release_freed_memory() -> bool:
  """Hands the free pages of the C heap back to the OS (glibc `malloc_trim`), so that resident
  memory falls after a phase with large temporary buffers (an evaluation, a checkpoint). Costs a
  few milliseconds; False (nothing done) where the C library is not glibc."""
  try:
    trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
  except (OSError, AttributeError, TypeError):
    return False
  trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
  trim(0)
  return True
