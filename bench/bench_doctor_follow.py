"""Benchmark: ``rldiag doctor RUN --follow --json`` against a run that is being written.

1. Live latency. A writer process copies a synthetic GRPO run (``rldiag.synth``: ``--prompts``
   x ``--n`` rows per step) into a fresh run directory at ``--rate`` steps per second, each
   step's batch file first (written aside and renamed, as a trainer's dump lands) and then its
   ``metrics.jsonl`` line, whose logged ``actor/entropy_loss`` falls to 1 % of its level from
   step ``--collapse-at`` (the batches' token entropies too, so that the recomputed value agrees).
   follows it. Measured: the delay from the moment the data of the step at which
   ``entropy_collapse`` fires landed (its batch file, written before its metrics line) to the
   follower printing its ``fired`` line (target <= 2 s), and whether that step is the one the rule
   first holds at on the logged series (evaluated step by step); and, when
   ``rldiag.doctor.counterfactual`` is installed, the further delay to the ``changed`` line that
   carries the counterfactual (target <= 10 s); else "not measured".
2. Evaluation cost. :class:`rldiag.doctor.live.LiveDoctor` with the built-in rules under GRPO
   settings, fed ``--eval-steps`` logged steps of 12 metrics; the cost of one more step (add its
   line, evaluate every rule) at that size, median of the last ``--eval-repeat`` steps, against
   the same rules reading series rebuilt from per-step Python dicts (the table before the live
   doctor).

Usage::

  .venv/bin/python bench/bench_doctor_follow.py                # 80 steps at 2/s, collapse at 50
  .venv/bin/python bench/bench_doctor_follow.py --eval-steps 10000 --skip-live
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from rldiag.config.settings import resolve_settings  # noqa: E402
from rldiag.doctor.evaluators import Series  # noqa: E402
from rldiag.doctor.live import LiveDoctor  # noqa: E402
from rldiag.doctor.rules import load_rules  # noqa: E402
from rldiag.doctor.signals import SignalTable  # noqa: E402
from rldiag.synth import SynthSpec, write_synth_run  # noqa: E402

LOGGED = ("actor/entropy_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "response/aborted_ratio",
          "response_length/clip_ratio", "rollout_corr/kl", "rollout_corr/chi2_token", "rollout_corr/log_ppl_abs_diff",
          "rollout_corr/rollout_is_eff_sample_size", "critic/score/mean", "timing/step")


def logged_line(step: int, collapse_at: int, rng: np.random.Generator) -> dict:
    """A healthy step's logged metrics; ``actor/entropy_loss`` at 1 % of its level from ``collapse_at``."""
    level = 1.0 if step < collapse_at else 0.01
    return {"actor/entropy_loss": level * (1 + 0.02 * float(rng.normal())), "actor/pg_clipfrac": 0.05,
            "actor/ppo_kl": 0.01 + 0.001 * float(rng.normal()), "actor/pg_clipfrac_lower": 0.0,
            "response/aborted_ratio": 0.0, "response_length/clip_ratio": 0.02, "rollout_corr/kl": 1e-4,
            "rollout_corr/chi2_token": 1e-3, "rollout_corr/log_ppl_abs_diff": 1e-4,
            "rollout_corr/rollout_is_eff_sample_size": 0.97, "critic/score/mean": float(rng.uniform()),
            "timing/step": 30.0}


# ---- the writer (its own process) ---------------------------------------------------------------


def writer(src: Path, dst: Path, steps: int, rate: float, collapse_at: int, times: Path) -> None:
    rng = np.random.default_rng(1)
    t0 = time.time()
    with open(dst / "metrics.jsonl", "ab") as metrics, open(times, "w") as out:
        for step in range(1, steps + 1):
            time.sleep(max(0.0, t0 + step / rate - time.time()))
            name = f"step_{step}.parquet"
            shutil.copy(src / "batches" / name, dst / "batches" / f".{name}.tmp")
            os.replace(dst / "batches" / f".{name}.tmp", dst / "batches" / name)
            batch_t = time.time()
            metrics.write((json.dumps({"step": step, "data": logged_line(step, collapse_at, rng)}) + "\n").encode())
            metrics.flush()
            out.write(json.dumps({"step": step, "batch_t": batch_t, "line_t": time.time()}) + "\n")
            out.flush()


# ---- 1. live latency ----------------------------------------------------------------------------


def collapse_batches(src: Path, collapse_at: int) -> None:
    """The batches' token entropies at 1 % from ``collapse_at`` too, so that the recomputed
    ``actor/entropy_loss`` agrees with the logged one (as it does for a real run)."""
    for path in sorted((src / "batches").glob("step_*.parquet")):
        if int(path.stem.split("_")[1]) >= collapse_at:
            table = pq.read_table(path)
            col = table["entropy"].combine_chunks()
            scaled = pa.ListArray.from_arrays(col.offsets, pc.multiply(col.flatten(), pa.scalar(0.01, pa.float32())))
            pq.write_table(table.set_column(table.schema.get_field_index("entropy"), "entropy", scaled), path)


def first_holding_step(steps: int, collapse_at: int) -> int | None:
    """The first step at which ``entropy_collapse`` holds on the logged series the writer writes."""
    rule = [r for r in load_rules() if r.id == "entropy_collapse"]
    doc = LiveDoctor({}, rule)
    rng = np.random.default_rng(1)
    for step in range(1, steps + 1):
        doc.add_logged(step, logged_line(step, collapse_at, rng))
        if any(e.event == "fired" for e in doc.evaluate(step)):
            return step
    return None


def live(args: argparse.Namespace, base: Path) -> dict:
    src = write_synth_run(base / "src", SynthSpec(steps=args.steps, prompts=args.prompts, n=args.n, critic=False,
                                                  write_metrics=False, seed=0))
    collapse_batches(src, args.collapse_at)
    dst = base / "run"
    (dst / "batches").mkdir(parents=True)
    shutil.copy(src / "run.yaml", dst / "run.yaml")
    target = first_holding_step(args.steps, args.collapse_at)
    lines: list[tuple[float, dict]] = []
    follower = subprocess.Popen(
        [sys.executable, "-m", "rldiag.cli.main", "doctor", str(dst), "--follow", "--json", "--poll", str(args.poll),
         "--idle-timeout", str(args.idle_timeout)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)

    def read() -> None:
        assert follower.stdout is not None
        for line in follower.stdout:
            lines.append((time.time(), json.loads(line)))

    rss: list[tuple[float, int]] = []  # (time, the follower's resident memory in kB)

    def sample() -> None:
        while follower.poll() is None:
            kb = rss_kb(follower.pid)
            if kb is not None:
                rss.append((time.time(), kb))
            time.sleep(args.rss_every)

    reader = threading.Thread(target=read)
    reader.start()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    time.sleep(args.warmup)  # the follower imports and catches up with the empty run
    times = base / "times.jsonl"
    subprocess.run([sys.executable, __file__, "--writer", str(src), str(dst), "--steps", str(args.steps), "--rate",
                    str(args.rate), "--collapse-at", str(args.collapse_at), "--times", str(times)], check=True)
    _, err = follower.communicate(timeout=600)
    reader.join()
    # a step's data lands with its batch file (first) or its line: the delay counts from the first
    written = {d["step"]: min(d["batch_t"], d["line_t"]) for d in map(json.loads, times.read_text().splitlines())}
    fired = [(t, e) for t, e in lines if e["event"] == "fired" and e["finding"]["rule"] == "entropy_collapse"]
    changed = [(t, e) for t, e in lines if e["event"] == "changed" and e["finding"]["rule"] == "entropy_collapse"
               and e["finding"]["counterfactual"]]
    try:
        import rldiag.doctor.counterfactual  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
        have_cf = True
    except ImportError:
        have_cf = False
    out = {"target_step": target, "fired_step": fired[0][1]["step"] if fired else None, "events": len(lines),
           "fired_s": fired[0][0] - written[fired[0][1]["step"]] if fired else None,
           "changed_s": changed[0][0] - fired[0][0] if changed and fired else None, "counterfactual": have_cf,
           "rc": follower.returncode, "summary": err.strip().splitlines()[-1] if err.strip() else "",
           "rss": rss, "written": written}
    return out


def rss_kb(pid: int) -> int | None:
    """A process's resident memory (kB, ``VmRSS`` of ``/proc/PID/status``); None when gone or not Linux."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


# ---- 2. evaluation cost -------------------------------------------------------------------------


class DictTable(SignalTable):
    """The table before the live doctor: ``{metric: {step: value}}``, each series rebuilt on every read."""

    def __init__(self) -> None:
        super().__init__()
        self.by_step: dict[str, dict[int, float]] = {}

    def add_logged(self, step, values) -> None:
        for k, v in values.items():
            self.by_step.setdefault(k, {})[step] = float(v)

    def series(self, name, source="any", tail=None):
        d = self.by_step.get(name)
        if not d or source == "recomputed":
            return None
        steps = np.array(sorted(d), dtype=np.int64)
        return Series(name, steps, np.array([d[s] for s in steps], dtype=np.float64), "logged")


def eval_cost(n_steps: int, repeat: int, table: SignalTable | None = None) -> tuple[float, float]:
    """(median, max) milliseconds of one more step (its line added, every rule evaluated) at ``n_steps``."""
    base = Path(tempfile.mkdtemp(prefix="rldiag-bench-eval-"))
    run = write_synth_run(base / "run", SynthSpec(steps=1, prompts=1, n=2, critic=False))
    settings = resolve_settings(run, {})
    doc = LiveDoctor({**settings.values, **settings.resolved()})
    if table is not None:
        doc.table = table
    rng = np.random.default_rng(0)
    for step in range(1, n_steps - repeat + 1):
        doc.add_logged(step, logged_line(step, n_steps // 2, rng))
    costs = []
    for step in range(n_steps - repeat + 1, n_steps + 1):
        line = logged_line(step, n_steps // 2, rng)
        t = time.perf_counter()
        doc.add_logged(step, line)
        doc.evaluate(step)
        costs.append((time.perf_counter() - t) * 1e3)
    shutil.rmtree(base, ignore_errors=True)
    return statistics.median(costs), max(costs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--writer", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    p.add_argument("--times", help=argparse.SUPPRESS)
    p.add_argument("--dir", help="where the runs go (default: a temporary directory)")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--rate", type=float, default=2.0, help="steps written per second")
    p.add_argument("--collapse-at", type=int, default=50)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--poll", type=float, default=0.5)
    p.add_argument("--idle-timeout", type=float, default=10.0, help="the follower's (counted from its start)")
    p.add_argument("--warmup", type=float, default=4.0, help="seconds the follower gets to start before the writer")
    p.add_argument("--eval-steps", type=int, default=10_000)
    p.add_argument("--eval-repeat", type=int, default=50)
    p.add_argument("--skip-live", action="store_true")
    p.add_argument("--rss-every", type=float, default=0.5, help="seconds between two looks at the follower's memory")
    args = p.parse_args()
    if args.writer:
        writer(Path(args.writer[0]), Path(args.writer[1]), args.steps, args.rate, args.collapse_at, Path(args.times))
        return
    base = Path(args.dir or tempfile.mkdtemp(prefix="rldiag-bench-follow-"))
    if not args.skip_live:
        r = live(args, base)
        print(f"live: {args.steps} steps of {args.prompts * args.n} rows at {args.rate:g} steps/s, entropy at 1 % "
              f"from step {args.collapse_at}; follower --poll {args.poll:g}, exit {r['rc']}")
        print(f"{'event':<34}{'step':>6}{'delay s':>10}  target")
        print("-" * 60)
        fired = "missing" if r["fired_s"] is None else f"{r['fired_s']:.2f}"
        print(f"{'entropy_collapse fired':<34}{r['fired_step'] or '-':>6}{fired:>10}  <= 2 s; the rule first holds at "
              f"step {r['target_step']}")
        if r["counterfactual"]:
            changed = "missing" if r["changed_s"] is None else f"{r['changed_s']:.2f}"
            print(f"{'changed (counterfactual)':<34}{'':>6}{changed:>10}  <= 10 s after fired")
        else:
            print(f"{'changed (counterfactual)':<34}{'':>6}{'n/a':>10}  not measured: rldiag.doctor.counterfactual "
                  "is not installed")
        print(f"follower: {r['events']} event lines; {r['summary']}")
        print()
    print(f"evaluation: one more logged step ({len(LOGGED)} metrics), every built-in rule, median / max of "
          f"{args.eval_repeat} steps")
    print(f"{'steps':>8}{'columns ms':>12}{'max':>8}{'dicts ms':>10}{'max':>8}")
    print("-" * 46)
    for n in sorted({max(args.eval_repeat + 1, args.eval_steps // 10), args.eval_steps}):
        med, top = eval_cost(n, args.eval_repeat)
        dmed, dtop = eval_cost(n, args.eval_repeat, DictTable())
        print(f"{n:>8}{med:>12.2f}{top:>8.2f}{dmed:>10.2f}{dtop:>8.2f}")


if __name__ == "__main__":
    main()
