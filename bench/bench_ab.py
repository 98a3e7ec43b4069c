"""Benchmark: whole recompute processes of several revisions, paired round by round.

bench_whole.py gives the median of each process's times and the ratio of the medians; on a machine
whose speed drifts by 15-50 % between quarter hours, two medians taken minutes apart can differ by
more than the change being measured. Here each round runs every revision once on the same run
(in an order reversed every other round), and the table gives, for each revision against the
first, the median of the rounds' own ratios and their interquartile range: a drift that slows a
whole round cancels out of its ratio.

All revisions recompute the same run, each process into a scenario of its own, removed once it
ends (``--no-reuse``: nothing of an earlier scenario is read). Each revision is ``this`` (this
tree, its installed kernels) or a commit, extracted with its compiled kernels
(:func:`bench_whole.extract`). Each process: ``rldiag recompute RUN --no-reuse --device cpu``
(every stage on, the files hashed, the scenario written), its wall and CPU seconds (user +
system), measured as bench_whole.py measures its processes (:func:`bench_whole.measure`).

  .venv/bin/python bench/bench_ab.py --revisions c84c4f8,this --rounds 10
  .venv/bin/python bench/bench_ab.py --revisions a3032c6,this --workload tail16k --rounds 9
  .venv/bin/python bench/bench_ab.py --revisions a3032c6,this --engine 6 --rounds 3   # the engine alone
  .venv/bin/python bench/bench_ab.py --revisions floor,this --workload tail32k       # against the decode floor
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_whole import TORCH_FLOOR, extract, make_workload, measure  # noqa: E402

#: the rldiag command of this venv (a revision's package comes first on its PYTHONPATH)
CLI = str(Path(sys.executable).with_name("rldiag"))

#: ``--engine``: a child that loads the run's first steps, then times the engine alone on them, one
#: step a batch and one torch thread (the best of 5 passes after a warm-up), and the load of them
#: (CPU seconds of its thread, best of 5); written for every revision's API since a3032c6
ENGINE_CHILD = """
import inspect, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from rldiag.executors.allocator import tune_host_allocator
tune_host_allocator()
from rldiag.config.settings import resolve_settings
from rldiag.engine.batch import pack
from rldiag.engine.pipeline import recompute_batch
from rldiag.io.loader import load_step
from rldiag.io.rundir import RunDir
run, n = Path(sys.argv[1]), int(sys.argv[2])
settings = resolve_settings(run)
files = RunDir(run).step_files()[:n]
try:
    from rldiag.engine.requirements import recompute_columns
    plan = recompute_columns(settings)
    load = lambda sf: load_step(sf, settings, plan, threads=False)
except ImportError:  # before the column planner: the loader chooses
    load = lambda sf: load_step(sf, settings, threads=False)
kw = {k: v for k, v in (("release", True), ("keep_tokens", False))
      if k in inspect.signature(recompute_batch).parameters}
def best(fn, clock):
    out = []
    for _ in range(5):
        t = clock()
        fn()
        out.append(clock() - t)
    return min(out)
best_load = best(lambda: [load(sf) for sf in files], time.thread_time)
data = [load(sf) for sf in files]
def engine():
    for d in data:
        recompute_batch(pack([d.batch]), settings, None, **kw)
engine()
print(best(engine, time.perf_counter) / n, best_load / n)
"""


def engine_alone(run: Path, tree: Path, steps: int) -> tuple[float, float]:
    """The engine's seconds a step and the load's CPU seconds a step (:data:`ENGINE_CHILD`) with
    the package of ``tree``."""
    out = subprocess.run([sys.executable, "-c", ENGINE_CHILD, str(run), str(steps)], env=dict(os.environ, PYTHONPATH=str(tree)),
                         check=True, capture_output=True, text=True, cwd=tempfile.gettempdir())
    engine, load = out.stdout.split()[-2:]
    return float(engine), float(load)


def one(run: Path, tree: Path, name: str, floor: bool = False) -> tuple[float, float]:
    """One recompute process with the package of ``tree`` (:func:`bench_whole.measure`): wall
    seconds, CPU seconds (user + system); its scenario removed. ``floor``: bench_whole's decode
    floor (:data:`bench_whole.TORCH_FLOOR`: the loader alone, with this tree's package) instead."""
    if floor:
        got = measure([sys.executable, "-c", TORCH_FLOOR, str(run)], str(ROOT))
        return got["seconds"], got["cpu_seconds"]
    got = measure([CLI, "recompute", str(run), "--no-reuse", "--device", "cpu", "--name", name], str(tree))
    shutil.rmtree(run / "rldiag" / "scenarios" / name, ignore_errors=True)
    return got["seconds"], got["cpu_seconds"]


def paired(times: dict[str, list[tuple[float, float]]], first: str,
           names: tuple[str, str] = ("wall", "cpu"), unit: str = "s") -> list[str]:
    """The table: each revision's median of both measures (wall and CPU seconds by default), and
    the median (interquartile range) of its per-round ratios to ``first``'s."""
    a, b = names
    lines = [f"{'revision':<14} {a + ' ' + unit:>9} {b + ' ' + unit:>9} {a + ' x':>9} {'IQR':>13} {b + ' x':>9} {'IQR':>13}"]
    for rev, got in times.items():
        rw = [a[0] / b[0] for a, b in zip(got, times[first])]
        rc = [a[1] / b[1] for a, b in zip(got, times[first])]
        qw = statistics.quantiles(rw, n=4) if len(rw) > 1 else [rw[0]] * 3
        qc = statistics.quantiles(rc, n=4) if len(rc) > 1 else [rc[0]] * 3
        lines.append(f"{rev:<14} {statistics.median(g[0] for g in got):>9.2f} {statistics.median(g[1] for g in got):>9.2f} "
                     f"{statistics.median(rw):>9.3f} {qw[0]:>6.3f}-{qw[2]:<6.3f} {statistics.median(rc):>9.3f} "
                     f"{qc[0]:>6.3f}-{qc[2]:<6.3f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--revisions", default="this",
                    help="comma-separated: 'this', 'floor' (the decode floor) or git revisions (the first is the reference)")
    ap.add_argument("--workload", default="uniform", help="uniform, tail32k, tail16k or step16m (bench_whole's)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the long-tailed workloads (tests)")
    ap.add_argument("--dir", default=None, help="where to keep generated runs and extracted revisions")
    ap.add_argument("--engine", type=int, default=0, metavar="STEPS",
                    help="time the engine alone instead (ms a step, one thread) and the load (CPU ms a step), "
                         "on the run's first STEPS steps")
    args = ap.parse_args()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="rldiag-ab-"))
    base.mkdir(parents=True, exist_ok=True)
    revs = [r.strip() for r in args.revisions.split(",") if r.strip()]
    run = make_workload(base, args.workload, args)
    trees = {r: (ROOT if r in ("this", "floor") else extract(r, base)) for r in revs}
    times: dict[str, list[tuple[float, float]]] = {r: [] for r in revs}
    what = f"the engine alone on {args.engine} steps" if args.engine else "whole processes"
    print(f"machine: {os.cpu_count()} cores; workload {args.workload} ({run.name}); {what}; {args.rounds} rounds, "
          f"the order reversed every other round; load average {os.getloadavg()[0]:.2f}")
    for i in range(args.rounds):
        for r in (revs if i % 2 == 0 else revs[::-1]):
            if args.engine:
                got = engine_alone(run, trees[r], args.engine)
            else:
                got = one(run, trees[r], f"bench-ab-{i}", floor=r == "floor")
            times[r].append(got)
    if args.engine:  # the engine's ms a step, the load's CPU ms a step
        times = {r: [(a * 1e3, b * 1e3) for a, b in got] for r, got in times.items()}
        print("\n".join(paired(times, revs[0], ("engine", "load"), "ms")))
    else:
        print("\n".join(paired(times, revs[0])))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
