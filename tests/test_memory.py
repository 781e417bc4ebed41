"""While the heap is kept, freed blocks stay with the process for the next allocations of their
size; on leaving, the free heap goes back to the OS."""

import ctypes.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from quantizer.memory import proc_status_mb

REPO = Path(__file__).resolve().parents[1]
# in a fresh process (glibc's thresholds move with what a process frees): MiB still resident
# after a 16 MiB block is allocated, written and freed, while the heap is kept and after
FRESH = """
import ctypes, ctypes.util, json
from quantizer.memory import heap_kept, proc_status_mb
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
def resident_after_freeing(size=16 << 20):
    base = proc_status_mb("RssAnon")
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(ctypes.c_void_p(block))
    return proc_status_mb("RssAnon") - base
with heap_kept():
    kept = resident_after_freeing()
print(json.dumps([kept, resident_after_freeing()]))
"""


@pytest.mark.skipif(ctypes.util.find_library("c") is None or not proc_status_mb("RssAnon"),
                    reason="needs glibc and /proc")
def test_a_freed_block_stays_resident_while_the_heap_is_kept_and_goes_back_after():
    run = subprocess.run([sys.executable, "-c", FRESH], cwd=REPO, capture_output=True, text=True, check=True)
    kept, after = json.loads(run.stdout)
    assert kept > 0.9 * 16 and after < 0.5 * 16
