"""What capture costs the toy trainer: ``python -m rldiag.toy.capture_cost``.

Trains the same preset (same seed, so the same work) with and without capture, alternating,
and reports the median wall time per training step of each, their difference, and capture's own
time on the training thread (unpadding + queueing) and on the writer thread (Arrow table,
validation, Parquet write and rename).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from rldiag.toy.config import PRESETS
from rldiag.toy.trainer import ToyTrainer


def measure(preset: str, steps: int, repeats: int) -> dict[str, float]:
    """Median seconds per step without / with capture (runs alternate, the order flips each
    repeat, so drifting machine load hits both alike), and capture's mean per-step thread times."""
    without, with_, train_thread, writer_thread = [], [], [], []
    for i in range(repeats):
        cfg = PRESETS[preset](steps=steps)
        for capture in ((False, True) if i % 2 == 0 else (True, False)):
            if not capture:
                without += ToyTrainer(cfg).run(None).step_seconds
                continue
            with tempfile.TemporaryDirectory() as tmp:
                summary = ToyTrainer(cfg).run(Path(tmp) / "run")
            with_ += summary.step_seconds
            stats = summary.capture
            assert stats is not None  # a run with a directory captures
            train_thread.append(stats.train_thread_s / steps)
            writer_thread.append(stats.writer_thread_s / steps)
    return {
        "step_s_without": statistics.median(without),
        "step_s_with": statistics.median(with_),
        "capture_train_thread_s": statistics.mean(train_thread),
        "capture_writer_thread_s": statistics.mean(writer_thread),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rldiag.toy.capture_cost", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="grpo-tool")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for training")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    r = measure(args.preset, args.steps, args.repeats)
    diff = r["step_s_with"] - r["step_s_without"]
    print(f"preset {args.preset}, {args.steps} steps x {args.repeats} repeats, {args.threads} torch thread(s)")
    print(f"  median step time without capture: {r['step_s_without'] * 1e3:8.2f} ms")
    print(f"  median step time with capture:    {r['step_s_with'] * 1e3:8.2f} ms  "
          f"({diff * 1e3:+.2f} ms, {diff / r['step_s_without']:+.1%})")
    print(f"  capture on the training thread: {r['capture_train_thread_s'] * 1e3:.2f} ms/step "
          f"(unpad + queue)")
    print(f"  capture on the writer thread:   {r['capture_writer_thread_s'] * 1e3:.2f} ms/step "
          f"(Arrow + validation + Parquet, overlapped with training)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
