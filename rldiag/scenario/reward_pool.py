"""Reward function calls in worker processes: user code may raise, hang, crash or print.

:func:`score_calls` runs calls (each a mapping of keyword arguments) on ``workers`` spawned
processes, each of which loads the function once (:func:`rldiag.scenario.reward_fn.load_function`).
Calls go out in chunks, results come back one per call, in order.

- A call that raises gives its row an error (``Type: message``); the worker goes on.
- Each call runs under ``timeout`` seconds, enforced inside the worker by ``SIGALRM`` on its main
  thread (as verl's own reward timeout): the call is interrupted and reported as timed out.
- A worker that does not answer within ``timeout + 2`` s of its last answer (a call stuck in C
  code that ``SIGALRM`` cannot interrupt) or that dies (a crash, ``os._exit``) is killed and
  replaced; the call it was on is reported, the rest of its chunk goes to the replacement.
- Workers ignore ``SIGINT``: Ctrl-C reaches the parent alone, which kills every worker on the way
  out (:func:`score_calls` leaves no process behind, however it ends). A worker's standard output
  goes to ``/dev/null`` (the command's own output stays clean); its standard error is kept.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe, wait
from typing import Any

from rldiag.errors import RewardError
from rldiag.scenario.reward_fn import RewardFunction, call_function, load_function, read_result

#: how long a worker may stay silent past the call timeout before it is killed and replaced
GRACE_S = 2.0
#: calls per message to a worker, at most (a few, so that a killed worker loses little)
MAX_CHUNK = 64
#: a worker sends the results it has after this long, even mid-chunk
FLUSH_S = 0.05


@dataclass
class CallResult:
    """One call's result: ``score`` and ``components`` (verl's reading of the result), or ``error``."""

    score: float | None = None
    components: dict[str, float] = field(default_factory=dict)
    error: str | None = None


class CallTimeoutError(BaseException):
    """Raised inside a worker by ``SIGALRM`` when a call runs past the timeout (a BaseException,
    so that a function's own ``except Exception`` does not swallow it)."""


def _alarm(signum: int, frame: Any) -> None:
    raise CallTimeoutError()


def worker_main(conn: Connection) -> None:
    """A worker's loop: load the function, then answer each chunk of ``(index, kwargs)`` with
    ``(index, score, components, error)`` per call, sent in lists: at the chunk's end, or sooner
    once :data:`FLUSH_S` passed since the last send (so a worker is never silent for longer than
    one call, at most ``timeout``, plus that); ``None`` ends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fn, timeout, path = conn.recv()  # the function, the timeout, the parent's sys.path
    sys.path[:] = [p for p in path if p not in sys.path] + sys.path
    try:
        func = load_function(fn)
    except RewardError as exc:
        conn.send(("load_error", str(exc)))
        return
    conn.send(("ready", None))
    signal.signal(signal.SIGALRM, _alarm)
    kwargs_all = dict(fn.kwargs)
    while True:
        chunk = conn.recv()
        if chunk is None:
            return
        out: list[tuple] = []
        sent = time.monotonic()
        for index, kwargs in chunk:
            score: float | None = None
            comps: dict[str, float] = {}
            error: str | None = None
            try:
                signal.setitimer(signal.ITIMER_REAL, timeout)
                try:
                    result = call_function(func, {**kwargs_all, **kwargs})
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                score, comps = read_result(result)
            except CallTimeoutError:
                error = f"TimeoutError: the call took longer than {timeout:g} s"
            except BaseException as exc:  # noqa: BLE001 - user code: anything it raises fails its row
                error = f"{type(exc).__name__}: {exc}"
            out.append((index, score, comps, error))
            if time.monotonic() - sent > FLUSH_S:
                conn.send(out)
                out, sent = [], time.monotonic()
        if out:
            conn.send(out)


@dataclass
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    pending: deque = field(default_factory=deque)  # (index, kwargs) sent, not answered, in order
    last: float = 0.0  # when it last answered (or was given work)


class Pool:
    """``workers`` processes running :func:`worker_main` (a context manager: closing kills them)."""

    def __init__(self, fn: RewardFunction, workers: int, timeout: float):
        self.fn, self.timeout = fn, float(timeout)
        self.workers: list[_Worker] = []
        self.replaced = 0
        self.pids: list[int] = []  # every worker started
        try:
            for _ in range(max(1, workers)):
                self.workers.append(self._spawn())
            for w in self.workers:
                self._ready(w)
        except BaseException:
            self.close()
            raise

    def _spawn(self) -> _Worker:
        """A fresh interpreter (``python -m rldiag.scenario.reward_pool FD``: nothing of the caller's
        ``__main__`` imported again), its standard output discarded, talking over a socket pair."""
        parent, child = Pipe(duplex=True)
        fd = child.fileno()
        proc = subprocess.Popen([sys.executable, "-m", __name__, str(fd)], pass_fds=(fd,), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL)
        child.close()
        self.pids.append(proc.pid)
        parent.send((self.fn, self.timeout, list(sys.path)))
        return _Worker(proc, parent)

    def _ready(self, w: _Worker) -> None:
        try:
            kind, message = w.conn.recv()
        except EOFError:
            raise RewardError(f"--reward {self.fn.spec!r}: the worker process died while loading the function "
                              f"(exit code {w.proc.wait()})") from None
        if kind == "load_error":
            raise RewardError(message)

    def _replace(self, w: _Worker) -> _Worker:
        w.proc.kill()
        w.proc.wait()
        w.conn.close()
        new = self._spawn()
        self._ready(new)
        self.replaced += 1
        return new

    def close(self) -> None:
        """Stop every worker: asked to end, killed if still there; joined (none left behind)."""
        for w in self.workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self.workers:
            try:
                w.proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            w.conn.close()
        self.workers = []

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, calls: Sequence[dict[str, Any]], progress: Callable[[int, int], None] | None = None) -> list[CallResult]:
        """One :class:`CallResult` per call, in order."""
        n = len(calls)
        results: list[CallResult | None] = [None] * n
        todo: deque = deque((i, c) for i, c in enumerate(calls))
        chunk = max(1, min(MAX_CHUNK, n // (4 * len(self.workers)) or 1))
        done = 0
        limit = self.timeout + GRACE_S

        def give(w: _Worker) -> None:
            if todo and not w.pending:
                part = [todo.popleft() for _ in range(min(chunk, len(todo)))]
                w.pending.extend(part)
                w.conn.send(part)
                w.last = time.monotonic()

        def lost(i: int, why: str) -> None:
            nonlocal done
            w = self.workers[i]
            if w.pending:
                index, _ = w.pending.popleft()
                results[index] = CallResult(error=why)
                done += 1
            todo.extendleft(reversed(w.pending))  # the rest of its chunk, first in line
            w.pending.clear()
            self.workers[i] = self._replace(w)

        for w in self.workers:
            give(w)
        while done < n:
            busy = [w for w in self.workers if w.pending]
            now = time.monotonic()
            wait_s = max(0.0, min(w.last + limit for w in busy) - now) if busy else 0.0
            ready = set(wait([w.conn for w in busy], timeout=wait_s)) if busy else set()
            for i, w in enumerate(list(self.workers)):
                if w.conn in ready:
                    try:
                        while w.pending and w.conn.poll():
                            for index, score, comps, error in w.conn.recv():
                                w.pending.popleft()
                                results[index] = CallResult(score, comps, error)
                                done += 1
                            w.last = time.monotonic()
                    except (EOFError, OSError):
                        lost(i, f"WorkerDied: the worker process died during the call (exit code "
                                f"{w.proc.wait()})")
                elif w.pending and time.monotonic() - w.last > limit:
                    lost(i, f"TimeoutError: no answer within {self.timeout:g} s + {GRACE_S:g} s; the worker was "
                            "killed and replaced")
                give(self.workers[i])
            if progress is not None:
                progress(done, n)
        return [r if r is not None else CallResult(error="lost") for r in results]


@dataclass
class PoolStats:
    """What a pool did besides the calls: workers replaced, and every worker's process id."""

    replaced: int = 0
    pids: list[int] = field(default_factory=list)


def score_calls(fn: RewardFunction, calls: Sequence[dict[str, Any]], workers: int, timeout: float,
                progress: Callable[[int, int], None] | None = None) -> tuple[list[CallResult], PoolStats]:
    """``(results, stats)`` of ``calls`` (keyword arguments each) on a fresh pool, closed (every
    worker ended and reaped) however this returns."""
    if not calls:
        return [], PoolStats()
    pool = Pool(fn, min(workers, len(calls)), timeout)
    try:
        return pool.run(calls, progress), PoolStats(pool.replaced, list(pool.pids))
    finally:
        pool.close()


if __name__ == "__main__":  # a worker: python -m rldiag.scenario.reward_pool FD
    worker_main(Connection(int(sys.argv[1])))
