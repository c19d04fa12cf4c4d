"""keep_freed_memory: a freed large block is reused without page faults (glibc), measured with the
process's own minor-fault counter in a fresh interpreter (the setting is process-wide)."""

import os
import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys
import numpy as np
if sys.argv[1] == "keep":
  from realm_jax.host_memory import keep_freed_memory
  assert keep_freed_memory()
np.ones(8 * 2**20); # 64 MiB, touched, freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
np.ones(8 * 2**20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
  env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
  out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True,
                       text=True, check=True)
  return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_block_is_reused_without_page_faults():
  default, keep = _faults("default"), _faults("keep")
  assert default > 100, default   # glibc's default: the block came back from the kernel
  assert keep < 10, keep          # kept in the heap: reused as it is


RELEASE = """
import ctypes, ctypes.util
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
def rss():
  return int(open("/proc/self/statm").read().split()[1]) * 4096
blocks = [libc.malloc(64 * 1024) for _ in range(4096)]  # 256 MiB below the mmap threshold
for b in blocks:
  ctypes.memset(b, 1, 64 * 1024)
for i, b in enumerate(blocks):
  if i % 16:  # every 16th block stays: the heap's top cannot shrink
    libc.free(b)
freed = rss()
from realm_jax.host_memory import release_freed_memory
assert release_freed_memory()
print(freed, rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_release_freed_memory_gives_free_heap_pages_back():
  env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
  out = subprocess.run([sys.executable, "-c", RELEASE], env=env, capture_output=True, text=True,
                       check=True)
  freed, released = (int(x) for x in out.stdout.split())
  # 15/16 of 256 MiB was freed but stays resident in the heap until it is released.
  assert freed - released > 150 * 2**20, (freed, released)
