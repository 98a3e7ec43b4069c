"""Give the memory of a finished recompute or compare back to the system.

A what-if allocates a few hundred MB of short-lived token arrays (Arrow, numpy, torch). Python
frees them, but glibc's allocator keeps the freed pages in its heaps (one per thread that
allocated; Streamlit runs each page in a thread of its own), so the server's resident memory
grows with every what-if and never comes down. :func:`release` collects garbage, has Arrow's
memory pool give back what it no longer uses, and asks glibc to return its free pages
(``malloc_trim``); elsewhere (another C library) it does the first two only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from functools import lru_cache


@lru_cache(maxsize=1)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def release() -> bool:
    """Collect garbage and return the allocator's free memory to the system; True when glibc's
    ``malloc_trim`` could be called."""
    gc.collect()
    import pyarrow as pa

    pa.default_memory_pool().release_unused()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def rss_mb(pid: int | str = "self") -> float:
    """Resident memory of a process in MB (Linux ``/proc``), NaN where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")
