"""A page's one-off heavy work (a step's per-token values): in a child process, one at a time,
with the background baselines paused meanwhile.

:func:`in_child` runs ``fn`` in a child of the fork server (:mod:`rldiag.app.worker` starts it
with the server, its modules imported once): the memory of a one-step recompute (a step of 16 M
tokens takes about 2 GB) is the child's and goes back to the system when it ends, instead of
staying in the server's heap beside every session.

Two such children at once (a page's, the baseline's) would each hold their step's peak: on the
3.6 GB rollouts run the server's process tree reached 1.65-1.69 GB that way, against 1.5
(docs/app.md). So the page's work runs inside :func:`quiet_baselines`: one page's work at a time
in this server, and every background baseline of the process held for it (no recompute starts,
the one under way pauses after its current step, its freed memory given back to the system first;
:meth:`~rldiag.app.worker.BaselineWorker.hold`). The page waits at most for the step the
baseline is computing; the baseline resumes when the page's work ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from rldiag.app import memory, worker
from rldiag.errors import ComputeError, RldiagError

#: one page's heavy work at a time in this process
_one_page = threading.Lock()


@contextlib.contextmanager
def quiet_baselines() -> Iterator[None]:
    """Around a page's heavy work: the only one in this process, with every background baseline
    held (no recompute computing: none under way, or the one under way paused between two
    steps); they resume on the way out."""
    with _one_page:
        held = worker.workers()
        for w in held:
            w.hold()
        try:
            for w in held:
                w.wait_quiet()
            yield
        finally:
            for w in held:
                w.resume()


def in_child(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a child process of the fork server (``fn`` importable by name,
    its arguments and result picklable), inside :func:`quiet_baselines`. Inline in the ``sync``
    and ``off`` modes (tests, and servers that compute nothing in the background). An
    :class:`~rldiag.errors.RldiagError` raised in the child is raised here again (its type and
    message); a child that dies (killed, out of memory) raises :class:`ComputeError`."""
    if worker.MODE != "thread":
        return fn(*args, **kwargs)
    with quiet_baselines():
        answer, exitcode = _run_child(fn, args, kwargs)
    if answer is None:
        raise ComputeError(f"the process computing {getattr(fn, '__name__', fn)} ended before it answered "
                           f"(exit code {exitcode}: killed, or out of memory?)")
    ok, value = answer
    if ok:
        return value
    kind, message = value
    err = next((c for c in _error_types() if c.__name__ == kind), RldiagError)
    raise err(message)


def _run_child(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[tuple[bool, Any] | None, int | None]:
    """The child's answer (None: it ended without one) and its exit code."""
    ctx = worker.mp_context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_call_in_child, args=(child, fn, args, kwargs, dict(os.environ)), name="rldiag-page-work",
                       daemon=True)
    proc.start()
    child.close()
    answer: tuple[bool, Any] | None = None
    try:
        answer = parent.recv()
    except (EOFError, OSError):
        pass
    finally:
        parent.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    return answer, proc.exitcode


def _error_types() -> list[type[RldiagError]]:
    out, todo = [], [RldiagError]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def _call_in_child(conn: Any, fn: Callable[..., Any], args: tuple, kwargs: dict, env: dict[str, str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's
    worker.adopt_environment(env)  # the fork server's is that of when it started
    memory.name_process("rldiag-page")
    try:
        try:
            conn.send((True, fn(*args, **kwargs)))
        except RldiagError as exc:
            conn.send((False, (type(exc).__name__, str(exc))))
    finally:
        conn.close()


def row_token_values(run: str, scenario: str, step: int, row: int, column: str) -> list | None:
    """One row's per-token ``column`` under ``scenario`` (None: the scenario has none), from
    :func:`rldiag.api.step_token_frame` (its saved tokens, else the step recomputed aside into the
    run's token cache): run in :func:`in_child` by the Rollouts page, only the row's values come
    back (the step's frame, a million tokens of a long-tailed step, stays in the child)."""
    import polars as pl

    from rldiag import api

    frame = api.step_token_frame(run, step, scenario, columns=[column])
    got = frame.filter(pl.col("row") == row)
    return got[column][0].to_list() if column in frame.columns and len(got) else None
