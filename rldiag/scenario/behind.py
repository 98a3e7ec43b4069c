"""Work done one item behind, on a thread of its own: the scenario's writes (each step's per-row
and token tables, Parquet encoded and written) while the engine computes the next pack.

On 2 cores the engine's thread is a recompute's critical path (the loader's thread reads the
next step beside it and leaves part of the other core idle); a step's writes took 3-4 ms of it
(docs/performance.md, "Writes behind the engine"). :class:`Behind` takes them off it, in order,
with at most ``depth`` items handed over and not yet done, so memory holds at most that many
outcomes more than before.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")

__all__ = ["Behind", "Inline", "behind"]


class Behind(Generic[T]):
    """``fn(item)`` for each item :meth:`put`, in order, on one thread, at most ``depth`` items
    handed over and not yet done (:meth:`put` waits for the oldest otherwise).

    The first exception ``fn`` raises is raised again by the next :meth:`put` or by
    :meth:`close`; the items after it are not passed to ``fn``. :meth:`cancel` drops the items
    not yet started and waits for the one being done."""

    def __init__(self, fn: Callable[[T], None], depth: int = 1, name: str = "rldiag-write"):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, not {depth}")
        self._fn = fn
        self._items: deque[T] = deque()
        self._cond = threading.Condition()
        self._room = threading.Semaphore(depth)
        self._closed = False
        self._dropped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items:
                    return
                item = self._items.popleft()
                skip = self._dropped or self._error is not None
            try:
                if not skip:
                    self._fn(item)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, raised there
                with self._cond:
                    self._error = exc
            finally:
                del item
                self._room.release()

    def put(self, item: T) -> None:
        """Hand ``item`` over (waiting while ``depth`` items are not done); raises what ``fn``
        raised for an earlier item."""
        self._room.acquire()
        with self._cond:
            if self._error is not None:
                self._room.release()
                raise self._error
            self._items.append(item)
            self._cond.notify()

    def close(self) -> None:
        """Wait until every item handed over is done; raise what ``fn`` raised, if anything."""
        self._finish()
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """Drop the items not started, wait for the one being done; nothing is raised."""
        with self._cond:
            self._dropped = True
        self._finish()

    def _finish(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()


class Inline(Generic[T]):
    """:class:`Behind`'s interface doing ``fn(item)`` in :meth:`put`, on the caller's thread."""

    def __init__(self, fn: Callable[[T], None]):
        self.put = fn

    def close(self) -> None:
        """Nothing is pending."""

    def cancel(self) -> None:
        """Nothing is pending."""


@contextmanager
def behind(fn: Callable[[T], None], depth: int = 1, threaded: bool = True) -> Iterator[Behind[T] | Inline[T]]:
    """A :class:`Behind` for the block: closed at its end (every item done, ``fn``'s error
    raised), cancelled when the block raises (the block's exception propagates). ``threaded=False``:
    each item done as it is put (:class:`Inline`), where holding one more item costs too much memory."""
    b: Behind[T] | Inline[T] = Behind(fn, depth) if threaded else Inline(fn)
    try:
        yield b
    except BaseException:
        b.cancel()
        raise
    b.close()
