"""Benchmark: the capture never slows training, and ``doctor --follow`` keeps up with a fast writer.

1. Training step time under each capture fault. The toy trainer (``rldiag.toy``, GRPO with tool
   calls, CPU) trains ``--steps`` steps capturing into a fresh run directory, once with no fault
   and once under each fault, injected from step ``--fault-from`` on through the writer's one
   I/O seam (:class:`rldiag.capture.diskio.WriterDisk`) or the doctor's hook: a full disk
   (ENOSPC) on the batch files and on ``metrics.jsonl``, a permission denied (EACCES), the run
   directory removed, a writer slower than training (each batch write sleeps ``--slow-factor``
   times the no-fault step), and with the doctor on (``RLDIAG_DOCTOR=1``'s hook): a rule raising,
   the recompute raising MemoryError, the recompute slower than a step. Measured: the median step
   time (the first ``--warmup`` steps left out) against the same run without the fault (target:
   within 5 %), the steps dropped and the errors counted, and the warnings (one per fault).
2. ``rldiag doctor --follow`` under a fast writer (``bench_doctor_follow.py``'s live run): 64-row
   batches (``--prompts`` x ``--n``), ``--follow-steps`` steps (2,000 by default) at ``--rate``
   (10) steps per second. Measured: the delay from the collapse step's data landing to the
   ``fired`` line (target <= 2 s), and the follower's resident memory over the run (flat: its
   last quarter against its second, and that growth per step written).

Usage::

  .venv/bin/python bench/bench_capture_faults.py                          # the defaults above
  .venv/bin/python bench/bench_capture_faults.py --steps 8 --follow-steps 200   # a quick look
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

import torch  # noqa: E402

from rldiag.capture import health  # noqa: E402
from rldiag.capture.diskio import WriterDisk  # noqa: E402
from rldiag.capture.faults import CaptureWarning  # noqa: E402
from rldiag.doctor.live import LiveDoctor  # noqa: E402
from rldiag.toy.config import PRESETS  # noqa: E402
from rldiag.toy.trainer import ToyTrainer  # noqa: E402

# ---- 1. step time under each fault ---------------------------------------------------------------


class Fault:
    """One fault: the patches it applies (given the step it starts at and the no-fault step
    time), whether the doctor runs, and a step callback (the directory removal)."""

    def __init__(self, name: str, patches: Callable[[int, float], list] = lambda start, step_s: [],
                 doctor: bool = False, on_step: Callable[[Path, int, int], None] | None = None):
        self.name, self.patches, self.doctor, self.on_step = name, patches, doctor, on_step


def _os_error(code: int) -> OSError:
    return OSError(code, os.strerror(code))


def failing_batches(code: int) -> Callable[[int, float], list]:
    real = WriterDisk.write_step

    def patches(start: int, step_s: float) -> list:
        def write_step(self, payload, compression, token_text):
            if payload.step >= start:
                raise _os_error(code)
            return real(self, payload, compression, token_text)

        return [mock.patch.object(WriterDisk, "write_step", write_step)]

    return patches


def failing_metrics(start: int, step_s: float) -> list:
    real = WriterDisk.append_line
    seen = {"lines": 0}

    def append_line(self, line):
        seen["lines"] += 1
        if seen["lines"] >= start:
            raise _os_error(errno.ENOSPC)
        return real(self, line)

    return [mock.patch.object(WriterDisk, "append_line", append_line)]


def slow_writer(factor: float) -> Callable[[int, float], list]:
    real = WriterDisk.write_step

    def patches(start: int, step_s: float) -> list:
        def write_step(self, payload, compression, token_text):
            if payload.step >= start:
                time.sleep(factor * step_s)
            return real(self, payload, compression, token_text)

        return [mock.patch.object(WriterDisk, "write_step", write_step)]

    return patches


def rule_raising(start: int, step_s: float) -> list:
    real = LiveDoctor.evaluate

    def evaluate(self, step):
        if step >= start:
            raise RuntimeError("a rule's bug")
        return real(self, step)

    return [mock.patch.object(LiveDoctor, "evaluate", evaluate)]


def recompute_fault(slow_factor: float | None) -> Callable[[int, float], list]:
    real = health.StepRecompute.__call__

    def patches(start: int, step_s: float) -> list:
        def call(self, step):
            if step >= start:
                if slow_factor is None:
                    raise MemoryError("cannot allocate")
                time.sleep(slow_factor * step_s)
            return real(self, step)

        return [mock.patch.object(health.StepRecompute, "__call__", call)]

    return patches


def remove_dir(run: Path, step: int, start: int) -> None:
    if step == start:
        shutil.rmtree(run, ignore_errors=True)


def faults(args: argparse.Namespace) -> list[Fault]:
    return [
        Fault("none"),
        Fault("ENOSPC on batch files", failing_batches(errno.ENOSPC)),
        Fault("ENOSPC on metrics.jsonl", failing_metrics),
        Fault("EACCES on batch files", failing_batches(errno.EACCES)),
        Fault("run directory removed", on_step=remove_dir),
        Fault(f"writer {args.slow_factor:g}x slower", slow_writer(args.slow_factor)),
        Fault("none, doctor on", doctor=True),
        Fault("a rule raising", rule_raising, doctor=True),
        Fault("recompute MemoryError", recompute_fault(None), doctor=True),
        Fault(f"recompute {args.slow_factor:g}x a step", recompute_fault(args.slow_factor), doctor=True),
    ]


def train(fault: Fault, base: Path, args: argparse.Namespace, step_s: float) -> dict:
    run = base / fault.name.replace(" ", "_").replace("/", "_")
    shutil.rmtree(run, ignore_errors=True)
    trainer = ToyTrainer(PRESETS["grpo-tool"](steps=args.steps))
    on_step = (lambda step, _: fault.on_step(run, step, args.fault_from)) if fault.on_step else None
    with ExitStack() as stack, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for patch in fault.patches(args.fault_from, step_s):
            stack.enter_context(patch)
        summary = trainer.run(run, doctor=fault.doctor, on_step=on_step, queue_size=args.queue_size,
                              writer_options={"max_wait_s": args.max_wait_s})
    times = summary.step_seconds[args.warmup:]
    stats = summary.capture
    assert stats is not None
    return {"median": statistics.median(times), "steps": len(summary.step_seconds), "dropped": stats.dropped_steps,
            "errors": stats.errors, "warnings": sum(issubclass(w.category, CaptureWarning) for w in seen)}


def step_times(args: argparse.Namespace, base: Path) -> None:
    """Every fault ``--rounds`` times, the rounds interleaved (a load that comes and goes hits all
    of them alike); per fault, the lowest of its rounds' median step times."""
    torch.set_num_threads(1)
    print(f"training step under each fault: toy grpo-tool, {args.steps} steps, faults from step {args.fault_from}, "
          f"median of steps {args.warmup + 1}-{args.steps}, best of {args.rounds} interleaved rounds")
    print(f"{'fault':<28}{'steps':>6}{'median s':>10}{'vs none':>9}{'dropped':>9}{'errors':>8}{'warned':>8}")
    print("-" * 78)
    step_s = 0.5
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for fault in faults(args):
            r = train(fault, base, args, step_s)
            if fault.name == "none":
                step_s = r["median"]
            if fault.name not in best or r["median"] < best[fault.name]["median"]:
                best[fault.name] = r
    reference: dict[bool, float] = {}
    for fault in faults(args):
        r = best[fault.name]
        if fault.name.startswith("none"):
            reference[fault.doctor] = r["median"]
        ratio = r["median"] / reference[fault.doctor] - 1
        print(f"{fault.name:<28}{r['steps']:>6}{r['median']:>10.3f}{ratio * 100:>8.1f}%{r['dropped']:>9}"
              f"{r['errors']:>8}{r['warnings']:>8}")
    print("target: every fault within 5 % of its no-fault run (doctor-on faults against 'none, doctor on'), "
          "one warning per fault")
    print()


# ---- 2. doctor --follow under a fast writer -------------------------------------------------------


def follow(args: argparse.Namespace, base: Path) -> None:
    import bench_doctor_follow as bdf

    live_args = argparse.Namespace(steps=args.follow_steps, prompts=args.prompts, n=args.n, rate=args.rate,
                                   collapse_at=args.collapse_at or max(2, args.follow_steps * 3 // 4),
                                   poll=args.poll, idle_timeout=args.idle_timeout, warmup=args.follow_warmup,
                                   rss_every=0.5)
    t0 = time.perf_counter()
    r = bdf.live(live_args, base / "follow")
    wall = time.perf_counter() - t0
    print(f"doctor --follow under a fast writer: {live_args.steps} steps of {args.prompts * args.n} rows at "
          f"{args.rate:g} steps/s (collapse at step {live_args.collapse_at}); follower --poll {args.poll:g}, exit "
          f"{r['rc']}, {wall:.0f} s in all")
    fired = "missing" if r["fired_s"] is None else f"{r['fired_s']:.2f}"
    print(f"{'entropy_collapse fired':<28}{'step':>6}{r['fired_step'] or '-':>6}  delay {fired} s (target <= 2 s; "
          f"the rule first holds at step {r['target_step']})")
    rss = r["rss"]
    written = r["written"]
    if rss and written:
        start, end = min(written.values()), max(written.values())
        span = max(end - start, 1e-9)

        def quarter(q: int) -> float | None:
            got = [kb for t, kb in rss if start + (q - 1) * span / 4 <= t <= start + q * span / 4]
            return max(got) / 1024 if got else None

        quarters = [quarter(q) for q in (1, 2, 3, 4)]
        cells = "  ".join("-" if q is None else f"{q:.0f}" for q in quarters)
        flat = (f"{(quarters[3] / quarters[1] - 1) * 100:+.1f} %" if quarters[1] and quarters[3] else "n/a")
        # growth per step written: second quarter's peak to the last's, half the run apart
        per_step = (f"{(quarters[3] - quarters[1]) * 1024 / (live_args.steps / 2):+.1f} KB per step"
                    if quarters[1] and quarters[3] else "n/a")
        print(f"follower resident memory, peak MiB per quarter of the run: {cells}  (last vs second quarter {flat}, "
              f"{per_step}; flat is the target)")
    else:
        print("follower resident memory: not measured (no /proc)")
    print(f"follower: {r['events']} event lines; {r['summary']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="where the runs go (default: a temporary directory)")
    p.add_argument("--steps", type=int, default=20, help="toy training steps per fault")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every fault (the best one counts)")
    p.add_argument("--fault-from", type=int, default=3)
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument("--queue-size", type=int, default=8)
    p.add_argument("--max-wait-s", type=float, default=1.0, help="the writer's bound on the training thread's wait")
    p.add_argument("--follow-steps", type=int, default=2000)
    p.add_argument("--rate", type=float, default=10.0, help="steps written per second (follow)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--collapse-at", type=int, default=0, help="default: three quarters into the run")
    p.add_argument("--poll", type=float, default=0.5)
    p.add_argument("--idle-timeout", type=float, default=15.0)
    p.add_argument("--follow-warmup", type=float, default=4.0)
    p.add_argument("--skip-steps", action="store_true")
    p.add_argument("--skip-follow", action="store_true")
    args = p.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="rldiag-bench-faults-"))
    if not args.skip_steps:
        step_times(args, base)
    if not args.skip_follow:
        follow(args, base)


if __name__ == "__main__":
    main()
