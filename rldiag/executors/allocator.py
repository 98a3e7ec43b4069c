"""Host settings for a recompute on the CPU: the memory allocator, and the engine's threads.

A step of 512 rows x 1,024 tokens makes tensors of 2 to 4 MB, dozens per step. glibc's malloc
serves blocks that large with a fresh ``mmap`` and unmaps them on ``free`` (its threshold
starts at 128 kB and adapts only partly), so every tensor of every step page-faults its memory
in again: on this project's 2-core machine about 350,000 minor faults and a second of kernel
time for 20 such steps, about 0.5 s of a 2.2 s recompute. PyTorch's CPU tuning guide recommends a
caching allocator (jemalloc or TCMalloc) for the same reason; without changing the process's
allocator, glibc's own ``mallopt`` knobs get most of the way: every block comes from the heap
(no ``mmap`` per block, the larger ones of a big step included), freed memory is kept for the
next step instead of being trimmed back to the system, and every thread allocates from one heap
(what the loader thread frees, the engine's thread reuses).

The memory kept is what one step needed at its peak (the process's RSS stays at that level
rather than dropping between steps); it does not grow with the number of steps. Set
``RLDIAG_MALLOC_TUNING=0`` to leave the allocator as it is.

Threads: while the engine computes one step, the loader thread reads the next (Arrow's
decoding, the SHA-256 of the file). On a small machine the two compete for cores, and torch's
intra-op threads waiting for each other lose more than they gain, so the engine runs with one
thread fewer than the process may use (:func:`engine_threads`), leaving a core to the loader.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
M_ARENA_MAX = -8

#: Blocks up to this size come from the heap (glibc's maximum on 64-bit: 4 MiB * sizeof(long)).
MMAP_THRESHOLD = 32 << 20
#: Blocks served by a fresh ``mmap``: none. Blocks above glibc's largest threshold (32 MiB: one
#: float32 column of 8M tokens, a step of 8,192 rows with a 32k cap) would otherwise be mapped and
#: page-faulted in again at every allocation: on this project's machine 1.5M faults and 7 s of
#: kernel time for one such step, 0.5M and 4 s from the heap (bench/bench_recompute.py, step8k32k).
MMAP_MAX = 0
#: Free memory at the top of the heap kept for reuse rather than returned to the system.
TRIM_THRESHOLD = 256 << 20
#: Extra memory requested each time the heap grows, so that a step grows it a few times at most.
TOP_PAD = 64 << 20
#: Heaps (arenas) the process's threads share: one. glibc gives a thread that finds the main heap
#: busy an arena of its own, and memory freed into one arena serves only that arena's later
#: requests: the loader thread decodes a step (Arrow's buffers, the tensors made from them) in
#: its arena, the engine computes on the main thread in another, and each kept its own
#: high-water mark. One arena: the tail32k bench run's 3 steps (2,048 rows, cap 32k) fetched on a
#: thread and computed one after the other peaked 1,085-1,153 MB against 1,203-1,233 MB (whole
#: recomputes under load: 1,320-1,430 against 1,431-1,570; docs/performance.md); two threads
#: contend for its lock on few, large blocks.
ARENA_MAX = 1



def tuning_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``RLDIAG_MALLOC_TUNING`` allows the tuning (unset: yes; 0, false, no, off: no)."""
    return environ.get("RLDIAG_MALLOC_TUNING", "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def tune_host_allocator() -> bool:
    """Apply the settings above once per process (glibc only). Returns whether they are in
    effect: False on other C libraries or with ``RLDIAG_MALLOC_TUNING=0``. The answer is kept:
    the environment is read by the first call (``tune_host_allocator.cache_clear()`` forgets it)."""
    if not tuning_enabled():
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    tuned = all(
        mallopt(param, value) == 1
        for param, value in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_MMAP_MAX, MMAP_MAX), (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                             (M_TOP_PAD, TOP_PAD), (M_ARENA_MAX, ARENA_MAX))
    )
    if tuned:
        share_heap_with_arrow()
    return tuned


def share_heap_with_arrow() -> None:
    """Arrow's buffers from the same (tuned) glibc heap as torch's tensors, instead of Arrow's own
    mimalloc or jemalloc pool: memory freed by one is then reused by the other. Each kept its own
    high-water mark before: a whole recompute of 20 steps x 512 x 1,024 peaked 25-70 MB higher
    (bench/bench_recompute.py, docs/performance.md)."""
    import pyarrow as pa

    pa.set_memory_pool(pa.system_memory_pool())


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, where the platform says)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def idle_cores() -> float:
    """Cores the machine left idle over the last minute: the usable cores less the 1-minute load
    average (this process's own threads included); the usable cores where the platform keeps no
    load average."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return float(usable_cores())
    return usable_cores() - load


def cpu_sample() -> tuple[float, float, float] | None:
    """(CPU seconds the whole machine has been busy, this process's CPU seconds, a monotonic
    time) now, from ``/proc/stat`` (user, nice, system, irq, softirq and steal time of every CPU)
    and :func:`os.times`; None where the platform has no ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    busy = sum(fields) - fields[3] - fields[4]  # less idle and iowait
    own = os.times()
    return busy / hz, own.user + own.system, time.monotonic()


#: :class:`SpareCores` needs a window this long (seconds) to tell; a shorter one (CPU times
#: count in ticks of 10 ms) falls back to the load average (:func:`idle_cores`).
SPARE_WINDOW = 0.1


class SpareCores:
    """Cores another engine thread would find free, measured between calls: the usable cores less
    the CPU the machine's *other* processes used since the last call (the machine's busy time less
    this process's own, over the wall time) less the ``fewer`` threads the engine has already.

    The 1-minute load average (:func:`idle_cores`) counts this process's own threads and lags by
    a minute, so on a quiet machine a recompute's own loader and engine kept it above the rule's
    threshold; this measures what the others leave now. Falls back to :func:`idle_cores` where the
    platform has no ``/proc/stat`` or the window is shorter than :data:`SPARE_WINDOW`."""

    def __init__(self, fewer: int):
        self.fewer = fewer
        self._last = cpu_sample()

    def __call__(self) -> float:
        now, last = cpu_sample(), self._last
        if now is None or last is None or now[2] - last[2] < SPARE_WINDOW:
            return idle_cores()
        self._last = now
        others = max(0.0, (now[0] - last[0]) - (now[1] - last[1])) / (now[2] - last[2])
        return usable_cores() - others - self.fewer


def pack_threads(every: int, fewer: int, loader_quiet: bool, spare: Callable[[], float] | None = None) -> int:
    """Set torch's intra-op threads for the next pack of a CPU recompute and return the count:
    ``fewer`` (:func:`engine_threads`') while the loader thread reads a step beside the engine;
    ``every`` while it reads nothing (``loader_quiet``: the last packs, or a large step computed
    with nothing read ahead), but only where the machine has a core to spare: ``spare()`` at least
    half a core (:class:`SpareCores`; default :func:`idle_cores`, the load average's). torch's
    intra-op threads wait for each other at every operation, and where another process or the
    loader holds a core each wait lasts a time slice of the scheduler (docs/performance.md,
    "Threads"). The engine's results do not depend on the thread count
    (tests/engine/test_thread_count.py)."""
    want = every if loader_quiet and every > fewer and (spare or idle_cores)() >= 0.5 else fewer
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)
    return want


@contextmanager
def engine_threads(device: str) -> Iterator[int]:
    """torch's intra-op threads for a CPU recompute: one fewer than the usable cores (at least
    one, and never more than torch had), restored afterwards. Other devices are left alone."""
    before = torch.get_num_threads()
    if torch.device(device).type != "cpu":
        yield before
        return
    n = max(1, min(before, usable_cores() - 1))
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)
