"""This process's memory: resident-set figures from /proc, the memory the machine has free,
handing freed heap back to the OS, or keeping it for reuse, and asking for huge pages."""

from __future__ import annotations

import ctypes
import resource
from contextlib import contextmanager
from typing import Iterator

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
LARGEST_HEAP_BLOCK = 32 << 20
"""Bytes: glibc's largest mmap threshold on 64-bit; blocks above it are mapped, and unmapped when freed."""
KEEP_FREED = 2**31 - 1
"""Bytes of free heap at its top that glibc keeps rather than hands back (mallopt's int at most)."""
DEFAULT_TRIM = 128 << 10
HUGE_PAGE = 2 << 20
"""Bytes of a transparent huge page on x86-64 (and the alignment a region needs to get whole ones)."""
MADV_HUGEPAGE = 14
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


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


@contextmanager
def heap_kept() -> Iterator[None]:
    """While open, freed blocks up to :data:`LARGEST_HEAP_BLOCK` stay in this process's heap for
    the next allocations of their size, instead of going back to the OS and being faulted in,
    zeroed, again (a calibration pass allocates the same shapes window after window, layer after
    layer). Resident memory stays at the largest working set so far; on leaving, glibc's trimming
    is restored and the free heap handed back. Elsewhere than glibc it does nothing."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, LARGEST_HEAP_BLOCK)
        libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED)
    except (OSError, AttributeError):
        libc = None
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM)
            libc.malloc_trim(0)


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


def huge_pages_offered() -> bool:
    """Whether Linux gives this process's anonymous memory transparent huge pages where it asks
    (the kernel's setting ``always`` or ``madvise``, not ``never``)."""
    try:
        with open(THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def advise_huge_pages(address: int, length: int) -> bool:
    """Ask for huge pages over ``length`` bytes at ``address`` (a multiple of :data:`HUGE_PAGE`,
    not yet touched, so that each page is faulted in whole); whether the kernel took the advice."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False

