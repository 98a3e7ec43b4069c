"""``rldiag layout-audit RUN``: which logged metrics are artefacts of the parallel layout, and by how much.

The run is recomputed under the layouts verl users change (its own, one batch per step, the
micro-batch halved and doubled, DP 1 / 2 / 4, ``use_dynamic_bsz`` on and off, the mini-batch
halved, ``trainer.balance_batch`` off for the legacy trainer) into
``RUN/rldiag/sweeps/layout-audit/``; the table lists the layout-dependent metrics (``-v``: every
metric) with their relative spread, the layout matching the log best and why. Exit 0 when the
audit is written, 1 on an error.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.table import Table

from rldiag import api
from rldiag.cli import exit_codes
from rldiag.cli.common import add_progress_flags, add_settings_flags, console, fmt, overrides_from_args, progress_bar


def add_parser(sub) -> None:
    sp = sub.add_parser("layout-audit", help="which metrics depend on the parallel layout (micro-/mini-batch, DP, "
                                             "dynamic batches), and by how much")
    sp.add_argument("run", help="the run directory")
    add_settings_flags(sp)
    sp.add_argument("--steps", help="12, 10:20, 10:, :20 or 1,5,9 (default: all)")
    sp.add_argument("--device", default="cpu", help="auto, cpu or cuda (default cpu)")
    sp.add_argument("--json", action="store_true", help="print the audit as JSON")
    sp.add_argument("-v", "--verbose", action="store_true", help="list every metric, not only layout-dependent ones")
    add_progress_flags(sp)
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with progress_bar("layout-audit", enabled=args.progress) as bar:
        result = api.layout_audit(args.run, overrides_from_args(args), steps=args.steps, device=args.device,
                                  progress=bar)
    if args.json:
        sys.stdout.write(json.dumps(result.to_dict(), indent=2) + "\n")
    else:
        print_result(result, args.verbose)
    return exit_codes.OK


def print_result(result: api.LayoutAuditResult, verbose: bool = False) -> None:
    ran = result.ran
    t = Table(title=f"layout audit {result.run}  ({len(result.steps)} steps, {len(ran)} layouts)")
    for col in ("metric", "dependent?", "relative spread", "best match (log)", "why"):
        t.add_column(col, justify="right" if col == "relative spread" else "left", no_wrap=col == "metric")
    shown = result.metrics if verbose else result.dependent
    if verbose:
        shown = sorted(shown, key=lambda m: (not m.layout_dependent, -(m.relative_spread or 0.0), m.metric))
    for m in shown:
        best = "-" if m.best_match is None else f"{m.best_match} ({fmt(m.best_match_error)})"
        t.add_row(m.metric, "yes" if m.layout_dependent else "no", fmt(m.relative_spread), best, m.why,
                  style="yellow" if m.layout_dependent else None)
    console.print(t)
    hidden = len(result.metrics) - len(shown)
    if hidden:
        console.print(f"{hidden} other metrics are the same under every layout (-v lists them)")
    for x in ran:
        folded = f" (also {', '.join(x.folded)}: the same layout)" if x.folded else ""
        failed = f"; {len(x.steps_failed)} steps failed" if x.steps_failed else ""
        console.print(f"layout {x.name}: {x.layout}{folded}{failed}", markup=False)
    for x in result.skipped:
        console.print(f"skipped {x.name}: {x.skipped}", markup=False)
    console.print(f"written to {result.path}", markup=False)
