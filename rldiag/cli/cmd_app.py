"""``rldiag app [RUN ...]``: serve the app (Streamlit) on one or several run directories.

The app ships inside the package (:mod:`rldiag.app`), so this works from any directory once
rldiag is installed with its ``app`` extra. Without a run the app opens on its picker.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
from pathlib import Path

from rldiag.cli import exit_codes
from rldiag.cli.common import console
from rldiag.errors import ConfigError, RunDirError


def add_parser(sub) -> None:
    sp = sub.add_parser(
        "app", help="open the app (metrics, what-if, step, off-policy, health) on one or several runs",
        description="Serve rldiag's app on a local port and print its address. Several runs: the first is the "
                    "one the pages show, the others are overlaid on its training metrics.",
    )
    sp.add_argument("runs", nargs="*", metavar="RUN", help="run directories (none: the app's picker)")
    sp.add_argument("--port", type=int, help="port to serve on (default: Streamlit's, 8501)")
    sp.add_argument("--address", help="address to bind (default: Streamlit's)")
    sp.add_argument("--headless", action="store_true", help="do not open a browser")
    sp.add_argument("--print-command", action="store_true", help="print the streamlit command instead of running it")
    sp.set_defaults(func=run)


def _runs(args: argparse.Namespace) -> list[Path]:
    from rldiag.app import APP_SCRIPT

    if not APP_SCRIPT.is_file():
        raise ConfigError(f"the app's script {APP_SCRIPT} is missing from this install of rldiag; reinstall it")
    runs = []
    for r in args.runs:
        p = Path(r).expanduser()
        if not p.is_dir():
            raise RunDirError(f"{r}: no such run directory")
        runs.append(p.resolve())
    return runs


def app_command(args: argparse.Namespace) -> list[str]:
    """The ``streamlit run`` command equivalent to ``rldiag app`` (without its preloading)."""
    from rldiag.app import streamlit_command

    return streamlit_command(_runs(args), port=args.port, address=args.address, headless=args.headless)


def run(args: argparse.Namespace) -> int:
    if args.print_command:
        console.print(shlex.join(app_command(args)), markup=False)
        return exit_codes.OK
    runs = _runs(args)
    if importlib.util.find_spec("streamlit") is None or importlib.util.find_spec("plotly") is None:
        raise ConfigError("the app needs streamlit and plotly: pip install 'rldiag[app]'")
    from rldiag.app import serve

    if runs:
        console.print(f"reading {', '.join(str(r) for r in runs)}", markup=False)
    try:
        return serve(runs, port=args.port, address=args.address, headless=args.headless)
    except KeyboardInterrupt:
        return exit_codes.OK
