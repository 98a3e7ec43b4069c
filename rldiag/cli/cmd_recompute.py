"""``rldiag recompute RUN``: recompute a run under its own or alternative settings."""

from __future__ import annotations

import argparse

from rich.markup import escape
from rich.table import Table

from rldiag import api
from rldiag.cli import exit_codes
from rldiag.cli.common import (
    add_progress_flags,
    add_settings_flags,
    console,
    err_console,
    fmt,
    overrides_from_args,
    progress_bar,
    report_internal_error,
)

#: the modules the command imports anyway: imported up front, the collector off (rldiag.cli.main)
IMPORTS = ("rldiag.scenario.recompute",)


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


def add_parser(sub) -> None:
    sp = sub.add_parser("recompute", help="recompute a run under its own or alternative settings")
    sp.add_argument("run", help="the run directory, or an object-store URI (s3://bucket/run)")
    add_settings_flags(sp)
    sp.add_argument("--name", help="scenario name (default: baseline, or a slug of the overrides)")
    sp.add_argument("--steps", help="12, 10:20, 10:, :20 or 1,5,9 (default: all)")
    sp.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    sp.add_argument("--save-tokens", action="store_true", help="also write per-token results")
    sp.add_argument("--executor", choices=("local", "ray"), default="local",
                    help="where steps run: this process (default) or a Ray cluster (pip install 'rldiag[ray]')")
    sp.add_argument("--ray-address", default=None,
                    help="with --executor ray: the cluster to join (default: RAY_ADDRESS, else a local Ray)")
    sp.add_argument("--gpus-per-task", type=float, default=1.0,
                    help="with --executor ray on GPUs: GPUs each task requests (default 1; 0.5 shares one GPU)")
    sp.add_argument("--no-reuse", dest="reuse", action="store_false",
                    help="recompute every step, even those unchanged since the last run of this scenario")
    sp.add_argument("--follow", action="store_true",
                    help="keep the scenario up to date while the run writes new batches (Ctrl-C to stop)")
    sp.add_argument("--poll", type=float, default=2.0, help="with --follow: seconds between looks (default 2)")
    sp.add_argument("--idle-timeout", type=float, default=None,
                    help="with --follow: stop after this many seconds without a new batch")
    add_progress_flags(sp)
    sp.set_defaults(func=run)


def _executor(args: argparse.Namespace):
    if args.executor == "ray":
        return api.ray_executor(address=args.ray_address, gpus_per_task=args.gpus_per_task)
    return "local"


def run(args: argparse.Namespace) -> int:
    executor = _executor(args)
    try:
        return _follow(args, executor) if args.follow else _once(args, executor)
    finally:
        if not isinstance(executor, str):
            executor.close()


def _once(args: argparse.Namespace, executor) -> int:
    with progress_bar("recompute", enabled=args.progress) as bar:
        result = api.recompute(
            args.run, overrides_from_args(args), name=args.name, steps=args.steps, device=args.device,
            save_tokens=args.save_tokens, progress=bar, reuse=args.reuse, executor=executor,
        )
    return _summary(result)


def _follow(args: argparse.Namespace, executor) -> int:
    def on_update(rep: api.RecomputeResult) -> None:
        new = len(rep.steps_done) - len(rep.steps_reused)
        console.print(f"{rep.name}: {len(rep.steps_done)} steps ({new} new), "
                      f"{len(rep.steps_failed)} waiting or failed, {rep.seconds:.2f}s")

    try:
        result = api.recompute(args.run, overrides_from_args(args), name=args.name, steps=args.steps,
                               device=args.device, save_tokens=args.save_tokens, executor=executor, follow=True,
                               poll_seconds=args.poll, idle_timeout=args.idle_timeout, on_update=on_update)
    except KeyboardInterrupt:
        console.print("stopped following")
        return exit_codes.OK
    return _summary(result)


def _summary(report: api.RecomputeResult) -> int:
    for warning in report.warnings:
        err_console.print(f"[yellow]warning:[/yellow] {escape(warning)}")
    reused = f", {len(report.steps_reused)} reused" if report.steps_reused else ""
    if report.reused_from is not None:
        reused += f" from scenario {report.reused_from} (the same resolved settings)"
    table = Table(title=f"scenario {report.name}  ({len(report.steps_done)} steps{reused}, {report.rows} rows, "
                        f"{report.tokens} tokens recomputed, {report.seconds:.2f}s on {report.device}"
                        f"{' via ' + report.executor if report.executor != 'local' else ''})")
    table.add_column("metric", no_wrap=True)
    for col in ("first", "last", "mean", "min", "max"):
        table.add_column(col, justify="right")
    steps = report.metrics_table  # in step order (Arrow: the polars frame would import polars)
    for name in SUMMARY_METRICS:
        column = steps.column(name).to_pylist() if name in steps.column_names else []
        vals = [v for v in column if v is not None and v == v]  # neither absent nor NaN
        if not vals:
            continue
        table.add_row(name, fmt(vals[0]), fmt(vals[-1]), fmt(sum(vals) / len(vals)), fmt(min(vals)), fmt(max(vals)))
    console.print(table)
    console.print(f"wrote {report.path}")
    if report.steps_failed:
        err_console.print(f"[red]{len(report.steps_failed)} step(s) failed:[/red] "
                          + ", ".join(str(s) for s in sorted(report.steps_failed)))
        for step, msg in sorted(report.steps_failed.items()):
            err_console.print(f"  step {step}: {msg}", markup=False)
        if report.internal_errors:
            by_trace: dict[str, list[int]] = {}
            for step, trace in sorted(report.internal_errors.items()):
                by_trace.setdefault(trace, []).append(step)
            for trace, steps in by_trace.items():
                report_internal_error(f"in step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}", trace)
            return exit_codes.INTERNAL
        return exit_codes.FAILED
    return exit_codes.OK
