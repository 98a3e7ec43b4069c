"""The app gives a finished what-if's memory back: ``memory.release`` after the work."""

from __future__ import annotations

import math
import os
import platform

import pytest

from rldiag.app import memory


def test_rss_is_read_for_this_process_and_nan_for_none():
    assert memory.rss_mb() > 10
    assert memory.rss_mb(os.getpid()) > 10
    assert math.isnan(memory.rss_mb(2**30))


#: run in a process of its own: the test process's heap holds whatever earlier tests left in it
#: (their freed pages, their arenas), so its resident memory says nothing about this release
RELEASE_PROBE = """
import gc, json
import numpy as np
from rldiag.app import memory
# many mid-sized blocks (under glibc's mmap threshold, so they live in the heap), then freed
# except the last: the heap cannot shrink from its top, only malloc_trim returns the pages
blocks = [np.ones(8_000) for _ in range(4_000)]  # 64 KB each, 256 MB
keep = blocks[-1]
before = memory.rss_mb()
del blocks
gc.collect()
after_free = memory.rss_mb()
released = memory.release()
print(json.dumps({"before": before, "after_free": after_free, "released": released,
                  "after_release": memory.rss_mb(), "kept": float(keep.sum())}))
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_release_returns_freed_heap_pages_to_the_system():
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", RELEASE_PROBE], capture_output=True, text=True, check=True).stdout
    m = json.loads(out.strip().splitlines()[-1])
    assert m["after_free"] > m["before"] - 100  # free() kept the pages
    assert m["released"] is True
    assert m["after_release"] < m["after_free"] - 150
    assert m["kept"] == 8_000


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_limit_arenas_is_accepted_by_glibc():
    import subprocess
    import sys

    # in a child process: the cap stays with the process that sets it
    code = "from rldiag.app import memory; print(memory.limit_arenas(), memory.limit_arenas(3))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True"]


def test_name_process_names_the_calling_thread_what_ps_shows():
    """memory.name_process: the app's children are told apart from their fork server by their
    ``comm`` (bench_rollouts' breakdown of the tree). Called on a thread here, so that only that
    thread is renamed (on a process's main thread it is the process's name)."""
    import sys
    import threading

    if not sys.platform.startswith("linux"):
        pytest.skip("Linux prctl only")
    got = []

    def work() -> None:
        ok = memory.name_process("rldiag-page-work-too-long")
        with open("/proc/thread-self/comm") as fh:
            got.append((ok, fh.read().strip()))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert got == [(True, "rldiag-page-wor")]  # 15 bytes: the kernel's limit
