"""Query results cached on the size and modification time of the files they read.

A result is kept with the signatures of its files; it is served again only while every file
still has the same size, modification time and inode (an atomic replace gives a new inode).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class FileSig:
    """What identifies one version of a file: size, modification time (ns) and inode."""

    path: str
    size: int
    mtime_ns: int
    ino: int

    @property
    def mtime(self) -> float:
        return self.mtime_ns / 1e9


def file_sig(path: str | Path) -> FileSig | None:
    """The file's signature, or None when it does not exist."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return FileSig(str(path), st.st_size, st.st_mtime_ns, st.st_ino)


class SigCache:
    """A bounded LRU of ``key -> (signatures, value)``."""

    def __init__(self, maxsize: int = 256):
        self.maxsize = maxsize
        self._items: OrderedDict[Hashable, tuple[Hashable, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable, sigs: Hashable, compute: Callable[[], T]) -> T:
        with self._lock:
            item = self._items.get(key)
            if item is not None and item[0] == sigs:
                self._items.move_to_end(key)
                self.hits += 1
                return item[1]
        value = compute()
        with self._lock:
            self.misses += 1
            self._items[key] = (sigs, value)
            self._items.move_to_end(key)
            while len(self._items) > self.maxsize:
                self._items.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
