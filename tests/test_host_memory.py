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
