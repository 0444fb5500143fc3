"""This machine's memory as its operating system counts it: what a new allocation can still have, the whole
RAM, this process's resident set and the resident set's high-water mark.

psutil reads the first three the same way on Linux, macOS and Windows, so a laptop without /proc sizes its KV
pool and plans for itself as a Linux server does. The high-water mark is the one reading that differs: only
Linux lets a process restart it (writing 5 to /proc/self/clear_refs resets VmHWM), which is what measuring a
block's peak needs; elsewhere it counts from the process's start (getrusage), and `reset_resident_peak` says
False so that a measurement can tell.
"""

from __future__ import annotations

import sys

import psutil


def available() -> int:
    """Bytes a new allocation can have without swapping: Linux's MemAvailable (free memory and the page cache
    the kernel would drop), the free and reclaimable pages on macOS, the available physical memory on Windows."""
    return psutil.virtual_memory().available


def total() -> int:
    """This machine's RAM."""
    return psutil.virtual_memory().total


def resident() -> int:
    """This process's resident set now (Linux's VmRSS)."""
    return psutil.Process().memory_info().rss


def resident_peak() -> int:
    """This process's largest resident set since the last `reset_resident_peak` that returned True, or
    since the process started."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if sys.platform == "win32":
        return psutil.Process().memory_info().peak_wset
    import resource  # POSIX only: imported where the platform is known to have it

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux and the BSDs KiB


def reset_resident_peak() -> bool:
    """Restart the resident set's high-water mark at the resident set now (Linux: clear_refs 5); False where
    the system does not allow it, and `resident_peak` then counts from the process's start."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def return_freed_memory() -> None:
    """Make glibc give large freed blocks back to the system at once (as MALLOC_MMAP_THRESHOLD_=1048576
    would), so the resident set measures live memory instead of the allocator's hoard."""
    import ctypes  # only where a measurement asks for it
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
        # Free chunks already in the heap (left there while glibc's dynamic threshold was high) would be
        # reused, resident pages the resident set does not see grow: hand their pages back first.
        libc.malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass  # not glibc: the resident set may then over-state the peak
