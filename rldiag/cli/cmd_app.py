"""``rldiag app [RUN ...]``: serve the app (Streamlit) on one or several run directories.

The app ships inside the package (:mod:`rldiag.app`), so this works from any directory once
rldiag is installed with its ``app`` extra. Without a run the app opens on its picker.

It binds 127.0.0.1 unless ``--address`` names another address, and always asks for an access
token, printed in its URL as ``?token=T`` (``--token T``, ``$RLDIAG_APP_TOKEN``, else a fresh one;
``--no-token`` on loopback only). Any non-loopback address is the *shared mode*
(:mod:`rldiag.app.access`): a warning, only the named runs and those under ``--root`` open, and
nothing is written into a run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
from pathlib import Path

from rldiag.app import access
from rldiag.cli import exit_codes
from rldiag.cli.common import console, err_console
from rldiag.errors import ConfigError, RunDirError
from rldiag.io.run_layout import READ_ONLY_VAR


def add_parser(sub) -> None:
    sp = sub.add_parser(
        "app", help="open the app (metrics, what-if, step, off-policy, health) on one or several runs",
        description="Serve rldiag's app on a local port and print its address. Several runs: the first is the "
                    "one the pages show, the others are overlaid on its training metrics.",
    )
    sp.add_argument("runs", nargs="*", metavar="RUN", help="run directories (none: the app's picker)")
    sp.add_argument("--port", type=int, help="port to serve on (default: Streamlit's, 8501)")
    sp.add_argument("--address", default=DEFAULT_ADDRESS,
                    help=f"address to bind (default: {DEFAULT_ADDRESS}, this machine only); any other address "
                         "serves the app to others: token required, only the named runs and those under --root, "
                         "read-only")
    sp.add_argument("--token", help=f"the access token (default: ${access.TOKEN_VAR}, else a fresh one, printed "
                                    "in the URL)")
    sp.add_argument("--no-token", action="store_true", help="no access token (loopback addresses only)")
    sp.add_argument("--root", action="append", default=[], metavar="DIR",
                    help="in shared mode, runs under DIR may be opened too (repeatable)")
    sp.add_argument("--headless", action="store_true", help="do not open a browser")
    sp.add_argument("--print-command", action="store_true", help="print the streamlit command instead of running it")
    sp.set_defaults(func=run)


DEFAULT_ADDRESS = "127.0.0.1"


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


def _roots(args: argparse.Namespace) -> list[str]:
    roots = []
    for r in args.root:
        p = Path(r).expanduser()
        if not p.is_dir():
            raise RunDirError(f"--root {r}: no such directory")
        roots.append(str(p.resolve()))
    return roots


def _token(args: argparse.Namespace) -> str | None:
    """The session's token; None with ``--no-token`` (refused off loopback)."""
    if args.no_token:
        if not access.is_loopback(args.address):
            raise ConfigError(f"--no-token: {args.address} is not a loopback address; an app served to others "
                              "needs a token")
        return None
    return args.token or os.environ.get(access.TOKEN_VAR) or access.new_token()


def _environment(args: argparse.Namespace, token: str | None) -> dict[str, str]:
    """What the app's script reads from the environment: the token, the roots (and, shared, the
    runs declared read-only)."""
    env = {access.ROOTS_VAR: os.pathsep.join(_roots(args))}
    if token:
        env[access.TOKEN_VAR] = token
    if not access.is_loopback(args.address):
        env[READ_ONLY_VAR] = access.read_only_env()
    return env


def app_command(args: argparse.Namespace) -> list[str]:
    """The ``streamlit run`` command equivalent to ``rldiag app`` (without its preloading), with
    the environment it needs (``env NAME=VALUE ...``) in front when there is any."""
    from rldiag.app import streamlit_command

    cmd = streamlit_command(_runs(args), port=args.port, address=args.address, headless=args.headless)
    # streamlit run on loopback needs no token unless one is given; shared, it must have one
    token = (_token(args) if args.no_token or not access.is_loopback(args.address)
             else args.token or os.environ.get(access.TOKEN_VAR))
    env = {k: v for k, v in _environment(args, token).items() if v}
    return ["env", *(f"{k}={v}" for k, v in env.items()), *cmd] if env else cmd


def _warn_shared(address: str, roots: list[str]) -> None:
    where = "every interface" if address in ("0.0.0.0", "::") else address
    err_console.print(f"warning: serving the app on {where}, not only on this machine: anyone who can reach the port "
                      "and has the token can read the runs it serves. It opens only the runs named here"
                      + (f" and those under {', '.join(roots)}" if roots else "")
                      + ", and writes nothing into them (their mirrors under $RLDIAG_HOME get what it computes). "
                        "An SSH tunnel to a loopback app is safer (docs/app.md, Serving the app to others).",
                      markup=False)


def run(args: argparse.Namespace) -> int:
    if args.print_command:
        console.print(shlex.join(app_command(args)), markup=False)
        return exit_codes.OK
    runs = _runs(args)
    token = _token(args)
    env = _environment(args, token)
    if importlib.util.find_spec("streamlit") is None or importlib.util.find_spec("plotly") is None:
        raise ConfigError("the app needs streamlit and plotly: pip install 'rldiag[app]'")
    from rldiag.app import serve

    if not access.is_loopback(args.address):
        _warn_shared(args.address, _roots(args))
    os.environ.update(env)  # the app's script runs in this process and reads them
    if token is None:
        os.environ.pop(access.TOKEN_VAR, None)
    if runs:
        console.print(f"reading {', '.join(str(r) for r in runs)}", markup=False)
    try:
        return serve(runs, port=args.port, address=args.address, headless=args.headless, token=token)
    except KeyboardInterrupt:
        return exit_codes.OK
