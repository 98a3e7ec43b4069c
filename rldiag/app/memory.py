"""Give the memory of a finished recompute or compare back to the system.

A what-if allocates a few hundred MB of short-lived token arrays (Arrow, numpy, torch). Python
frees them, but glibc's allocator keeps the freed pages in its heaps (one per thread that
allocated; Streamlit runs each page in a thread of its own), so the server's resident memory
grows with every what-if and never comes down. :func:`release` collects garbage, has Arrow's
memory pool give back what it no longer uses, and asks glibc to return its free pages
(``malloc_trim``); elsewhere (another C library) it does the first two only.

What is left is held by glibc's arenas, one per thread that allocated, up to 8 per core: every
new Streamlit script thread could start one more, and each keeps the memory its what-if needed
at its peak. ``rldiag app`` caps them (:func:`limit_arenas`, before the server starts its
threads): four what-ifs in a row from the browser took the server from 453 to 513, 550, 558
and 561 MB, where without the cap it grew by about 60 MB a what-if (docs/app.md, Speed).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from functools import lru_cache

#: glibc's mallopt parameter (malloc.h) and the arenas ``rldiag app`` allows
M_ARENA_MAX = -8
ARENAS = 2
#: prctl's option that names the calling thread (linux/prctl.h); the main thread's is the process's
PR_SET_NAME = 15


def _libc_fn(name: str, argtypes: list, restype):
    lib = ctypes.util.find_library("c")
    try:
        fn = getattr(ctypes.CDLL(lib), name) if lib else None
    except (OSError, AttributeError):  # not glibc
        return None
    if fn is not None:
        fn.argtypes, fn.restype = argtypes, restype
    return fn


@lru_cache(maxsize=1)
def _malloc_trim():
    return _libc_fn("malloc_trim", [ctypes.c_size_t], ctypes.c_int)


def limit_arenas(n: int = ARENAS) -> bool:
    """Let glibc's allocator keep at most ``n`` arenas (threads share them); True when set. For
    the threads started afterwards: call it before the server starts its own."""
    fn = _libc_fn("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)
    return bool(fn is not None and fn(M_ARENA_MAX, int(n)) == 1)


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


def name_process(name: str) -> bool:
    """Name this process (Linux ``prctl(PR_SET_NAME)``: ``/proc/PID/comm``, what ``top`` and ``ps
    -o comm`` show; 15 bytes at most): the app's children are told apart from their fork server,
    whose command line they share. True when set."""
    fn = _libc_fn("prctl", [ctypes.c_int, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong],
                  ctypes.c_int)
    return bool(fn is not None and fn(PR_SET_NAME, name.encode()[:15], 0, 0, 0) == 0)


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
