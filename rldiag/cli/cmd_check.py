"""``rldiag check RUN``: what a run holds, what is wrong with it, what each algorithm needs."""

from __future__ import annotations

import argparse

from rich.table import Table

from rldiag import api
from rldiag.cli import exit_codes
from rldiag.cli.common import add_progress_flags, console, err_console, progress_bar

#: skipped metrics.jsonl lines listed one by one
SHOW_SKIPPED = 5


def add_parser(sub) -> None:
    sp = sub.add_parser("check", help="what a run holds, what is wrong with it, what each algorithm needs")
    sp.add_argument("run", help="the run directory")
    add_progress_flags(sp)
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with progress_bar("check", enabled=args.progress) as bar:
        rep = api.check(args.run, progress=bar)
    ok_steps = [s for s in rep.steps if not s.problem]
    console.print(f"run {rep.run}")
    console.print(f"  config: {rep.config_file or 'none (verl defaults)'}")
    console.print(f"  metrics.jsonl: {rep.metrics_lines} lines, {rep.metrics_names} metric names")
    if rep.metrics_skipped:
        shown = rep.metrics_skipped[:SHOW_SKIPPED]
        more = len(rep.metrics_skipped) - len(shown)
        err_console.print(f"  metrics.jsonl: {len(rep.metrics_skipped)} line(s) skipped by every command"
                          + (f" (the first {len(shown)} below)" if more else ""), markup=False)
        for number, why in shown:
            err_console.print(f"    {rep.run}/metrics.jsonl line {number}: {why}", markup=False)
    steps = [s.step for s in rep.steps]
    console.print(f"  steps: {len(steps)} ({min(steps)}..{max(steps)}), readable: {len(ok_steps)}")
    if ok_steps:
        rows = sum(s.rows for s in ok_steps)
        toks = sum(s.tokens for s in ok_steps)
        act = sum(s.actor_tokens for s in ok_steps)
        console.print(f"  rows: {rows} ({rows / len(ok_steps):.1f} per step), tokens: {toks}, "
                      f"actor tokens (response_mask 1): {act} ({act / max(toks, 1):.1%})")
    console.print(f"  columns: {', '.join(rep.columns)}")
    console.print(_needs_table("advantage estimators", "estimator", "ready", rep.algorithms))
    console.print(_needs_table("metric families", "metrics", "available", rep.metric_families))
    if rep.problems:
        err_console.print(f"[red]{len(rep.problems)} problem(s):[/red]")
        for p in rep.problems:
            err_console.print(f"  {p}", markup=False)
        return exit_codes.FAILED
    console.print("no problems found")
    return exit_codes.OK


def _needs_table(title: str, what: str, ok: str, needs: dict[str, list[str]]) -> Table:
    """One row per name: ``ok`` or ``needs `a`, `b`, missing``."""
    t = Table(title=title)
    t.add_column(what)
    t.add_column("status")
    for name, missing in needs.items():
        t.add_row(name, ok if not missing else f"needs {', '.join(f'`{m}`' for m in missing)}, missing")
    return t
