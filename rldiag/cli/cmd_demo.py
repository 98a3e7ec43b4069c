"""``rldiag demo [--live] [--out DIR]``: train the toy trainer into a fresh run directory."""

from __future__ import annotations

import argparse
import shlex
from datetime import datetime
from pathlib import Path

from rldiag.cli import exit_codes
from rldiag.cli.common import console, fmt
from rldiag.errors import ConfigError

SHOWN = (
    ("critic/score/mean", "score"),
    ("task/exact_match", "exact"),
    ("task/tool_call_ratio", "tool"),
    ("actor/pg_clipfrac", "clipfrac"),
    ("actor/ppo_kl", "ppo_kl"),
    ("response_length/mean", "len"),
)


def add_parser(sub) -> None:
    from rldiag.toy.config import PRESETS

    sp = sub.add_parser(
        "demo", help="train a tiny RL model on the CPU into a fresh run directory, to watch with the app",
        description="Train rldiag's toy trainer (a real on-policy RL run, see rldiag.toy) into a fresh run "
                    "directory, one batch file and one metrics line per step.",
    )
    sp.add_argument("--out", type=Path, help="the run directory to create (default ./rldiag-demo-<time>)")
    sp.add_argument("--live", action="store_true", help="pace the steps so that a watcher sees them arrive")
    sp.add_argument("--pace", type=float, default=2.0, help="with --live: seconds per step (default 2)")
    sp.add_argument("--preset", choices=sorted(PRESETS), default="grpo-tool", help="what to train (default grpo-tool)")
    sp.add_argument("--steps", type=int, help="number of steps (default: the preset's)")
    sp.add_argument("--seed", type=int, help="random seed (default: the preset's)")
    sp.set_defaults(func=run)


def _fresh_dir(out: Path | None) -> Path:
    out = out or Path(f"rldiag-demo-{datetime.now():%Y%m%d-%H%M%S}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: exists and is not empty; the demo trains into a fresh run directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def run(args: argparse.Namespace) -> int:
    from rldiag.toy.config import PRESETS
    from rldiag.toy.trainer import ToyTrainer

    changes = {k: v for k, v in (("steps", args.steps), ("seed", args.seed)) if v is not None}
    cfg = PRESETS[args.preset](**changes)
    out = _fresh_dir(args.out).resolve()
    console.print(f"training {args.preset} ({cfg.adv_estimator}, {cfg.steps} steps, {cfg.rows} rows/step) into {out}",
                  soft_wrap=True, markup=False)
    console.print(f"watch it:  rldiag app {shlex.quote(str(out))}", soft_wrap=True, markup=False)

    def on_step(step: int, m: dict[str, float]) -> None:
        shown = "  ".join(f"{label} {fmt(m.get(key))}" for key, label in SHOWN)
        console.print(f"step {step:3d}/{cfg.steps}  {shown}", highlight=False)

    ToyTrainer(cfg).run(out, pace_s=args.pace if args.live else 0.0, on_step=on_step)
    console.print(f"done: {out}", soft_wrap=True, markup=False)
    rows = cfg.mini_batch_rows  # one micro-batch per mini-batch
    console.print(f"next:  rldiag verify {out} --set rldiag.mini_batch_size={rows} "
                  f"--set rldiag.micro_batch_size={rows}", soft_wrap=True, markup=False)
    return exit_codes.OK
