"""Atomic writes: a reader sees the old content or the new, never half of either.

Every temporary name here (a file being written, a staging directory, an old directory being
dropped) is hidden and carries its owner: ``.<name>.<host>-<pid>-<start>-<random>.tmp`` (or
``.old``), with a hash of the host name, the process id and the process's start time (Linux:
``/proc/<pid>/stat``; 0 elsewhere). A process killed with ``kill -9`` leaves its temporary files
behind; :func:`remove_stale` deletes those whose owner is gone (no such process, a zombie, or
the pid now belongs to a process started at another time) and never those of a process still
running, nor any made on another host (a shared filesystem) or named another way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import re
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable
from functools import cache
from pathlib import Path

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_OWNED = re.compile(r"^\.(?P<name>.+)\.(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-(?P<start>\d+)-[0-9a-z_]+\.(?:tmp|old)$")


def _host() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def process_start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot) from ``/proc``; None where there is none
    (not Linux, or no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19]) if len(fields) > 19 and fields[0] != b"Z" else None


@cache
def _owner_tag(pid: int) -> str:
    return f"{_host()}-{pid}-{process_start_time(pid) or 0}"


def owner_tag() -> str:
    """``<host>-<pid>-<start>`` of this process (computed again in a forked child)."""
    return _owner_tag(os.getpid())


def temp_name(name: str, suffix: str = "tmp") -> str:
    """A fresh hidden temporary name for ``name``, carrying this process as its owner."""
    return f".{name}.{owner_tag()}-{uuid.uuid4().hex[:12]}.{suffix}"


def _alive(pid: int, start: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    now = process_start_time(pid)
    if now is None:  # a zombie (killed, not yet reaped), or no /proc: dead only if /proc says so
        return not os.path.exists(f"/proc/{pid}")
    return start == 0 or now == start


def remove_stale(parent: Path, name: str | None = None) -> list[Path]:
    """Delete the temporary files and directories in ``parent`` (of ``name`` only, when given)
    whose owner process is gone; returns what was removed. Those of a live process, of another
    host, and names this module did not make are left alone."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    host = _host()
    for entry in entries:
        m = _OWNED.match(entry.name)
        if not m or m["host"] != host or (name is not None and m["name"] != name):
            continue
        if _alive(int(m["pid"]), int(m["start"])):
            continue
        path = Path(entry.path)
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            continue  # another cleaner got there first
        except OSError:
            continue  # not ours to force (permissions): left as it is
        removed.append(path)
    return removed


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file beside ``path``, fsync, then rename over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{owner_tag()}-", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the file a normal mode
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_file_atomic(path: Path, writer: Callable[[Path], None]) -> None:
    """``writer(tmp_path)`` writes the file; it is then renamed over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / temp_name(path.name)
    try:
        writer(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@cache
def _renameat2():
    """libc's ``renameat2``, looked up once (``find_library`` runs ``ldconfig``: 10 ms a call,
    paid by every directory a sweep's scenarios replace); None where there is none."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return None
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux ``renameat2(RENAME_EXCHANGE)``; False if unsupported."""
    fn = _renameat2()
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def staging_dir(target: Path) -> Path:
    """A fresh hidden directory beside ``target`` to build its new content in. Stale temporary
    entries beside it (their owner killed) are removed first (:func:`remove_stale`)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(target.parent)
    stage = target.parent / temp_name(target.name)
    stage.mkdir()
    return stage


def replace_dir(stage: Path, target: Path) -> None:
    """Put the finished ``stage`` directory in place of ``target``.

    With an existing target the two are exchanged in one ``renameat2`` call where the kernel
    supports it, so readers never see a missing or partial directory; elsewhere the old one is
    moved aside first (a reader may then briefly find no directory, never a partial one).
    """
    if not target.exists():
        os.rename(stage, target)
        return
    if _exchange(stage, target):
        shutil.rmtree(stage, ignore_errors=True)  # stage now holds the old content
        return
    old = target.parent / temp_name(target.name, "old")
    os.rename(target, old)
    os.rename(stage, target)
    shutil.rmtree(old, ignore_errors=True)
