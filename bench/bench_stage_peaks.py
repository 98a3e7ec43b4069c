"""Benchmark: each stage's own memory, per token: the RSS high-water mark while the stage runs above
the RSS at its start (``peak``), and what it leaves live (``kept``), on one step of a run.

``bench_memory.py --stages`` attributes the rises of the whole recompute's high-water mark, so a
stage that stays below an earlier stage's mark shows nothing whatever it allocates; this measures
every stage against its own start. glibc's mmap threshold is fixed (``MALLOC_MMAP_THRESHOLD_``,
set by re-running this script with it), so a large tensor's memory goes back to the system when it
is freed and the RSS follows the live tensors; sampled every half millisecond.

  .venv/bin/python bench/bench_stage_peaks.py RUN                 # the run's first step
  PYTHONPATH=OTHER_TREE .venv/bin/python bench/bench_stage_peaks.py RUN --step 1
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

#: glibc's threshold above which an allocation is its own mapping (returned to the system when freed)
MMAP_THRESHOLD = "131072"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a run directory")
    ap.add_argument("--step", type=int, default=0, help="which of its steps (0: the first)")
    args = ap.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD))

    import torch

    from rldiag.config.settings import resolve_settings
    from rldiag.engine.batch import pack
    from rldiag.engine.pipeline import initial_kl_state
    from rldiag.engine.requirements import recompute_columns
    from rldiag.engine.stages import STAGES, State
    from rldiag.engine.step_failures import StepErrors
    from rldiag.io.loader import load_step
    from rldiag.io.rundir import RunDir

    torch.set_num_threads(1)
    settings = resolve_settings(Path(args.run))
    step = RunDir(args.run).require_steps()[args.step]
    batch = pack([load_step(step, settings, recompute_columns(settings)).batch])
    peak, stop = [0], [False]

    def sample() -> None:
        while not stop[0]:
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.0005)

    threading.Thread(target=sample, daemon=True).start()
    state = State(batch, settings, initial_kl_state(settings), StepErrors(batch.steps))
    n = batch.n_tokens
    print(f"{args.run} step {args.step}: {n / 1e6:.2f} M tokens; bytes per token of each stage")
    print(f"{'stage':<20}{'peak':>8}{'kept':>8}")
    for stage in STAGES:
        start = rss_bytes()
        peak[0] = start
        stage.run(state)
        time.sleep(0.003)  # a last sample
        end = rss_bytes()
        top, kept = (max(peak[0], end) - start) / n, (end - start) / n
        if top >= 0.5 or abs(kept) >= 0.5:
            print(f"{stage.name:<20}{top:>8.1f}{kept:>+8.1f}")
    stop[0] = True


if __name__ == "__main__":
    main()
