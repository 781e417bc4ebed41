"""This process's memory: resident-set figures from /proc, the memory the machine has free, and
handing freed heap back to the OS."""

from __future__ import annotations

import ctypes
import resource


def proc_status_mb(key: str) -> float:
    """A /proc/self/status field (RssAnon, VmHWM, VmRSS ...) in MiB; 0 where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def release_free_memory() -> None:
    """Return freed heap pages to the OS (glibc). Tensors of a few MB come from the heap, and
    without this a long stream of them fragments it so resident memory creeps up with model size."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_rss_mb() -> float:
    """Peak resident set size of this process image, in MiB.

    VmHWM, not ru_maxrss: the latter survives exec and so counts a large parent's pages that a
    forked child briefly shared."""
    return proc_status_mb("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def available_memory_bytes() -> int:
    """The machine's MemAvailable from /proc/meminfo, in bytes; 0 where unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
