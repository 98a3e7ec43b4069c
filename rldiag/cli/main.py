"""``rldiag`` command line: one parser per command, errors caught once here.

Every :class:`~rldiag.errors.RldiagError` is printed as ``Type: message`` and exits 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from rldiag import __version__
from rldiag.errors import RldiagError

console = Console(stderr=False, highlight=False)
err_console = Console(stderr=True, highlight=False)

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str):
    def deco(fn):
        COMMANDS[name] = fn
        return fn

    return deco


class progress_bar:
    """A rich progress bar on stderr, shown only on a terminal or when forced."""

    def __init__(self, label: str, enabled: bool | None = None):
        self.label = label
        self.enabled = err_console.is_terminal if enabled is None else enabled
        self._progress = None
        self._task = None

    def __enter__(self):
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("step {task.fields[step]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                console=err_console, transient=False,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task(self.label, total=None, step="-")
        return self

    def __call__(self, done: int, total: int, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=done, total=total, step=step)

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.__exit__(*exc)


def _overrides(args: argparse.Namespace) -> dict:
    from rldiag.config.settings import parse_override

    out: dict = {}
    for item in args.set or []:
        key, value = parse_override(item)
        out[key] = value
    if getattr(args, "estimator", None):
        out["algorithm.adv_estimator"] = args.estimator
    return out


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:.4g}"
    return str(v)


SUMMARY_METRICS = (
    "critic/score/mean",
    "critic/advantages/mean",
    "critic/advantages/max",
    "critic/returns/mean",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/pg_clipfrac_lower",
    "actor/entropy_loss",
    "actor/kl_loss",
    "critic/vf_loss",
    "critic/vf_explained_var",
    "rldiag/groups/no_signal_fraction",
    "response_length/mean",
)


@command("recompute")
def cmd_recompute(args: argparse.Namespace) -> int:
    from rldiag.recompute import recompute

    with progress_bar("recompute", enabled=args.progress) as bar:
        report = recompute(
            args.run, _overrides(args), name=args.name, steps=args.steps, device=args.device,
            save_tokens=args.save_tokens, progress=bar,
        )
    table = Table(title=f"scenario {report.name}  ({len(report.steps_done)} steps, {report.rows} rows, "
                        f"{report.tokens} tokens, {report.seconds:.2f}s on {report.device})")
    table.add_column("metric")
    for col in ("first", "last", "mean", "min", "max"):
        table.add_column(col, justify="right")
    rows = sorted(report.metrics, key=lambda r: r["step"])
    for name in SUMMARY_METRICS:
        vals = [r[name] for r in rows if name in r and r[name] == r[name]]
        if not vals:
            continue
        table.add_row(name, _fmt(vals[0]), _fmt(vals[-1]), _fmt(sum(vals) / len(vals)), _fmt(min(vals)), _fmt(max(vals)))
    console.print(table)
    console.print(f"wrote {report.path}")
    if report.steps_failed:
        err_console.print(f"[red]{len(report.steps_failed)} step(s) failed:[/red] "
                          + ", ".join(str(s) for s in sorted(report.steps_failed)))
        for step, msg in sorted(report.steps_failed.items()):
            err_console.print(f"  step {step}: {msg}", markup=False)
        return 1
    return 0


@command("check")
def cmd_check(args: argparse.Namespace) -> int:
    from rldiag.check import check_run

    with progress_bar("check", enabled=args.progress) as bar:
        rep = check_run(args.run, progress=bar)
    ok_steps = [s for s in rep.steps if not s.problem]
    console.print(f"run {rep.run}")
    console.print(f"  config: {rep.config_file or 'none (verl defaults)'}")
    console.print(f"  metrics.jsonl: {rep.metrics_lines} lines, {rep.metrics_names} metric names")
    steps = [s.step for s in rep.steps]
    console.print(f"  steps: {len(steps)} ({min(steps)}..{max(steps)}), readable: {len(ok_steps)}")
    if ok_steps:
        rows = sum(s.rows for s in ok_steps)
        toks = sum(s.tokens for s in ok_steps)
        act = sum(s.actor_tokens for s in ok_steps)
        console.print(f"  rows: {rows} ({rows / len(ok_steps):.1f} per step), tokens: {toks}, "
                      f"actor tokens (response_mask 1): {act} ({act / max(toks, 1):.1%})")
    console.print(f"  columns: {', '.join(rep.columns)}")
    t = Table(title="advantage estimators")
    t.add_column("estimator")
    t.add_column("status")
    for name, missing in rep.algorithms.items():
        t.add_row(name, "ready" if not missing else f"needs {', '.join(f'`{m}`' for m in missing)}, missing")
    console.print(t)
    t = Table(title="metric families")
    t.add_column("metrics")
    t.add_column("status")
    for name, missing in rep.metric_families.items():
        t.add_row(name, "available" if not missing else f"needs {', '.join(f'`{m}`' for m in missing)}, missing")
    console.print(t)
    if rep.problems:
        err_console.print(f"[red]{len(rep.problems)} problem(s):[/red]")
        for p in rep.problems:
            err_console.print(f"  {p}", markup=False)
        return 1
    console.print("no problems found")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rldiag",
        description="Recompute and diagnose RL post-training runs (PPO, GRPO, RLOO, ...) with verl's numbers.",
    )
    p.add_argument("--version", action="version", version=f"rldiag {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def add_progress(sp):
        g = sp.add_mutually_exclusive_group()
        g.add_argument("--progress", dest="progress", action="store_true", default=None,
                       help="always show the progress bar")
        g.add_argument("--no-progress", dest="progress", action="store_false", help="never show it")

    sp = sub.add_parser("recompute", help="recompute a run under its own or alternative settings")
    sp.add_argument("run", help="the run directory")
    sp.add_argument("--estimator", help="short for --set algorithm.adv_estimator=NAME")
    sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a setting (verl's dotted key)")
    sp.add_argument("--name", help="scenario name (default: baseline, or a slug of the overrides)")
    sp.add_argument("--steps", help="12, 10:20, 10:, :20 or 1,5,9 (default: all)")
    sp.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    sp.add_argument("--save-tokens", action="store_true", help="also write per-token results")
    add_progress(sp)

    sp = sub.add_parser("check", help="what a run holds, what is wrong with it, what each algorithm needs")
    sp.add_argument("run", help="the run directory")
    add_progress(sp)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        return COMMANDS[args.command](args)
    except RldiagError as exc:
        err_console.print(f"{type(exc).__name__}: {exc}", markup=False, highlight=False)
        return 1
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
