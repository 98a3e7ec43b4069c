"""Benchmark: the doctor's counterfactual of one finding over a 20-step window.

For a clipfrac_high finding over the run's last --window steps (the built-in rule: two
alternatives, clip_ratio_high=0.28 and clip_ratio_low/high=0.3), times
:func:`rldiag.doctor.counterfactual.counterfactuals` (the baseline and both alternatives in
memory, one read of each step file, stages shared), against what the same answer costs with
one ``rldiag recompute --steps a:b [--set ...] --no-reuse`` per scenario it ran (each reads the files and writes
its scenario). The run is copied first (the recomputes write into the copy).

Usage:
  .venv/bin/python bench/bench_counterfactual.py --run samples/grpo-tool
  .venv/bin/python bench/bench_counterfactual.py --synth 20x1024   # 20 steps x 1,024 rows, lognormal lengths
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from rldiag.doctor.counterfactual import counterfactuals
from rldiag.doctor.evaluators import Evidence, Finding
from rldiag.doctor.rules import load_rules
from rldiag.io.rundir import RunDir
from rldiag.scenario.recompute import recompute


def _synth(path: Path, spec: str) -> Path:
    from rldiag.synth import SynthSpec, write_synth_run

    steps, rows = (int(x) for x in spec.split("x"))
    return write_synth_run(path, SynthSpec(steps=steps, prompts=rows // 8, n=8, lengths="lognormal", median_len=300,
                                           sigma=0.8, max_len=2048, critic=False, write_metrics=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", help="a run directory (copied)")
    ap.add_argument("--synth", help="STEPSxROWS: a synthetic run with long-tailed lengths")
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "run"
        if args.run:
            shutil.copytree(args.run, root, ignore=shutil.ignore_patterns("rldiag"))
        else:
            _synth(root, args.synth or "20x1024")
        steps = [sf.step for sf in RunDir(root).require_steps()][-args.window:]
        rule = next(r for r in load_rules() if r.id == "clipfrac_high")
        finding = Finding(rule.id, rule.title, rule.severity, rule.why, "", Evidence(window=[steps[0], steps[-1]]))
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            entries = counterfactuals(root, rule, finding, device=args.device)
            times.append(time.perf_counter() - t0)
        spec = f"{steps[0]}:{steps[-1]}"
        t0 = time.perf_counter()
        ran = [alt for alt in rule.addresses["settings"] if any(e["settings"] == alt for e in entries)]
        for alt in [{}] + ran:  # what the counterfactual ran: the baseline and each alternative the run lacks
            recompute(root, alt, steps=spec, device=args.device, reuse=False)
        naive = time.perf_counter() - t0
        print(f"window steps {spec} ({len(steps)} steps), {len(entries)} entries")
        for e in entries:
            print(f"  {e['settings']} {e['metric']}: {e['with']:.4g} instead of {e['without']:.4g}")
        print(f"counterfactual: median {statistics.median(times):.2f} s of {args.repeat} "
              f"({', '.join(f'{t:.2f}' for t in times)})")
        print(f"{1 + len(ran)} x rldiag recompute --steps {spec} --no-reuse: {naive:.2f} s")


if __name__ == "__main__":
    main()
