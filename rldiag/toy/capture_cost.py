"""What capture costs the toy trainer: ``python -m rldiag.toy.capture_cost``.

``--doctor``: what the doctor in the capture (``RLDIAG_DOCTOR=1``) costs the training thread on a
realistic step instead (``--rows`` responses of long-tailed lengths up to ``--width`` tokens).

Trains the same preset (same seed, so the same work) with and without capture, alternating,
and reports the median wall time per training step of each, their difference, and capture's own
time on the training thread (unpadding + queueing) and on the writer thread (Arrow table,
validation, Parquet write and rename).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from rldiag.capture import RunWriter
from rldiag.capture.health import build_hook
from rldiag.toy.algos import grpo_advantages
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
    ap.add_argument("--doctor", action="store_true", help="the doctor's cost on a realistic step instead")
    ap.add_argument("--rows", type=int, default=1024, help="--doctor: responses per step")
    ap.add_argument("--width", type=int, default=4096, help="--doctor: max response length")
    ap.add_argument("--work-s", type=float, default=2.0, help="--doctor: the trainer's own time per step")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.doctor:
        return doctor_main(args)
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



# ---- the doctor in the capture (RLDIAG_DOCTOR=1) on a realistic step ------------------------------


def realistic_step(step: int, rows: int, width: int, n: int = 8, prompt: int = 256) -> SimpleNamespace:
    """A GRPO step as verl hands it to the capture: ``rows`` responses in groups of ``n``,
    long-tailed lengths (log-normal, median ~width/8, capped at ``width``: a few rows reach it),
    0/1 scores, π_old / reference / rollout log-probs, GRPO advantages."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.exp(math.log(width / 8) + 0.9 * torch.randn(rows, generator=g)).long().clamp(1, width)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    scores = torch.zeros(rows, width)
    scores[torch.arange(rows), lengths - 1] = (torch.rand(rows, generator=g) < 0.4).float()
    old = -torch.rand(rows, width, generator=g).pow(3) * 3 * mask
    uids = [f"s{step}-p{i // n}" for i in range(rows)]
    adv, ret = grpo_advantages(scores, mask.float(), uids)
    batch = {"responses": torch.randint(3, 30000, (rows, width), generator=g) * mask,
             "attention_mask": torch.cat([torch.ones(rows, prompt, dtype=torch.long), mask], 1),
             "response_mask": mask, "token_level_scores": scores, "token_level_rewards": scores,
             "old_log_probs": old, "ref_log_prob": (old + 0.05 * torch.randn(rows, width, generator=g)) * mask,
             "rollout_log_probs": (old + 0.02 * torch.randn(rows, width, generator=g)) * mask,
             "advantages": adv, "returns": ret}
    return SimpleNamespace(batch=batch, non_tensor_batch={"uid": np.array(uids, dtype=object)})


def realistic_metrics(step: int) -> dict[str, float]:
    """About the keys a verl step logs that the built-in rules read (and more, as verl logs)."""
    rng = np.random.default_rng(step)
    out = {f"timing_s/{k}": float(rng.uniform(1, 30)) for k in ("gen", "old_log_prob", "ref", "adv", "update_actor")}
    out.update({f"critic/{k}/{s}": float(rng.normal()) for k in ("score", "rewards", "advantages", "returns")
                for s in ("mean", "max", "min")})
    out.update({"actor/pg_clipfrac": float(rng.uniform(0.0, 0.2)), "actor/ppo_kl": float(rng.normal(0, 0.01)),
                "actor/pg_clipfrac_lower": 0.0, "actor/entropy_loss": float(1.0 - 0.01 * step),
                "response_length/clip_ratio": 0.02, "response/aborted_ratio": 0.0, "training/global_step": step})
    return out


def measure_doctor(rows: int, width: int, steps: int, work_s: float, repeats: int) -> dict[str, float]:
    """Per step, the training thread's time in the capture (``write_batch``, the doctor's
    ``on_log``, ``log_metrics``, the end-of-step ``sync``, the doctor's ``after_step``: the
    order of ``rldiag.capture.verl``'s ``Tracking.log``) with and without the
    doctor, the trainer's own work standing in as ``work_s`` of waiting (a verl driver waits on its
    GPU workers); and the writer thread's recompute time per step."""
    config = {"algorithm": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True},
              "actor_rollout_ref": {"rollout": {"n": 8, "calculate_log_probs": True}},
              "data": {"max_response_length": width, "max_prompt_length": 256}}
    times: dict[bool, list[float]] = {False: [], True: []}
    recompute_s: list[float] = []
    for i in range(repeats):
        for doctor in ((False, True) if i % 2 == 0 else (True, False)):
            with tempfile.TemporaryDirectory() as tmp:
                run = Path(tmp) / "run"
                with RunWriter(run, config=config) as writer:
                    hook = build_hook(run, writer.run_on_writer) if doctor else None
                    if hook is not None and hook.recompute is not None:
                        hook.recompute = _timed(hook.recompute, recompute_s)
                    for step in range(1, steps + 1):
                        batch = realistic_step(step, rows, width)  # made outside the timed part
                        time.sleep(work_s)  # the trainer's step (GPU work the driver waits on)
                        t0 = time.perf_counter()
                        writer.write_batch(step, batch)
                        metrics = realistic_metrics(step)
                        if hook is not None:
                            metrics.update(hook.on_log(step, metrics))
                        writer.log_metrics(step, metrics)
                        writer.sync()  # the capture's end-of-step barrier, then the recompute is queued
                        if hook is not None:
                            hook.after_step(step)
                        times[doctor].append(time.perf_counter() - t0)
                    if hook is not None:
                        hook.close()
    tokens = float(sum(int(realistic_step(s, rows, width).batch["response_mask"].sum())
                       for s in range(1, steps + 1)) / steps)
    return {"train_s_without": statistics.median(times[False]), "train_s_with": statistics.median(times[True]),
            "recompute_s": statistics.median(recompute_s) if recompute_s else float("nan"), "tokens": tokens}


def _timed(fn, into: list[float]):
    def timed(step: int):
        t0 = time.perf_counter()
        try:
            return fn(step)
        finally:
            into.append(time.perf_counter() - t0)

    return timed


def doctor_main(args: argparse.Namespace) -> int:
    r = measure_doctor(args.rows, args.width, args.steps, args.work_s, args.repeats)
    without, with_ = r["train_s_without"], r["train_s_with"]
    print(f"{args.rows} rows x up to {args.width} tokens ({r['tokens']:.0f} response tokens/step, long-tailed), "
          f"{args.steps} steps x {args.repeats} repeats, trainer work {args.work_s:.1f} s/step, "
          f"{args.threads} torch thread(s)")
    print(f"  training thread in the capture, median per step, without the doctor: {without * 1e3:8.1f} ms")
    print(f"  training thread in the capture, median per step, with the doctor:    {with_ * 1e3:8.1f} ms  "
          f"(x{with_ / without:.2f})")
    print(f"  step time ratio with / without (work + capture): {(args.work_s + with_) / (args.work_s + without):.4f}")
    print(f"  the doctor's recompute on the writer thread: {r['recompute_s'] * 1e3:.0f} ms/step (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
