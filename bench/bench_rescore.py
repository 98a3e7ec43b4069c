"""Benchmark: ``rldiag rescore`` against ``rldiag recompute --no-reuse`` of the same run.

A synthetic run (``rldiag.synth``: ``--rows`` rows over ``--steps`` steps, responses of up to
``--max-len`` tokens, no critic) is given the columns a reward function reads, every row's
``response_text`` distinct (so deduplication saves nothing: every row is a call). Timed as whole
processes, best of ``--repeat``, alternating:

- ``rldiag recompute RUN --no-reuse --name bench-recompute``;
- ``rldiag rescore RUN --reward cheap.py:compute_score --workers W`` (a string compare).

Then the timeout case on the first ``--sleep-rows`` rows: a function that sleeps 1 s on 1 % of
the rows, ``--timeout 0.5``, in this process: those rows are reported, the run is written and no
worker process is left behind (each checked; the bench stops otherwise). Usage:

  .venv/bin/python bench/bench_rescore.py                      # 100,000 rows, 2 workers
  .venv/bin/python bench/bench_rescore.py --rows 20000 --sleep-rows 2000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from rldiag.io.rundir import RunDir  # noqa: E402
from rldiag.synth import SynthSpec, write_synth_run  # noqa: E402

CHEAP = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.endswith(" " + str(ground_truth)))
'''
SLEEPY = '''
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] % 100 == 0:
        time.sleep(1.0)
    return float(solution_str.endswith(" " + str(ground_truth)))
'''


def make_run(root: Path, rows: int, steps: int, max_len: int) -> Path:
    """The synthetic run with reward inputs; kept between invocations (same shape, same run)."""
    run = root / f"rescore-{rows}-{steps}-{max_len}"
    if (run / "batches").is_dir():
        return run
    n = 4
    prompts = max(1, rows // steps // n)
    write_synth_run(run, SynthSpec(steps=steps, prompts=prompts, n=n, min_len=4, max_len=max_len, critic=False,
                                   write_metrics=False))
    index = 0
    for sf in RunDir(run).step_files():
        t = pq.read_table(sf.path)
        k = t.num_rows
        ids = range(index, index + k)
        index += k
        t = t.append_column("data_source", pa.array(["bench"] * k))
        t = t.append_column("ground_truth", pa.array([json.dumps(str(i % 10)) for i in ids]))
        t = t.append_column("extra_info", pa.array([json.dumps({"index": i}) for i in ids]))
        t = t.append_column("response_text", pa.array([f"row {i} says {(i * 7) % 10}" for i in ids]))
        pq.write_table(t, sf.path)
    return run


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return time.perf_counter() - t0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def sleepy_case(run: Path, fn: Path, rows: int, workers: int) -> tuple[float, int, int]:
    """Seconds, rows reported, workers left, for the sleeping function on the run's first steps
    covering ``rows`` rows (a copy with only those steps)."""
    from rldiag import api

    files = RunDir(run).step_files()
    sub = run.parent / f"{run.name}-first-{rows}"
    if not (sub / "batches").is_dir():
        (sub / "batches").mkdir(parents=True)
        (sub / "run.yaml").write_text((run / "run.yaml").read_text())
        total = 0
        for sf in files:
            if total >= rows:
                break
            (sub / "batches" / sf.path.name).write_bytes(sf.path.read_bytes())
            total += pq.read_metadata(sf.path).num_rows
    t0 = time.perf_counter()
    res = api.rescore(sub, f"{fn}:compute_score", timeout=0.5, workers=workers, name="bench-sleepy")
    seconds = time.perf_counter() - t0
    if not res.scenario.steps_done or res.steps_failed:
        raise SystemExit(f"sleepy case: the run was not written whole: {res.steps_failed}")
    if not all(m.startswith("TimeoutError") for m in res.failures["message"].to_list()):
        raise SystemExit("sleepy case: a failure other than a timeout")
    return seconds, res.failures.height, sum(_alive(p) for p in res.worker_pids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "rldiag-bench-rescore")
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--max-len", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--sleep-rows", type=int, default=10_000, help="rows of the timeout case (0: skip it)")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    run = make_run(args.dir, args.rows, args.steps, args.max_len)
    print(f"run {run}: {args.rows} rows x {args.steps} steps (made in {time.perf_counter() - t0:.1f}s)")
    cheap, sleepy = args.dir / "cheap.py", args.dir / "sleepy.py"
    cheap.write_text(CHEAP)
    sleepy.write_text(SLEEPY)
    rldiag = [sys.executable, "-m", "rldiag.cli.main"]
    best_rc = best_rs = float("inf")
    for _ in range(args.repeat):
        best_rc = min(best_rc, timed([*rldiag, "recompute", str(run), "--no-reuse", "--name", "bench-recompute"]))
        best_rs = min(best_rs, timed([*rldiag, "rescore", str(run), "--reward", f"{cheap}:compute_score",
                                      "--workers", str(args.workers), "--name", "bench-rescore"]))
    meta = json.loads((run / "rldiag" / "scenarios" / "bench-rescore" / "scenario.json").read_text())
    print(f"{'rows':>8} {'calls':>8} {'recompute s':>12} {'rescore s':>10} {'ratio':>6}")
    print(f"{args.rows:>8} {meta['reward']['calls']:>8} {best_rc:>12.2f} {best_rs:>10.2f} {best_rs / best_rc:>6.2f}")
    if args.sleep_rows:
        seconds, reported, left = sleepy_case(run, sleepy, args.sleep_rows, args.workers)
        print(f"sleep 1 s on 1% of {args.sleep_rows} rows, --timeout 0.5: {reported} rows reported, "
              f"{left} workers left, {seconds:.1f}s")
        if left:
            raise SystemExit("workers left behind")
    return 0


if __name__ == "__main__":
    sys.exit(main())
