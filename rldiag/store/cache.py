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

from rldiag.io.fs import RemotePath
from rldiag.store.errors import StoreError

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


def local_path(path: Path | RemotePath) -> Path:
    """``path``, which must be on local disk: the store's queries read files by name (DuckDB) and
    key their results on the files' inodes. A run in an object store is a :class:`StoreError`."""
    if isinstance(path, RemotePath):
        raise StoreError(f"{path} is in an object store: the app reads runs on local disk (copy the run there "
                         "first); rldiag recompute, verify, compare, doctor and check take the URI")
    return path


def file_sig(path: str | Path) -> FileSig | None:
    """The file's signature, or None when it does not exist."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return FileSig(str(path), st.st_size, st.st_mtime_ns, st.st_ino)


def nbytes(value: Any) -> int:
    """About how many bytes a cached value holds: a polars frame's or Arrow table's buffers, a
    numpy array's, the sum over a tuple or list of them; 0 for anything else (small values)."""
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    size = getattr(value, "estimated_size", None)  # polars
    if callable(size):
        return int(size())
    size = getattr(value, "nbytes", None)  # numpy, Arrow
    return int(size) if isinstance(size, int) else 0


#: the bytes one store's cache keeps at most (its least recently used results are dropped first)
MAX_BYTES = 128 * 2**20


class SigCache:
    """An LRU of ``key -> (signatures, value)`` bounded in entries and in bytes (:func:`nbytes`);
    the newest value is always kept, whatever its size."""

    def __init__(self, maxsize: int = 256, max_bytes: int = MAX_BYTES):
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self._items: OrderedDict[Hashable, tuple[Hashable, Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
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
        size = nbytes(value)
        with self._lock:
            self.misses += 1
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old[2]
            self._items[key] = (sigs, value, size)
            self.bytes += size
            while len(self._items) > 1 and (len(self._items) > self.maxsize or self.bytes > self.max_bytes):
                self.bytes -= self._items.popitem(last=False)[1][2]
        return value

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.bytes = 0
