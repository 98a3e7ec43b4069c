"""``rldiag sweep RUN``: many what-ifs from one read of the run (a grid of settings)."""

from __future__ import annotations

import argparse
import json
import sys

from rich.table import Table

from rldiag import api
from rldiag.cli import exit_codes
from rldiag.cli.common import add_progress_flags, console, err_console, fmt, progress_bar
from rldiag.config.settings import parse_override
from rldiag.errors import ConfigError

#: the modules the command imports anyway: imported up front, the collector off (rldiag.cli.main)
IMPORTS = ("rldiag.scenario.recompute", "rldiag.scenario.sweep")


def add_parser(sub) -> None:
    sp = sub.add_parser("sweep", help="many what-ifs from one read of the run: a grid of settings, one scenario each")
    sp.add_argument("run", help="the run directory, or an object-store URI (s3://bucket/run)")
    sp.add_argument("--grid", action="append", metavar="KEY=V1,V2,...",
                    help="a setting and the values to try (YAML scalars, like --set); repeat for the Cartesian product")
    sp.add_argument("--estimators", help="A,B,...: short for --grid algorithm.adv_estimator=A,B,...")
    sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="a setting every scenario overrides (verl's dotted key)")
    sp.add_argument("--name", help="the sweep's name (default: sweep- and 8 hex digits of the grid's SHA-256)")
    sp.add_argument("--steps", help="12, 10:20, 10:, :20 or 1,5,9 (default: all)")
    sp.add_argument("--metrics", help="A,B,...: the metrics to print, mean over the steps (default: actor/pg_loss, "
                                      "actor/pg_clipfrac, actor/ppo_kl, critic/advantages/mean and "
                                      "rollout_corr/rollout_is_eff_sample_size, those the sweep has)")
    sp.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    sp.add_argument("--save-tokens", action="store_true",
                    help="also write per-token results of every scenario (refused when they would not fit on the disk)")
    sp.add_argument("--executor", choices=("local", "ray"), default="local",
                    help="local (default: one read of each step file, shared stages) or ray (each scenario on its own)")
    sp.add_argument("--ray-address", default=None, help="with --executor ray: the cluster to join")
    sp.add_argument("--no-reuse", dest="reuse", action="store_false",
                    help="recompute every step of every scenario, even those unchanged since the last run")
    sp.add_argument("--json", action="store_true", help="print the result as JSON")
    add_progress_flags(sp)
    sp.set_defaults(func=run)


def parse_grid(items: list[str] | None) -> dict[str, list]:
    """``--grid KEY=V1,V2`` options -> ``{KEY: [V1, V2]}``, each value a YAML scalar."""
    out: dict[str, list] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--grid {item!r} is not of the form KEY=V1,V2,...")
        key, raw = item.split("=", 1)
        key = key.strip()
        if key in out:
            raise ConfigError(f"--grid {key} given twice")
        out[key] = [parse_override(f"{key}={part}")[1] for part in raw.split(",")]
    return out


def _overrides(items: list[str] | None) -> dict:
    return dict(parse_override(item) for item in items or [])


def run(args: argparse.Namespace) -> int:
    grid = parse_grid(args.grid)
    estimators = [e.strip() for e in args.estimators.split(",")] if args.estimators else None
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None
    executor = api.ray_executor(address=args.ray_address) if args.executor == "ray" else "local"
    try:
        with progress_bar("sweep", enabled=False if args.json else args.progress) as bar:
            result = api.sweep(args.run, grid, _overrides(args.set), estimators=estimators, name=args.name,
                               steps=args.steps, save_tokens=args.save_tokens, reuse=args.reuse, device=args.device,
                               executor=executor, progress=bar)
    finally:
        if not isinstance(executor, str):
            executor.close()
    if args.json:
        sys.stdout.write(json.dumps(result.to_dict(metrics), indent=2) + "\n")
    else:
        _print(result, metrics)
    return exit_codes.FAILED if not result.ok else exit_codes.OK


def _print(result: api.SweepResult, metrics: list[str] | None) -> None:
    frame = result.table_frame(metrics)
    reused = sum(len(v) for v in result.steps_reused.values())
    table = Table(title=f"sweep {result.name}  ({len(result.scenarios)} scenarios x {len(result.steps)} steps"
                        f"{f', {reused} reused' if reused else ''}, {result.seconds:.2f}s on {result.device}"
                        f"{' via ' + result.executor if result.executor != 'local' else ''}; mean over the steps)")
    lasts = [k.split(".")[-1] for k in result.grid]
    for col in frame.columns:
        if col == "scenario":
            table.add_column(col, overflow="fold")
        elif col in result.grid:  # a swept key: its last part where that names it alone
            last = col.split(".")[-1]
            table.add_column(last if lasts.count(last) == 1 else col, overflow="fold")
        else:
            table.add_column(col, justify="right", overflow="fold")
    for row in frame.iter_rows():
        cells = [v if isinstance(v, str) else fmt(v) for v in row]
        if result.own is not None and row[0] == result.own:
            cells[0] = f"* {cells[0]}"  # the run's own settings
        table.add_row(*cells)
    console.print(table)
    for note in result.notes:
        console.print(f"note: {note}")
    console.print(f"wrote {len(result.scenarios)} scenarios and {result.path}")
    failed = {name: f for name, f in result.steps_failed.items() if f}
    if failed:
        err_console.print(f"[red]{sum(len(f) for f in failed.values())} step(s) failed:[/red]")
        for name, steps in failed.items():
            for step, msg in sorted(steps.items()):
                err_console.print(f"  {name}: step {step}: {msg}", markup=False)
