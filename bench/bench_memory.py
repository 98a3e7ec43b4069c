"""Benchmark: memory per token of a recompute (issue 38, items 4 and 5).

For each long-tailed workload of bench_recompute.py (lognormal lengths around 600 tokens, 2 % of
the rows at the cap): the whole process ``rldiag recompute RUN --no-reuse`` and the decode floor
(a process that only decodes the Parquet columns that recompute reads), each the best of
``--repeat``; their peak RSS above the base (the same commands' on a one-step run of 8 rows x 64
tokens: Python, the imports, torch among them) per token of the run's largest step, and the
recompute's time against the floor's.

``--stages``: then, in one process on the largest workload, where the high-water mark of the
process's RSS rises: while the step is fetched (read, hashed, loaded) and in each stage of the
engine (:data:`rldiag.engine.stages.STAGES`), sampled every millisecond, as bytes per token
above the RSS before the recompute. The host allocator is tuned as a recompute tunes it (freed
memory kept for reuse), so the high-water mark is the most memory live at once.

  .venv/bin/python bench/bench_memory.py                                  # tail16k, tail32k
  .venv/bin/python bench/bench_memory.py --workloads tail32k --scale 0.5 --stages
  .venv/bin/python bench/bench_memory.py --workloads step8k32k --repeat 1  # 8,192 rows, 11.9 M tokens
  .venv/bin/python bench/bench_memory.py --workloads step16m --repeat 1    # the 16 M-token step: once
  .venv/bin/python bench/bench_memory.py --workloads none --slope 192,384,768,1536

``--slope ROWS``: the marginal bytes a token, what "memory that follows tokens at a small constant"
means once the fixed costs are left out. Runs of one long-tailed shape (tail32k's: 3 steps,
lognormal lengths around 600 tokens, 2 % of the rows at the 32k cap) at several sizes (rows a
step; 192, 384, 768 and 1,536 make largest steps of about 0.3, 0.6, 1.2 and 2.4 M tokens), each
measured as whole processes: the recompute, the torch-importing decode floor and the pyarrow-only
one (bench_whole.py's); then the least-squares line of each one's peak RSS above the base against
the tokens of the run's largest step: its slope in bytes a token, and its intercept in MB (the
part of the peak that does not follow the tokens).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_recompute import CAPPED_SHARE, TAIL_CAPPED, TAILED, _pair, make_run, make_tailed_run, run_shape  # noqa: E402


def largest_step_tokens(run: Path) -> int:
    import pyarrow.compute as pc

    from rldiag.io.arrays import read_parquet

    return max(int(pc.sum(pc.list_value_length(read_parquet(f, ["response_mask"])["response_mask"])).as_py() or 0)
               for f in (run / "batches").iterdir())


def process_table(runs: dict[str, Path], repeat: int) -> None:
    cli = str(Path(sys.executable).with_name("rldiag"))
    tiny = make_run(next(iter(runs.values())).parent / "fixed-1-8-64", 1, 8, 64)
    f_r, f_d = _pair(tiny, repeat, cli)
    print(f"base (one step of 8 rows x 64 tokens): recompute {f_r['seconds']:.2f} s {f_r['peak_rss_mb']:.0f} MB, "
          f"decode {f_d['seconds']:.2f} s {f_d['peak_rss_mb']:.0f} MB")
    head = (f"{'workload':<10} {'steps x rows':>13} {'Mtokens':>8} {'largest':>8} {'rldiag s':>9} {'floor s':>8} "
            f"{'time x':>7} {'rldiag MB':>10} {'B/token':>8} {'floor MB':>9} {'floor B/t':>9}")
    print(head)
    print("-" * len(head))
    for name, run in runs.items():
        steps, rows, tokens, _ = run_shape(run)
        big = largest_step_tokens(run)
        r, d = _pair(run, repeat, cli)
        above = (r["peak_rss_mb"] - f_r["peak_rss_mb"]) * 2**20 / big
        floor_above = (d["peak_rss_mb"] - f_d["peak_rss_mb"]) * 2**20 / big
        print(f"{name:<10} {f'{steps} x {rows // steps}':>13} {tokens / 1e6:>8.2f} {big / 1e6:>8.2f} "
              f"{r['seconds']:>9.2f} {d['seconds']:>8.2f} {r['seconds'] / d['seconds']:>7.2f} "
              f"{r['peak_rss_mb']:>10.0f} {above:>8.0f} {d['peak_rss_mb']:>9.0f} {floor_above:>9.0f}")
    print()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def stage_table(run: Path) -> None:
    """Where the RSS high-water mark rises in one recompute of ``run`` (in this process)."""
    import torch

    import rldiag.executors.local as local
    import rldiag.executors.steps as steps_mod
    from rldiag.engine.stages import STAGES
    from rldiag.scenario.recompute import recompute

    where = ["start"]
    rises: dict[str, int] = {}
    peak = [rss_bytes()]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            now = rss_bytes()
            if now > peak[0]:
                rises[where[0]] = rises.get(where[0], 0) + now - peak[0]
                peak[0] = now
            time.sleep(0.001)

    def wrap(name: str, fn):
        def run(*a, **k):
            where[0] = name
            try:
                return fn(*a, **k)
            finally:
                where[0] = "between"
        return run

    for st in STAGES:
        object.__setattr__(st, "run", wrap(st.name, st.run))
    fetch = wrap("fetch (read, hash, load)", steps_mod.fetch)
    steps_mod.fetch = local.fetch = fetch  # type: ignore[assignment]
    torch.set_num_threads(1)
    base = rss_bytes()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    report = recompute(run, name="bench-memory", reuse=False, device="cpu")
    done.set()
    thread.join()
    big = largest_step_tokens(run)
    print(f"{run.name}: {report.tokens / 1e6:.2f} M tokens, largest step {big / 1e6:.2f} M; high-water mark "
          f"{(peak[0] - base) / big:.0f} bytes a token above the RSS before the recompute; where it rose:")
    for name, grew in rises.items():
        if grew >= big:  # at least a byte a token
            print(f"  {name:<28} +{grew / big:6.0f} B/token")


def least_squares(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """The least-squares line ``y = slope x + intercept`` through the points ``(xs, ys)``
    (at least two distinct ``xs``)."""
    n = len(xs)
    if n != len(ys) or n < 2:
        raise ValueError(f"need two points or more, not {n} x and {len(ys)} y")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("every x is the same: no slope")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


#: the processes of the slope table: this tree's recompute and the two decode floors (bench_whole.py)
SLOPE_PROCESSES = ("this", "torch", "arrow")


def slope_table(base: Path, rows_list: list[int], repeat: int) -> None:
    """Peak RSS above the base against the largest step's tokens, at each size; the least-squares
    slope (bytes a token) and intercept (MB) of each process (see the module's ``--slope``)."""
    from bench_whole import commands, measure

    steps, _, cap, _ = TAILED["tail32k"]
    tiny = make_run(base / "fixed-1-8-64", 1, 8, 64)

    def peaks(run: Path) -> dict[str, float]:
        cmds = {k: v for k, v in commands(run, None).items() if k in SLOPE_PROCESSES}
        got: dict[str, list[float]] = {k: [] for k in cmds}
        for _ in range(repeat):  # alternating; the least of each (the allocator's luck aside)
            for k, (cmd, path, fresh) in cmds.items():
                got[k].append(measure(cmd, path, fresh)["peak_rss_mb"])
        return {k: min(v) for k, v in got.items()}

    fixed = peaks(tiny)
    print(f"slope: {steps} steps of the tail32k shape (cap {cap:,}) at {', '.join(map(str, rows_list))} rows a step; "
          "peak RSS above the base (one step of 8 rows x 64 tokens: "
          + ", ".join(f"{k} {v:.0f} MB" for k, v in fixed.items()) + ")")
    head = f"{'rows':>6} {'Mtokens':>8} {'largest':>8}" + "".join(f" {k + ' MB':>9} {k + ' B/t':>9}" for k in fixed)
    print(head)
    print("-" * len(head))
    xs: list[float] = []
    ys: dict[str, list[float]] = {k: [] for k in fixed}
    for rows in rows_list:
        run = make_tailed_run(base / f"slope-{rows}", steps, rows, cap)
        _, _, tokens, _ = run_shape(run)
        big = largest_step_tokens(run)
        got = peaks(run)
        xs.append(big)
        cells = ""
        for k, mb in got.items():
            above = (mb - fixed[k]) * 2**20
            ys[k].append(above)
            cells += f" {mb:>9.0f} {above / big:>9.0f}"
        print(f"{rows:>6} {tokens / 1e6:>8.2f} {big / 1e6:>8.2f}{cells}", flush=True)
    print("least squares of the peak above the base against the largest step's tokens:")
    for k, y in ys.items():
        slope, intercept = least_squares(xs, y)
        marginal = ", ".join(f"{(y[i + 1] - y[i]) / (xs[i + 1] - xs[i]):.0f}" for i in range(len(xs) - 1))
        print(f"  {k:<6} slope {slope:>6.1f} bytes a token, intercept {intercept / 2**20:>7.1f} MB "
              f"(between neighbouring sizes: {marginal} B/token)")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="tail16k,tail32k", help=f"of {', '.join(TAILED)}")
    ap.add_argument("--scale", type=float, default=1.0, help="rows of each workload times this")
    ap.add_argument("--repeat", type=int, default=2, help="best of N processes")
    ap.add_argument("--stages", action="store_true", help="the RSS high-water mark's rises, stage by stage")
    ap.add_argument("--slope", default=None, metavar="ROWS",
                    help="rows a step of the slope's runs, comma-separated (e.g. 192,384,768,1536)")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="rldiag-memory-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    if args.slope:
        slope_table(base, [int(r) for r in args.slope.split(",")], args.repeat)
    runs = {}
    for name in [w for w in args.workloads.split(",") if w and w != "none"]:
        steps, rows, cap, capped_rows = TAILED[name]
        rows = max(8, int(rows * args.scale))
        t0 = time.perf_counter()
        runs[name] = make_tailed_run(base / f"{name}-{rows}", steps, rows, cap, capped_rows=capped_rows,
                                     capped=CAPPED_SHARE.get(name, TAIL_CAPPED))
        print(f"made the {name} run ({runs[name]}) in {time.perf_counter() - t0:.1f} s", flush=True)
    if not runs:
        return
    process_table(runs, args.repeat)
    if args.stages:
        stage_table(max(runs.values(), key=largest_step_tokens))


if __name__ == "__main__":
    main()
