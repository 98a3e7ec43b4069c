"""Benchmark: what the mismatch diagnosis (the ``mismatch`` stage, ``rldiag/mismatch/*``) adds to
``rldiag recompute``.

Whole processes, per workload (bench_recompute.py's: the uniform run and the long-tailed
tail16k, tail32k, step8k32k; ``--scale`` shrinks them as there, and the uniform run's rows too):
``rldiag recompute RUN --no-reuse --name bench-mm-on`` against the same with
``--set rldiag.mismatch.enable=false``, best of ``--repeat``, alternating; wall time, peak RSS,
the ratio with / without and the seconds added. The synthetic runs carry ``rollout_log_probs``
and ``old_log_probs``, so the stage runs: the "with" scenario's metrics.parquet must have
``rldiag/mismatch/*`` columns and the "without" one none (checked; the bench stops otherwise).

``--in-process``: on the largest step of the workloads (tokens per step), in this process, the stage's own
time (``mismatch_stats`` as ``recompute_batch`` calls it) against ``recompute_batch`` of that
step with and without it. Usage:

  .venv/bin/python bench/bench_mismatch.py --scale 0.25 --repeat 3 --in-process
  .venv/bin/python bench/bench_mismatch.py --workloads tail32k,step8k32k
"""

from __future__ import annotations

import argparse
import compileall
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
# the `rldiag` processes import this tree's package, not whatever the venv's entry point finds first
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

from bench_recompute import TAIL_MEDIAN, TAILED, best, make_run, make_tailed_run, measure_process, run_shape  # noqa: E402

PREFIX = "rldiag/mismatch/"
WORKLOADS = ("uniform", "tail16k", "tail32k", "step8k32k")


def mismatch_columns(run: Path, name: str) -> list[str]:
    import pyarrow.parquet as pq

    return [c for c in pq.read_schema(run / "rldiag" / "scenarios" / name / "metrics.parquet").names
            if c.startswith(PREFIX)]


def pair(run: Path, repeat: int) -> tuple[dict, dict]:
    """(with, without): best of ``repeat`` alternating whole processes (wall time; the CPU time
    is the least of the repeats too); checks that the stage ran in the first and not in the second."""
    cli = str(Path(sys.executable).with_name("rldiag"))
    base = [cli, "recompute", str(run), "--no-reuse", "--device", "cpu", "--name"]
    scen = run / "rldiag" / "scenarios"
    on = off = None
    cpu_on = cpu_off = float("inf")
    for _ in range(repeat):
        m = measure_process([*base, "bench-mm-on"], fresh=scen / "bench-mm-on")
        on, cpu_on = best(on, m), min(cpu_on, m["cpu_seconds"])
        m = measure_process([*base, "bench-mm-off", "--set", "rldiag.mismatch.enable=false"],
                            fresh=scen / "bench-mm-off")
        off, cpu_off = best(off, m), min(cpu_off, m["cpu_seconds"])
    with_cols, without_cols = mismatch_columns(run, "bench-mm-on"), mismatch_columns(run, "bench-mm-off")
    if not with_cols or without_cols:
        raise SystemExit(f"bench: {run}: the stage did not run as asked ({len(with_cols)} {PREFIX}* columns "
                         f"with it, {len(without_cols)} without)")
    return {**on, "cpu": cpu_on, "columns": len(with_cols)}, {**off, "cpu": cpu_off, "columns": 0}


def in_process(run: Path, repeat: int) -> None:
    """The stage's time inside ``recompute_batch`` of the run's largest step, and that recompute's
    with and without it; the allocator and the engine's threads as ``rldiag recompute`` sets them."""
    import rldiag.engine.stages.mismatch as stage
    from rldiag.config.settings import resolve_settings
    from rldiag.engine.pipeline import recompute_batch
    from rldiag.engine.requirements import recompute_columns
    from rldiag.executors.allocator import engine_threads, tune_host_allocator
    from rldiag.io.loader import load_step
    from rldiag.io.rundir import RunDir

    tune_host_allocator()
    s_on = resolve_settings(run, {})
    s_off = resolve_settings(run, {"rldiag.mismatch.enable": False})
    cols = recompute_columns(s_on)
    sf = max(RunDir(run).require_steps(), key=lambda f: Path(f.path).stat().st_size)  # the largest file
    data = load_step(sf, s_on, cols)
    batch = data.batch
    inner = stage.mismatch_stats
    spent: list[tuple[float, float]] = []

    def clock() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    def timed(*a, **k):
        w, c = clock()
        out = inner(*a, **k)
        w2, c2 = clock()
        spent.append((w2 - w, c2 - c))
        return out

    def best_of(fn) -> tuple[float, float]:
        w, c = clock()
        fn()
        w2, c2 = clock()
        return w2 - w, c2 - c

    stage.mismatch_stats = timed
    try:
        with engine_threads("cpu") as threads:
            on = off = alone = (float("inf"), float("inf"))
            for _ in range(repeat):
                on = min(on, best_of(lambda: recompute_batch(batch, s_on)))
                alone = min(alone, spent[-1])
                off = min(off, best_of(lambda: recompute_batch(batch, s_off)))
    finally:
        stage.mismatch_stats = inner
    print(f"in process, the largest step (file) of {run.name} ({batch.n_rows} rows, {data.n_tokens:,} tokens; "
          f"torch {threads} thread(s) as rldiag recompute; best of {repeat}; wall s / CPU s):")
    print(f"  recompute_batch with the stage {on[0]:.3f} / {on[1]:.3f}, without {off[0]:.3f} / {off[1]:.3f}; "
          f"mismatch_stats alone {alone[0]:.3f} / {alone[1]:.3f} = {alone[0] / off[0]:.0%} / "
          f"{alone[1] / off[1]:.0%} of recompute_batch without it")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"from {', '.join(WORKLOADS)}")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="shrink the long-tailed workloads' rows, cap and median, and the uniform run's rows")
    ap.add_argument("--steps", type=int, default=20, help="the uniform run's steps")
    ap.add_argument("--rows", type=int, default=512, help="the uniform run's rows per step (before --scale)")
    ap.add_argument("--tokens", type=int, default=1024, help="the uniform run's tokens per row")
    ap.add_argument("--repeat", type=int, default=3, help="best of N, each process")
    ap.add_argument("--in-process", action="store_true", help="also time the stage inside recompute_batch")
    ap.add_argument("--dir", default=None, help="where to keep generated runs (default: a temp dir)")
    args = ap.parse_args()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="rldiag-bench-mm-"))
    compileall.compile_dir(str(ROOT / "rldiag"), quiet=1)  # as an installed package has it (bench_recompute)
    runs: dict[str, Path] = {}
    for name in [w for w in args.workloads.split(",") if w]:
        if name == "uniform":
            rows = max(8, int(args.rows * args.scale))
            runs[name] = make_run(base / f"run-{args.steps}-{rows}-{args.tokens}", args.steps, rows, args.tokens)
        elif name in TAILED:
            steps, rows, cap, at_cap = TAILED[name]
            rows, cap = max(8, int(rows * args.scale)), max(64, int(cap * args.scale))
            runs[name] = make_tailed_run(base / f"{name}-{rows}-{cap}", steps, rows, cap,
                                         median=max(8, int(TAIL_MEDIAN * args.scale)), capped_rows=at_cap)
        else:
            raise SystemExit(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    print(f"machine: {os.cpu_count()} cores; python {sys.version.split()[0]}; scale {args.scale}; "
          f"best of {args.repeat}")
    print("whole processes: `rldiag recompute RUN --no-reuse` with the mismatch stage and with "
          "`--set rldiag.mismatch.enable=false`;")
    print(f"ratio: with / without (wall, then CPU: user + system); columns: {PREFIX}* columns in each scenario")
    cols = [("workload", "<10"), ("steps x rows", ">13"), ("tokens", ">10"), ("with s", ">7"), ("without s", ">9"),
            ("ratio", ">6"), ("CPU with", ">9"), ("CPU without", ">11"), ("CPU ratio", ">9"), ("with MB", ">8"),
            ("without MB", ">10"), ("columns", ">8")]
    hdr = " ".join(format(name, spec) for name, spec in cols)
    print(hdr)
    print("-" * len(hdr))
    shapes = {}
    for name, run in runs.items():
        steps, rows, tokens, _ = shapes[run] = run_shape(run)
        on, off = pair(run, args.repeat)
        ran = f"{on['columns']}/{off['columns']}"
        print(f"{name:<10} {f'{steps} x {rows // steps}':>13} {tokens:>10,} {on['seconds']:>7.2f} "
              f"{off['seconds']:>9.2f} {on['seconds'] / off['seconds']:>6.2f} {on['cpu']:>9.2f} {off['cpu']:>11.2f} "
              f"{on['cpu'] / off['cpu']:>9.2f} {on['peak_rss_mb']:>8.0f} {off['peak_rss_mb']:>10.0f} "
              f"{ran:>8}")
    if args.in_process and shapes:
        print()
        in_process(max(shapes, key=lambda r: shapes[r][2] / shapes[r][0]), args.repeat)


if __name__ == "__main__":
    main()
