"""``rldiag app [RUN ...]``: serve the app (Streamlit) on one or several run directories.

The app ships inside the package (:mod:`rldiag.app`), so this works from any directory once
rldiag is installed with its ``app`` extra. Without a run the app opens on its picker.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import subprocess
from pathlib import Path

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


def app_command(args: argparse.Namespace) -> list[str]:
    from rldiag.app import APP_SCRIPT, streamlit_command

    if not APP_SCRIPT.is_file():
        raise ConfigError(f"the app's script {APP_SCRIPT} is missing from this install of rldiag; reinstall it")
    runs = []
    for r in args.runs:
        p = Path(r).expanduser()
        if not p.is_dir():
            raise RunDirError(f"{r}: no such run directory")
        runs.append(p.resolve())
    return streamlit_command(runs, port=args.port, address=args.address, headless=args.headless)


def run(args: argparse.Namespace) -> int:
    cmd = app_command(args)
    if args.print_command:
        console.print(shlex.join(cmd), markup=False)
        return 0
    if importlib.util.find_spec("streamlit") is None or importlib.util.find_spec("plotly") is None:
        raise ConfigError("the app needs streamlit and plotly: pip install 'rldiag[app]'")
    try:
        return subprocess.call(cmd)
    except KeyboardInterrupt:
        return 0
