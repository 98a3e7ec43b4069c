"""``rldiag calibrate CORPUS``: every doctor rule and gap cause measured on a labelled corpus
(:mod:`rldiag.analysis.calibrate`): runs, true and false positives, false negatives, precision and
recall (Wilson 95 % intervals), false alarms per 100 healthy steps and the median lead time, per
rule and cause, for one split (default ``test``). Writes ``CORPUS/calibration.json``.

Exit 0 when every warning or critical rule that is calibrated meets the floor (precision >= 0.9,
at most 1 false alarm per 100 healthy steps), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rldiag import api
from rldiag.cli import exit_codes
from rldiag.cli.common import add_progress_flags, console, progress_bar


def add_parser(sub) -> None:
    sp = sub.add_parser("calibrate", help="measure every doctor rule on a labelled corpus (python -m rldiag.toy.corpus)")
    sp.add_argument("corpus", help="the corpus directory (manifest.json and one run directory per case)")
    sp.add_argument("--split", choices=("test", "train"), default="test", help="the split printed (default test)")
    sp.add_argument("--json", action="store_true", help="print the split's figures as JSON")
    sp.add_argument("--device", default="cpu", help="auto, cpu or cuda for the recompute (default cpu)")
    add_progress_flags(sp)
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with progress_bar("calibrate", enabled=args.progress) as bar:
        cal = api.calibrate(args.corpus, device=args.device, progress=bar)
    split = cal["splits"][args.split]
    if args.json:
        sys.stdout.write(json.dumps(split, indent=2) + "\n")
    else:
        print_split(split)
        console.print(f"\nwritten: {Path(args.corpus) / 'calibration.json'}", markup=False)
    below = [r for r in split["rules"] if r["meets_floor"] is False]
    return exit_codes.FAILED if below else exit_codes.OK


def print_split(split: dict) -> None:
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(split["runs_by_kind"].items()))
    console.print(f"split {split['split']}: {split['runs']} runs ({kinds}), {split['healthy_steps']} healthy steps",
                  markup=False)
    if split["left_out"]:
        console.print(f"left out (pathology not produced): {', '.join(split['left_out'])}", markup=False)
    console.print(api.calibration_table(split), markup=False)
