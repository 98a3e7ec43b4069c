"""The SHA-256 of a run's batch files, for each scenario's input records (``scenario.json``'s
``inputs``: a later recompute keeps a step whose file is unchanged).

- :class:`PieceHash`: a local file hashed in pieces from an open descriptor, advanced by whichever
  thread gets to it first (the low-priority hash thread, :func:`hash_pool`, or the thread that
  needs the record);
- :func:`known_inputs`: the records the run's scenarios hold already (a file whose size and
  modification time still match one is not hashed again);
- :class:`EarlyHashes`: the files a recompute will hash, hashed from the moment it is called,
  while the process still imports torch and the engine (about a second, with a core idle): the
  fetch of each step then finds its file's hash done (:func:`claim_early`) instead of hashing
  beside the engine, which slowed the engine's memory-bound stages by 10-20 % on 2 cores
  (docs/performance.md, "Hashing while torch imports").

Imports neither torch nor the engine: :func:`rldiag.api.recompute` starts the early hashes before
it imports them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from rldiag.errors import RldiagError
from rldiag.io.fs import RemotePath, is_remote, relative_to
from rldiag.io.outputs import list_scenarios
from rldiag.io.run_layout import RunLayout
from rldiag.io.rundir import RunDir, Steps, parse_steps

#: A local file is hashed in pieces of this many bytes, never held whole, read into one buffer
#: per file (a new bytes object a piece cost 10 % more CPU, and a thread hashing beside the
#: imports waited for the GIL for each: 2.4 s instead of 0.9 s for 727 MB, docs/performance.md).
HASH_PIECE = 1 << 22

#: The hash threads' nice value: they run when a core would otherwise be idle.
HASH_NICE = 19


def lower_priority() -> None:
    """Lower this thread's scheduling priority, where the platform allows it per thread (Linux:
    ``setpriority`` on a thread id); elsewhere leave it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), HASH_NICE)
    except (OSError, AttributeError):
        pass


_HASH_POOL: ThreadPoolExecutor | None = None


def hash_pool() -> ThreadPoolExecutor:
    """The one background thread that hashes the step files (lower priority), started on first use."""
    global _HASH_POOL
    if _HASH_POOL is None:
        _HASH_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rldiag-hash", initializer=lower_priority)
    return _HASH_POOL


class PieceHash:
    """The record of a local file open as ``fd`` (``info`` with the file's ``size`` and
    ``sha256``; ``fd`` is closed once read), hashed in pieces of :data:`HASH_PIECE` bytes at
    their offsets (``os.pread``: the file's position, which the loader may share, is left alone),
    so that no more than a piece of it is held at once.

    Any thread may advance it (:meth:`run`): the hash thread runs it in the machine's idle
    moments, and a thread that needs the record hashes what is left itself rather than wait for a
    low-priority thread, which a loaded machine runs last. The pieces are hashed in order under a
    lock, so the digest is the file's whichever thread read which piece."""

    def __init__(self, info: dict, fd: int):
        self._info = dict(info)
        self._fd = fd
        self._sha = hashlib.sha256()
        self._size = 0
        self._buf: bytearray | None = None  # the pieces' buffer, from the first piece to the last
        self._lock = threading.Lock()
        self._result: dict | None = None
        self._error: OSError | None = None

    def run(self) -> dict:
        """Hash the pieces left, if any; the record (a copy), or the error the file's read raised."""
        while True:
            with self._lock:
                if self._error is not None:
                    raise self._error
                if self._result is not None:
                    return dict(self._result)
                try:
                    buf, n = self._read_piece()
                except OSError as exc:
                    self._error, self._buf = exc, None
                    os.close(self._fd)
                    raise
                if n:
                    with memoryview(buf)[:n] as piece:
                        self._sha.update(piece)  # hashlib releases the GIL for the piece
                    self._size += n
                    continue
                os.close(self._fd)
                self._buf = None
                self._result = {**self._info, "size": self._size, "sha256": self._sha.hexdigest()}

    def _read_piece(self) -> tuple[bytearray, int]:
        """The next piece into the buffer (the GIL released while it reads): the buffer and the
        piece's length, 0 at the end."""
        buf = self._buf
        if buf is None or len(buf) != HASH_PIECE:
            buf = self._buf = bytearray(HASH_PIECE)
        if hasattr(os, "preadv"):
            return buf, os.preadv(self._fd, [buf], self._size)
        data = os.pread(self._fd, HASH_PIECE, self._size)  # platforms without preadv
        buf[: len(data)] = data
        return buf, len(data)


def known_inputs(run: Path | RemotePath, exclude: str) -> dict[str, dict]:
    """Input records of the run's complete scenarios other than ``exclude``, by file (the newest
    record wins).

    A file whose size and modification time still match such a record keeps its SHA-256
    without being hashed again (:func:`rldiag.executors.steps.known_hash`): a second scenario
    of the same run (another estimator, say) reads its files but does not hash them. Local runs
    only: on an object store each scenario's record is one more request.
    """
    if is_remote(run):
        return {}
    known: dict[str, dict] = {}
    layout = RunLayout(run)
    metas = []
    for name in list_scenarios(run):
        if name == exclude:
            continue
        try:
            metas.append(json.loads(layout.scenario(name).meta.read_text()))
        except (OSError, ValueError):
            continue
    for meta in sorted(metas, key=lambda m: str(m.get("created", ""))):  # newer records win
        for rec in meta.get("inputs", []) if isinstance(meta.get("inputs"), list) else []:
            if isinstance(rec, dict) and rec.get("file") and rec.get("sha256") and "size" in rec and "mtime_ns" in rec:
                known[str(rec["file"])] = rec
    return known


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What makes two opens of a path the same bytes, as rldiag's input records judge it: the
    same file (device, inode), size and modification time."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


#: an early hash's state for its path: taken by a fetch (its own hash from then), or started
_CLAIMED = "claimed"


class EarlyHashes:
    """Local files hashed in order on a thread of their own (lower priority), from construction
    until :meth:`stop`; one file open at a time, whatever the number of files.

    A fetch that opens one of the files asks :meth:`claim` for its hash: the early hash of the
    same file (device, inode, size and modification time all equal, so a file replaced or
    rewritten meanwhile is hashed again by the fetch), done or partly done (the fetch's threads
    finish it, :class:`PieceHash`); or None, and then the early thread leaves that file alone.
    Each file is claimed once."""

    def __init__(self, paths: Iterable[Path]):
        self._paths = [str(p) for p in paths]
        self._lock = threading.Lock()
        self._state: dict[str, str | tuple[tuple[int, int, int, int], PieceHash]] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rldiag-early-hash")
        self._thread.start()

    def _run(self) -> None:
        lower_priority()
        for path in self._paths:
            if self._stopped.is_set():
                return
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue  # the fetch reports a file it cannot read
            try:
                ident = _identity(os.fstat(fd))
            except OSError:
                os.close(fd)
                continue
            ph = PieceHash({}, fd)
            with self._lock:
                if path in self._state:  # claimed already: the fetch hashes it
                    os.close(fd)
                    continue
                self._state[path] = (ident, ph)
            try:
                ph.run()
            except OSError:
                continue  # kept in the PieceHash: a claim gets the error, as from its own read

    def claim(self, path: str, fd: int) -> PieceHash | None:
        """The early hash of the file ``path`` open as ``fd``, if it is the file the early thread
        opened (else None); the file is never hashed early after this call."""
        with self._lock:
            got = self._state.get(path)
            self._state[path] = _CLAIMED
        if not isinstance(got, tuple):  # never started, or claimed before
            return None
        ident, ph = got
        try:
            same = _identity(os.fstat(fd)) == ident
        except OSError:
            return None
        return ph if same else None

    def join(self) -> None:
        """Returns once every file is hashed (or left to a claim, or unreadable)."""
        self._thread.join()

    def stop(self) -> None:
        """No file started after this; returns once the file being hashed is done (its descriptor closed)."""
        self._stopped.set()
        self._thread.join()


_ACTIVE: list[EarlyHashes] = []
_ACTIVE_LOCK = threading.Lock()


@contextmanager
def early_hashes(paths: list[Path]) -> Iterator[EarlyHashes | None]:
    """Hash ``paths`` early (:class:`EarlyHashes`) for the time of the block, where fetches find
    them (:func:`claim_early`); nothing for an empty list."""
    if not paths:
        yield None
        return
    early = EarlyHashes(paths)
    with _ACTIVE_LOCK:
        _ACTIVE.append(early)
    try:
        yield early
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE.remove(early)
        early.stop()


def claim_early(path: str, fd: int) -> PieceHash | None:
    """The early hash of the local file ``path`` open as ``fd`` (:meth:`EarlyHashes.claim`), from
    whichever block of :func:`early_hashes` is hashing it; None where none is."""
    with _ACTIVE_LOCK:
        active = list(_ACTIVE)
    for early in active:
        ph = early.claim(path, fd)
        if ph is not None:
            return ph
    return None


def files_to_hash(run: Path, files: Iterable[tuple[str, Path]], reuse: bool) -> list[Path]:
    """Of a local run's batch files (``(path relative to the run, path)``), those a recompute will
    hash: every one without ``reuse``, else those no scenario's record matches in size and
    modification time (:func:`known_inputs`: a matching record's hash is kept)."""
    files = list(files)
    if not reuse:
        return [p for _, p in files]
    known = known_inputs(run, exclude="")
    out = []
    for rel, path in files:
        rec = known.get(rel)
        if rec is not None:
            try:
                st = path.stat()
            except OSError:
                continue
            if rec.get("size") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns:
                continue
        out.append(path)
    return out


def recompute_files(run: str | Path | RemotePath, steps: Steps, reuse: bool) -> list[Path]:
    """The batch files a recompute of ``run``'s ``steps`` will hash (:func:`files_to_hash`), in
    step order; none for a run on an object store, or one whose files or steps cannot be listed
    (the recompute itself then says why)."""
    try:
        rd = RunDir(run)
        if is_remote(rd.path):
            return []
        files = {sf.step: sf for sf in rd.require_steps()}
        chosen = parse_steps(steps, sorted(files))
    except (RldiagError, OSError):
        return []
    local = [(str(relative_to(files[s].path, rd.path)), files[s].path) for s in chosen]
    return files_to_hash(rd.path, [(rel, p) for rel, p in local if isinstance(p, Path)], reuse)
