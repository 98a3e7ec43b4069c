"""Benchmark: where a whole recompute's time goes, phase by phase, in one process.

``rldiag recompute RUN --no-reuse`` as the CLI runs it (the local executor, the host allocator
tuned, the loader and hash threads), in this process, with timers around its phases: the imports
(torch's and rldiag's), each fetch on the loader thread (open, read, decode, validate, tensors),
the hash of each file (on the hash thread, or its rest on the thread that needs the record),
each engine stage on the main thread, the per-row tables and the scenario's writes. Each phase's
wall seconds and the CPU seconds of the thread that ran it (``time.thread_time``); the process's
wall and CPU time, minor page faults, and how much of the loader's time overlapped the engine's.
``--cprofile N``: the N functions of the main thread with the most own time, under cProfile
(which slows Python-heavy code, not torch's kernels).

  .venv/bin/python bench/bench_phases.py RUN
  .venv/bin/python bench/bench_phases.py RUN --cprofile 25
  .venv/bin/python bench/bench_phases.py RUN --spare 2     # every core wherever the loader is quiet
"""

from __future__ import annotations

import argparse
import functools
import resource
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

T_START = time.perf_counter()
CPU_START = time.process_time()

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Phases:
    """Wall and thread-CPU seconds per named phase, from any thread; the wall intervals of the
    loader's fetches and the engine's packs, to measure their overlap."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self.intervals: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self.lock = threading.Lock()

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*a, **k):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                t1, c1 = time.perf_counter(), time.thread_time()
                with self.lock:
                    self.wall[name] += t1 - t0
                    self.cpu[name] += c1 - c0
                    self.count[name] += 1
                    self.intervals[name].append((t0, t1))
        return timed


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds during which an interval of ``a`` and one of ``b`` both ran (each list disjoint)."""
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in a for b0, b1 in b)


def instrument(ph: Phases) -> None:
    import rldiag.executors.local as local
    import rldiag.executors.steps as steps_mod
    import rldiag.io.staged as staged
    import rldiag.scenario.write as write
    from rldiag.engine.stages import STAGES

    for st in STAGES:
        object.__setattr__(st, "run", ph.wrap(f"stage {st.name}", st.run))
    fetch = ph.wrap("fetch (loader thread)", steps_mod.fetch)
    steps_mod.fetch = local.fetch = fetch  # type: ignore[assignment]
    steps_mod.PieceHash.run = ph.wrap("hash (either thread)", steps_mod.PieceHash.run)  # type: ignore[method-assign]
    steps_mod.load_step = ph.wrap("  of which load_step", steps_mod.load_step)  # type: ignore[assignment]
    steps_mod.recompute_batch = ph.wrap("engine (all stages)", steps_mod.recompute_batch)  # type: ignore[assignment]
    steps_mod.pack_batch = ph.wrap("pack the batch", steps_mod.pack_batch)  # type: ignore[assignment]
    steps_mod.step_rows_table = ph.wrap("per-row tables", steps_mod.step_rows_table)  # type: ignore[assignment]
    steps_mod._metric_rows = ph.wrap("metric rows", steps_mod._metric_rows)  # type: ignore[assignment]
    write.ScenarioWriter.record = ph.wrap("write: record a step", write.ScenarioWriter.record)  # type: ignore[method-assign]
    write.ScenarioWriter.commit = ph.wrap("write: commit", write.ScenarioWriter.commit)  # type: ignore[method-assign]
    write.open_staged = ph.wrap("write: open staged", write.open_staged)  # type: ignore[assignment]
    staged.StagedWriter.write_table = ph.wrap("  write_table", staged.StagedWriter.write_table)  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--cprofile", type=int, default=0, help="print the N functions with most own time")
    ap.add_argument("--name", default="bench-phases")
    ap.add_argument("--spare", type=float, default=None,
                    help="take the machine's idle cores as this (rldiag.executors.allocator.idle_cores), to "
                         "measure the engine on every core, or on one fewer, whatever the load")
    args = ap.parse_args()
    t0 = time.perf_counter()
    import torch  # noqa: F401

    t_torch = time.perf_counter()
    from rldiag.cli.main import main as _cli  # noqa: F401  (what the CLI imports)
    from rldiag.scenario.recompute import recompute

    t_imports = time.perf_counter()
    ph = Phases()
    instrument(ph)
    if args.spare is not None:
        import rldiag.executors.allocator as allocator

        allocator.idle_cores = lambda: args.spare  # type: ignore[assignment]
    prof = None
    if args.cprofile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    f0 = resource.getrusage(resource.RUSAGE_SELF)
    r0, c0 = time.perf_counter(), time.process_time()
    rep = recompute(args.run, name=args.name, reuse=False, device="cpu")
    r1, c1 = time.perf_counter(), time.process_time()
    f1 = resource.getrusage(resource.RUSAGE_SELF)
    if prof is not None:
        prof.disable()
    print(f"{args.run}: {rep.tokens / 1e6:.2f} M tokens, {len(rep.steps_done)} steps")
    print(f"python start to main: {t0 - T_START:.2f} s; import torch {t_torch - t0:.2f} s; "
          f"import rldiag (cli, recompute) {t_imports - t_torch:.2f} s")
    print(f"recompute(): wall {r1 - r0:.2f} s, process CPU {c1 - c0:.2f} s "
          f"(user {f1.ru_utime - f0.ru_utime:.2f}, sys {f1.ru_stime - f0.ru_stime:.2f}); "
          f"minor faults {f1.ru_minflt - f0.ru_minflt:,}; peak RSS {f1.ru_maxrss / 1024:.0f} MB")
    print(f"{'phase':<34} {'calls':>6} {'wall s':>8} {'cpu s':>8}")
    for name in sorted(ph.wall, key=lambda n: -ph.wall[n]):
        print(f"{name:<34} {ph.count[name]:>6} {ph.wall[name]:>8.3f} {ph.cpu[name]:>8.3f}")
    both = overlap(ph.intervals["fetch (loader thread)"], ph.intervals["engine (all stages)"])
    print(f"loader's fetches overlapping the engine: {both:.2f} s of {ph.wall['fetch (loader thread)']:.2f} s")
    if prof is not None:
        import pstats

        pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)


if __name__ == "__main__":
    main()
