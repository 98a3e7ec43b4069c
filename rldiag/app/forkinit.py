"""Imported first by the app's fork server (:data:`rldiag.app.worker.PRELOAD`), before the
modules it preloads start threads of their own (polars' and DuckDB's pools, pyarrow's): glibc's
allocator limited to one arena, so that the children forked from it (the baseline's recompute, a
page's one-off work) allocate from one heap, as the engine's allocator tuning intends
(:mod:`rldiag.executors.allocator`). Without it the threads of the fork server had made arenas of
their own, which its children inherit and glibc hands to their threads (the recompute's loader)
whatever the limit set later: one step of 16 M tokens peaked at 2.1 and 2.8 GB of PSS in the
child, against 1.73-1.94 GB with the limit set here first (docs/performance.md)."""

from rldiag.app import memory

#: the fork server's arenas (glibc)
ARENAS = 1

memory.limit_arenas(ARENAS)
