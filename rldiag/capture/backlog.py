"""The capture writer's queue, bounded in items and in bytes.

A step's batch (its unpadded arrays, a few MB to a few GB) waits here between the training
thread and the writer thread. Its bytes count from :meth:`Backlog.put` until the writer is done
with it (:meth:`Backlog.task_done`), so the memory the capture holds stays under ``max_bytes``
(one batch larger than that alone is let in when nothing else waits). Small items (metrics
lines, the end-of-step barrier, calls) pass with no bound: they never wait.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any


class Backlog:
    """FIFO of ``(item, size)``; ``put`` of a sized item waits (at most ``timeout``) for room."""

    def __init__(self, max_items: int, max_bytes: int):
        self.max_items = max(1, int(max_items))
        self.max_bytes = max(1, int(max_bytes))
        self._items: deque[tuple[Any, int]] = deque()
        self._sized = 0  # sized items waiting (not yet taken)
        self._bytes = 0  # bytes of sized items waiting or being written
        self._unfinished = 0
        self._cond = threading.Condition()

    def _room(self, size: int) -> bool:
        if self._sized >= self.max_items:
            return False
        return self._bytes == 0 or self._bytes + size <= self.max_bytes

    def put(self, item: Any, size: int = 0, timeout: float | None = None) -> bool:
        """Queue ``item``; a sized one (``size > 0``, bytes) waits for room at most ``timeout``
        seconds (None: as long as it takes). False when it timed out (nothing queued)."""
        with self._cond:
            if size > 0:
                deadline = None if timeout is None else time.monotonic() + timeout
                while not self._room(size):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
                self._sized += 1
                self._bytes += size
            self._items.append((item, size))
            self._unfinished += 1
            self._cond.notify_all()
            return True

    def get(self) -> tuple[Any, int]:
        with self._cond:
            while not self._items:
                self._cond.wait()
            item, size = self._items.popleft()
            if size > 0:
                self._sized -= 1
            self._cond.notify_all()
            return item, size

    def task_done(self, size: int = 0) -> None:
        with self._cond:
            self._bytes -= max(0, size)
            self._unfinished -= 1
            self._cond.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until every item put so far is done; False when ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._unfinished == 0, timeout)

    def waiting(self) -> int:
        """Sized items waiting (the queue's length as the writer's stats count it)."""
        with self._cond:
            return self._sized

    def bytes(self) -> int:
        with self._cond:
            return self._bytes
