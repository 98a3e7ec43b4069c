"""Benchmark: every stage's share of a recompute's time, in one process, per workload.

For each workload (the uniform and long-tailed runs of bench_recompute.py, generated with
:mod:`rldiag.synth`), a child process loads every step, packs consecutive steps up to the
recompute's token budget (``DEFAULT_PACK_TOKENS``) as ``rldiag recompute`` does, then runs the
engine's stages (:data:`rldiag.engine.stages.STAGES`) over each pack, timing each stage's ``run``
in CPU seconds of the process (``time.process_time``: one torch thread, every operation
synchronous on the CPU; steadier than wall time on a machine other jobs load), with the host
allocator tuned as ``rldiag recompute`` tunes it (``tune_host_allocator``: without it, which
stage page-faults its temporaries in depends on what ran before it). Each workload is measured
``--repeat`` times; a stage's time is its best over the repeats (the least disturbed on a shared
machine). The table gives each stage's seconds and share of the summed stage time; the
diagnostic stages (health, mismatch, diag_is, turns, rows) are marked ``*``.

``--baseline REV``: the same measurement of another commit's rldiag (extracted with ``git
archive`` into a directory of its own, with its compiled kernels: bench_whole.extract),
alternating with this tree's child processes, so that both columns are measured side by side
under the same load. Usage:

  .venv/bin/python bench/bench_stages.py                                 # uniform and tail16k
  .venv/bin/python bench/bench_stages.py --baseline main --repeat 3
  .venv/bin/python bench/bench_stages.py --workloads tail32k --scale 0.5
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

#: the diagnostic stages (rldiag's own per-token work beyond what verl computes)
DIAGNOSTIC = ("health", "mismatch", "diag_is", "turns", "turns_loss", "rows", "rows_loss")
#: name -> (steps, rows, cap or tokens, lognormal?)
WORKLOADS = {
    "uniform": (10, 512, 1024, False),
    "tail16k": (4, 512, 16384, True),
    "tail32k": (2, 2048, 32768, True),
}


def make(base: Path, name: str, scale: float) -> Path:
    sys.path.insert(0, str(ROOT))
    from rldiag.synth import SynthSpec, write_synth_run

    steps, rows, cap, tailed = WORKLOADS[name]
    rows = max(8, int(rows * scale))
    path = base / f"{name}-{steps}-{rows}-{cap}"
    if (path / "batches").is_dir() and len(list((path / "batches").iterdir())) == steps:
        return path
    if tailed:
        spec = SynthSpec(steps=steps, prompts=rows // 8, n=8, min_len=16, max_len=cap, lengths="lognormal",
                         median_len=600, sigma=0.8, capped=0.02, extra_columns=True, write_metrics=False)
    else:
        spec = SynthSpec(steps=steps, prompts=rows // 8, n=8, min_len=cap, max_len=cap, extra_columns=True,
                         write_metrics=False)
    return write_synth_run(path, spec)


def child(run: str, repeat: int) -> None:
    """Print ``{"tokens": n, "stages": {name: best seconds}}`` for this process's rldiag."""
    import torch

    from rldiag.config.settings import resolve_settings
    from rldiag.engine.batch import pack
    from rldiag.engine.pipeline import initial_kl_state
    from rldiag.engine.requirements import recompute_columns
    from rldiag.engine.stages import STAGES, State
    from rldiag.engine.step_failures import StepErrors
    from rldiag.executors.steps import DEFAULT_PACK_TOKENS
    from rldiag.io.loader import load_step
    from rldiag.io.rundir import RunDir

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    try:  # the host allocator as `rldiag recompute` tunes it (else page faults weigh on every stage)
        from rldiag.executors.allocator import tune_host_allocator

        tune_host_allocator()
    except ImportError:  # a baseline older than the tuning
        pass
    settings = resolve_settings(Path(run))
    loaded = [load_step(sf, settings, recompute_columns(settings)).batch for sf in RunDir(run).require_steps()]
    packs: list[list] = [[]]
    size = 0
    for b in loaded:
        if packs[-1] and size + b.n_tokens > DEFAULT_PACK_TOKENS:
            packs.append([])
            size = 0
        packs[-1].append(b)
        size += b.n_tokens
    batches = [pack(p) for p in packs]
    best: dict[str, float] = {}
    for _ in range(repeat):
        spent = dict.fromkeys((s.name for s in STAGES), 0.0)
        for batch in batches:
            state = State(batch, settings, initial_kl_state(settings), StepErrors(batch.steps))
            for stage in STAGES:
                t0 = time.process_time()
                stage.run(state)
                spent[stage.name] += time.process_time() - t0
        best = {k: min(v, best.get(k, v)) for k, v in spent.items()}
    print(json.dumps({"tokens": sum(b.n_tokens for b in loaded), "stages": best}))


def measure(pythonpath: str, run: Path, repeat: int) -> dict:
    env = dict(os.environ, PYTHONPATH=pythonpath)
    out = subprocess.run([sys.executable, __file__, "--child", str(run), str(repeat)], env=env, check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return json.loads(out)


def table(name: str, tokens: int, cols: dict[str, dict[str, float]]) -> None:
    labels = list(cols)
    stages = list(next(iter(cols.values())))
    totals = {k: sum(v.values()) for k, v in cols.items()}
    print(f"\n{name}: {tokens / 1e6:.2f} M tokens; CPU seconds and share of the summed stage time")
    print(f"{'stage':<20}" + "".join(f"{lab + ' s':>14}{'%':>7}" for lab in labels))
    for st in stages:
        mark = "*" if st in DIAGNOSTIC else " "
        print(f"{mark}{st:<19}" + "".join(f"{cols[lab][st]:>14.4f}{cols[lab][st] / totals[lab]:>7.1%}" for lab in labels))
    print(f"{'all stages':<20}" + "".join(f"{totals[lab]:>14.4f}{1:>7.0%}" for lab in labels))
    print(f"{'diagnostic (*)':<20}" + "".join(
        f"{sum(cols[lab][s] for s in DIAGNOSTIC if s in cols[lab]):>14.4f}"
        f"{sum(cols[lab][s] for s in DIAGNOSTIC if s in cols[lab]) / totals[lab]:>7.1%}" for lab in labels))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="uniform,tail16k", help=f"from {', '.join(WORKLOADS)}")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the rows of each workload by this factor")
    ap.add_argument("--repeat", type=int, default=3, help="stage passes per child process (best of)")
    ap.add_argument("--rounds", type=int, default=1, help="alternating child processes per version (best of)")
    ap.add_argument("--baseline", default=None, help="a git revision to measure side by side")
    ap.add_argument("--dir", default=None, help="where to keep generated runs (default: a temp dir)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="rldiag-stages-"))
    base.mkdir(parents=True, exist_ok=True)
    versions = {"this": str(ROOT)}
    if args.baseline:
        from bench_whole import extract  # the revision's package, with its compiled kernels where it has any

        tree = extract(args.baseline, base)
        versions = {args.baseline: str(tree), "this": str(ROOT)}
    print(f"machine: {os.cpu_count()} cores, torch threads {os.environ.get('BENCH_THREADS', '1')}; "
          f"best of {args.repeat} passes x {args.rounds} rounds")
    for name in args.workloads.split(","):
        run = make(base, name, args.scale)
        got: dict[str, dict[str, float]] = {}
        tokens = 0
        for _ in range(args.rounds):
            for label, path in versions.items():
                res = measure(path, run, args.repeat)
                tokens = res["tokens"]
                prev = got.get(label)
                got[label] = res["stages"] if prev is None else {k: min(v, prev[k]) for k, v in res["stages"].items()}
        table(name, tokens, got)


if __name__ == "__main__":
    main()
