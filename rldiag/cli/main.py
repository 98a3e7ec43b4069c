"""``rldiag`` command line: one module per command, errors caught once here.

Each module ``rldiag.cli.cmd_<name>`` has ``add_parser(subparsers)``, which registers its parser
and sets ``func`` (and optionally ``on_error(args, exc)``, for what a command adds to an error's
report, e.g. ``verify --json``). Every :class:`~rldiag.errors.RldiagError` is printed here as
``Type: message`` and the command exits with the code :mod:`rldiag.cli.exit_codes` gives it (1, or
2 for ``verify`` and ``doctor``); any other exception is a bug, printed as ``rldiag: internal error``
with its traceback and a request to report it (exit 3). Clean-ups a command deferred (``common.defer``) run after that.

Run as the process's own command (``main()`` without ``argv``: the ``rldiag`` script), the cyclic
garbage collector is set for a short-lived process: off while the command's modules are imported
(a command module's ``IMPORTS``: torch and the engine make about 190,000 objects, none of them
garbage, over which Python's collector otherwise makes three full passes, about 140 ms), then
those objects frozen out of its passes (``gc.freeze``) and the collector on for the command's
work; once the command has ended, what it made is frozen too, so that the interpreter's last
full pass at exit (about 100 ms) has nothing left to scan. Called with ``argv`` (tests, other
programs) it leaves the collector alone.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
from collections.abc import Sequence

from rldiag.cli import exit_codes
from rldiag.cli.common import err_console, report_internal_error, run_deferred
from rldiag.errors import InternalError, RldiagError
from rldiag.version import __version__

#: Command modules, in the order ``rldiag --help`` lists them.
COMMAND_MODULES = [
    "rldiag.cli.cmd_check",
    "rldiag.cli.cmd_recompute",
    "rldiag.cli.cmd_rescore",
    "rldiag.cli.cmd_probe_reward",
    "rldiag.cli.cmd_sweep",
    "rldiag.cli.cmd_verify",
    "rldiag.cli.cmd_compare",
    "rldiag.cli.cmd_doctor",
    "rldiag.cli.cmd_calibrate",
    "rldiag.cli.cmd_layout_audit",
    "rldiag.cli.cmd_rows",
    "rldiag.cli.cmd_import_wandb",
    "rldiag.cli.cmd_demo",
    "rldiag.cli.cmd_app",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rldiag",
        description="Recompute and diagnose RL post-training runs (PPO, GRPO, RLOO, ...) with verl's numbers.",
    )
    p.add_argument("--version", action="version", version=f"rldiag {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for mod in COMMAND_MODULES:
        importlib.import_module(mod).add_parser(sub)
    return p


def _command_imports(args: argparse.Namespace) -> None:
    """Import the modules the chosen command's module declares it will import (``IMPORTS``)."""
    module = sys.modules.get(getattr(args.func, "__module__", ""))
    for name in getattr(module, "IMPORTS", ()):
        importlib.import_module(name)


def main(argv: Sequence[str] | None = None) -> int:
    own_process = argv is None
    if own_process:
        gc.disable()  # until the command's modules are imported
    try:
        return _run(build_parser(), argv, own_process)
    finally:
        if own_process:
            gc.freeze()  # the interpreter's last pass at exit: nothing to scan
            gc.enable()


def _run(parser: argparse.ArgumentParser, argv: Sequence[str] | None, own_process: bool) -> int:
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return exit_codes.CANNOT_CHECK
    try:
        if own_process:
            _command_imports(args)
            gc.freeze()
            gc.enable()
        return int(args.func(args) or exit_codes.OK)
    except InternalError as exc:
        report_internal_error(str(exc), exc.traceback)
        return exit_codes.INTERNAL
    except RldiagError as exc:
        err_console.print(f"{type(exc).__name__}: {exc}", markup=False, highlight=False)
        code = exit_codes.error_exit(args.command)
        if (on_error := getattr(args, "on_error", None)) is not None:
            on_error(args, exc, code)
        return code
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return exit_codes.INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - what no code meant to raise is a bug: reported as one, with its traceback
        internal = exc if isinstance(exc, InternalError) else InternalError.of(exc, f"in rldiag {args.command}")
        report_internal_error(str(internal), internal.traceback)
        return exit_codes.INTERNAL
    finally:
        run_deferred()


if __name__ == "__main__":
    sys.exit(main())
