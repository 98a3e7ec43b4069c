"""What the capture does when something goes wrong while a trainer trains: it never stops or
slows the training. Each fault is warned once (its cause, the path, what is skipped), counted
in the trainer's metrics (:data:`DROPPED_KEY`, :data:`ERRORS_KEY`, logged from the first fault
on), and capture goes on with the next write (a disk with room again, a directory made again).

:class:`FaultLog` keeps the counts and the causes already warned; :class:`SigtermChain` lets the
capture finish (or drop whole) its pending writes on ``SIGTERM`` (a preemption) before the
trainer's own handler runs (Ray and verl install theirs), on the main thread only.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import warnings
from collections.abc import Callable
from typing import Any

#: steps whose batch file was not written (a failed write, a full queue, a malformed batch)
DROPPED_KEY = "rldiag/capture/dropped_steps"
#: failures of the capture (each failed write, append, fsync or call)
ERRORS_KEY = "rldiag/capture/errors"
ON_ERROR = ("raise", "warn")


class CaptureWarning(RuntimeWarning):
    """A fault of the capture; training goes on."""


def cause(exc: BaseException) -> str:
    """``exc`` as one short cause: its errno's name when it has one (``ENOSPC: No space left on
    device``), else its type and message."""
    code = getattr(exc, "errno", None)
    if isinstance(exc, OSError) and isinstance(code, int) and code in errno.errorcode:
        return f"{errno.errorcode[code]}: {exc.strerror or exc}"
    return f"{type(exc).__name__}: {exc}"


def fault_key(what: str, exc: BaseException) -> tuple[str, str, Any]:
    """What makes two faults the same (warned once): the kind of write, the exception's type, its errno."""
    return what, type(exc).__name__, getattr(exc, "errno", None)


class FaultLog:
    """The capture's faults: counts (thread-safe) and each cause warned once."""

    def __init__(self) -> None:
        self.dropped_steps = 0
        self.errors = 0
        self._warned: set[tuple[str, str, Any]] = set()
        self._lock = threading.Lock()

    def count(self, *, dropped: int = 0, errors: int = 0) -> None:
        with self._lock:
            self.dropped_steps += dropped
            self.errors += errors

    def warn(self, what: str, exc: BaseException | None, message: str) -> bool:
        """Warn ``message`` once per kind of fault (``what`` and ``exc``'s type and errno); True
        when this call warned."""
        key = fault_key(what, exc) if exc is not None else (what, "", None)
        with self._lock:
            if key in self._warned:
                return False
            self._warned.add(key)
        warnings.warn(f"rldiag.capture: {message} (training goes on; counted in {ERRORS_KEY} and {DROPPED_KEY}; "
                      "reported once)", CaptureWarning, stacklevel=3)
        return True

    def metrics(self) -> dict[str, int]:
        """The keys to add to the trainer's metrics: none before the first fault."""
        with self._lock:
            if not (self.dropped_steps or self.errors):
                return {}
            return {DROPPED_KEY: self.dropped_steps, ERRORS_KEY: self.errors}


Handler = Callable[[int, Any], Any] | int | None


class SigtermChain:
    """On ``SIGTERM``: ``drain()`` (the pending writes finish within its own bound, or are
    dropped whole), then the handler that was there before: called when it is a function, the
    default action (the process ends) when it was the default, nothing when ignored.
    Installed on the main thread only (signals are handled there); :meth:`remove` puts the
    previous handler back when this one is still in place."""

    def __init__(self, drain: Callable[[], None]):
        self.drain = drain
        self.previous: Handler = None
        self.installed = False
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            self.previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._handle)
            self.installed = True
        except (ValueError, OSError):  # not the main interpreter, or no such signal here
            pass

    def _handle(self, signum: int, frame: Any) -> None:
        try:
            self.drain()
        finally:
            previous = self.previous
            self.remove()
            if callable(previous):
                previous(signum, frame)
            elif previous in (signal.SIG_DFL, None):
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

    def remove(self) -> None:
        if not self.installed:
            return
        self.installed = False
        try:
            if signal.getsignal(signal.SIGTERM) == self._handle:
                signal.signal(signal.SIGTERM, self.previous if self.previous is not None else signal.SIG_DFL)
        except (ValueError, OSError):  # off the main thread at close: left to the process's end
            pass
