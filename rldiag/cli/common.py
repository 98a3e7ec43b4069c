"""Shared pieces of the command line: consoles, the progress bar, overrides, number format."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def _console(stderr: bool) -> Console:
    # Lines are never wrapped (messages name files and must stay greppable); off a terminal,
    # tables get room instead of rich's default 80 columns.
    c = Console(stderr=stderr, highlight=False, soft_wrap=True)
    if not c.is_terminal:
        c = Console(stderr=stderr, highlight=False, soft_wrap=True, width=160)
    return c


console = _console(False)
err_console = _console(True)

#: Clean-ups a command hands over to run after its outcome is printed (see :func:`defer`).
_deferred: list[Callable[[], None]] = []


def defer(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the command's outcome (its result or its error) has been printed: a slow
    clean-up (the W&B SDK's shutdown) never holds back what the user is told."""
    _deferred.append(fn)


def run_deferred() -> None:
    """Run and forget the deferred clean-ups, last registered first; their errors are ignored."""
    while _deferred:
        fn = _deferred.pop()
        try:
            fn()
        except Exception:  # noqa: BLE001 - a clean-up never changes the command's outcome
            pass


class progress_bar:  # noqa: N801 - called like a function, as rldiag.api's progress callbacks are
    """A rich progress bar on stderr, shown on a terminal (or when forced with --progress).

    Call it as ``bar(done, total, what)``: the ``progress`` callback of :mod:`rldiag.api`.
    """

    def __init__(self, label: str, enabled: bool | None = None):
        self.label = label
        self.enabled = err_console.is_terminal if enabled is None else enabled
        self._progress = None
        self._task = None

    def __enter__(self):
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[what]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                console=err_console, transient=False,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task(self.label, total=None, what="step -")
        return self

    def __call__(self, done: int, total: int, what: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=done, total=total, what=what)

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.__exit__(*exc)


def add_progress_flags(sp: argparse.ArgumentParser) -> None:
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None, help="always show the progress bar")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="never show it")


def add_settings_flags(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--estimator", help="short for --set algorithm.adv_estimator=NAME")
    sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a setting (verl's dotted key)")


def overrides_from_args(args: argparse.Namespace) -> dict:
    from rldiag.config.settings import parse_override

    out: dict = {}
    for item in getattr(args, "set", None) or []:
        key, value = parse_override(item)
        out[key] = value
    if getattr(args, "estimator", None):
        out["algorithm.adv_estimator"] = args.estimator
    return out


def report_internal_error(what: str, traceback: str) -> None:
    """``rldiag: internal error`` on stderr: what failed, the request to report it, the traceback."""
    err_console.print(f"rldiag: internal error {what}: this is a bug in rldiag, please report it with the traceback "
                      "below", markup=False, highlight=False)
    err_console.print(traceback.rstrip("\n"), markup=False, highlight=False)


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:.4g}"
    return str(v)
