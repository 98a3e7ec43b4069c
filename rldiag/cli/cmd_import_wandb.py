"""``rldiag import-wandb SOURCE --out RUN``: a W&B run (online or offline) -> a run directory."""

from __future__ import annotations

import argparse

from rldiag import api
from rldiag.cli import exit_codes
from rldiag.cli.common import add_progress_flags, console, defer, err_console, progress_bar


def add_parser(sub) -> None:
    sp = sub.add_parser(
        "import-wandb",
        help="import a Weights & Biases run (online or offline) into a run directory",
        description=(
            "Import a W&B run into a run directory: config -> run.yaml, every history row -> metrics.jsonl, "
            "batch artifacts (step_<N>.parquet) -> batches/. SOURCE is an offline run folder "
            "(wandb/offline-run-*), its run-*.wandb file, or entity/project/run_id on a W&B server "
            "(API key from WANDB_API_KEY only). Re-running updates RUN in place."
        ),
    )
    sp.add_argument("source", nargs="?", help="wandb/offline-run-* folder, run-*.wandb file, or entity/project/run_id")
    sp.add_argument("--out", required=True, metavar="RUN", help="the run directory to create or update")
    sp.add_argument("--artifact", action="append", default=[], metavar="ENTITY/PROJECT/NAME:VERSION",
                    help="import batches from this artifact (repeatable) instead of the run's own artifacts")
    sp.add_argument("--artifact-type", default="rl-batches",
                    help="type of the run's artifacts that hold batches (default rl-batches)")
    sp.add_argument("--artifact-dir", action="append", default=[], metavar="DIR",
                    help="offline: a folder the staged artifact files were copied to (repeatable); files are "
                         "matched by name and digest")
    sp.add_argument("--no-batches", dest="batches", action="store_false", help="import config and history only")
    sp.add_argument("--nested-sep", default=".", metavar="SEP",
                    help="join keys of metrics logged as nested dicts with SEP (default '.', as the W&B UI shows them)")
    sp.add_argument("--page-size", type=int, default=1000, help="online: history rows per request (default 1000)")
    sp.add_argument("--timeout", type=float, default=30.0, help="online: seconds per API request (default 30)")
    sp.add_argument("--base-url", help="online: W&B server URL (default: WANDB_BASE_URL or W&B's cloud)")
    add_progress_flags(sp)
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    label = "reading kB" if args.source and Path(args.source).expanduser().exists() else "importing"
    with progress_bar(label, enabled=args.progress) as bar:
        rep = api.import_wandb(
            args.source, args.out, artifacts=args.artifact, artifact_type=args.artifact_type,
            artifact_dirs=args.artifact_dir, batches=args.batches, nested_sep=args.nested_sep,
            page_size=args.page_size, timeout=args.timeout, base_url=args.base_url, progress=bar, defer=defer,
        )
    who = rep.run_id or "-"
    if rep.project:
        who = f"{rep.entity + '/' if rep.entity else ''}{rep.project}/{who}"
    console.print(f"imported {rep.kind} W&B run {who} into {rep.out} in {rep.seconds:.2f}s", markup=False)
    if rep.kind != "artifact":
        steps = f"steps {rep.first_step}..{rep.last_step}" if rep.history_rows else "no steps"
        console.print(f"  metrics.jsonl  {rep.history_rows} rows, {steps}, {rep.metric_keys} keys", markup=False)
        console.print(f"  run.yaml       {rep.config_keys} top-level keys"
                      + (f" ({rep.config_updates} later update(s) applied)" if rep.config_updates else ""), markup=False)
    if rep.batch_steps:
        s = rep.batch_steps
        console.print(f"  batches/       {len(s)} step files, steps {s[0]}..{s[-1]}, from "
                      f"{len(rep.artifacts)} artifact(s)", markup=False)
    if rep.kind == "offline":
        console.print(f"  exit code      {rep.exit_code if rep.exit_code is not None else 'unknown (no exit record)'}",
                      markup=False)
    elif rep.state:
        console.print(f"  state          {rep.state}", markup=False)
    for note in rep.notes:
        console.print(f"  note: {note}", markup=False)
    for w in rep.warnings:
        err_console.print(f"[yellow]warning:[/yellow] {_escape(w)}")
    return exit_codes.OK


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
