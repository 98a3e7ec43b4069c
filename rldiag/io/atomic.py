"""Atomic writes: a reader sees the old content or the new, never half of either."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file beside ``path``, fsync, then rename over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
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
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        writer(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux ``renameat2(RENAME_EXCHANGE)``; False if unsupported."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return False
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def staging_dir(target: Path) -> Path:
    """A fresh hidden directory beside ``target`` to build its new content in."""
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = target.parent / f".{target.name}.{uuid.uuid4().hex[:12]}.tmp"
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
    old = target.parent / f".{target.name}.{uuid.uuid4().hex[:12]}.old"
    os.rename(target, old)
    os.rename(stage, target)
    shutil.rmtree(old, ignore_errors=True)
