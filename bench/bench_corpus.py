"""Benchmark: the calibration corpus, generated and calibrated, small and full.

For each size asked (``--sizes small,full``): ``python -m rldiag.toy.corpus DIR --size SIZE``
(a whole process, one torch thread, as a user runs it) then ``rldiag calibrate DIR --json``
(a whole process). Measured: the wall seconds of each, their sum against the issue's budget (small
<= 3 minutes, full <= 30 minutes on 2 cores), the runs, the pathologies not produced, and the
calibrated rules of the ``test`` split that meet the floor (precision >= 0.9, at most one false
alarm per 100 healthy steps) out of those calibrated. ``--kind K`` (repeatable) trains only those
kinds (the tests' tiny size).

Usage::

  .venv/bin/python bench/bench_corpus.py                     # small only (about 3 minutes)
  .venv/bin/python bench/bench_corpus.py --sizes small,full  # and the full corpus (up to 30 minutes)
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
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

#: the issue's budget per size, seconds (generation and calibration together, 2 cores)
BUDGET = {"small": 180, "full": 1800}


def timed(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    return time.perf_counter() - t0, proc


def bench(size: str, where: Path, kinds: list[str]) -> dict:
    out = where / f"corpus-{size}"
    gen_cmd = [sys.executable, "-m", "rldiag.toy.corpus", str(out), "--size", size]
    for k in kinds:
        gen_cmd += ["--kind", k]
    gen_s, gen = timed(gen_cmd)
    if gen.returncode not in (0, 1):  # 1: a pathology was not produced (still a corpus)
        raise SystemExit(f"corpus generation failed ({gen.returncode}):\n{gen.stderr}")
    cal_s, cal = timed([sys.executable, "-m", "rldiag.cli.main", "calibrate", str(out), "--json", "--no-progress"])
    if cal.returncode not in (0, 1):
        raise SystemExit(f"rldiag calibrate failed ({cal.returncode}):\n{cal.stderr}")
    split = json.loads(cal.stdout)
    manifest = json.loads((out / "manifest.json").read_text())
    calibrated = [r for r in split["rules"] if r["status"] == "calibrated" and r["meets_floor"] is not None]
    return {"size": size, "runs": len(manifest["runs"]), "not_produced": len(manifest["not_produced"]),
            "generate_s": gen_s, "calibrate_s": cal_s, "total_s": gen_s + cal_s, "budget_s": BUDGET[size],
            "test_runs": split["runs"], "calibrated": len(calibrated),
            "meet_floor": sum(bool(r["meets_floor"]) for r in calibrated)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="small", help="comma list of small, full (default small)")
    ap.add_argument("--kind", action="append", default=[], help="only this kind of run (repeatable)")
    ap.add_argument("--dir", type=Path, default=None, help="where the corpora go (default a temporary directory)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    with tempfile.TemporaryDirectory(prefix="rldiag-bench-corpus-") as tmp:
        where = args.dir or Path(tmp)
        rows = [bench(size, where, args.kind) for size in sizes]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'size':6} {'runs':>5} {'not produced':>12} {'generate s':>11} {'calibrate s':>12} {'total s':>8} "
          f"{'budget s':>9} {'test runs':>9} {'meet floor':>11}")
    for r in rows:
        print(f"{r['size']:6} {r['runs']:5d} {r['not_produced']:12d} {r['generate_s']:11.1f} {r['calibrate_s']:12.1f} "
              f"{r['total_s']:8.1f} {r['budget_s']:9d} {r['test_runs']:9d} {r['meet_floor']:>5d} of {r['calibrated']:<3d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
