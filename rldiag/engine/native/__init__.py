"""The engine's compiled kernels: plain C shared libraries (``*.c`` beside this file), built at
install time by ``setup.py`` (optional: an install without a C compiler builds none) and loaded
through :mod:`ctypes` (no Python API: a call holds no GIL).

Every kernel has a numpy or torch twin, the one the engine falls back to where its library was not
built, and the tests hold the two to the same numbers (``tests/engine/test_mismatch_native.py``).
``RLDIAG_NATIVE=0`` in the environment turns every kernel off (the twins then run).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent


def library_path(name: str) -> Path | None:
    """The built library of the kernel ``name`` (``_<name>`` with this interpreter's extension
    suffix, as setuptools names it), or None where it was not built."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = HERE / f"_{name}{suffix}"
        if path.is_file():
            return path
    return None


@cache
def load(name: str) -> ctypes.CDLL | None:
    """The kernel ``name``'s library, or None: not built, unloadable, or ``RLDIAG_NATIVE=0``."""
    if os.environ.get("RLDIAG_NATIVE", "1") == "0":
        return None
    path = library_path(name)
    if path is None:
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        return None


def checked(name: str, prefix: str, abi: int, fields: int) -> ctypes.CDLL | None:
    """:func:`load`'s library, where it is the version its bindings were written for: its
    ``rldiag_<prefix>_abi()`` (the calling convention's number, raised with every change to its
    functions' arguments) is ``abi`` and its ``rldiag_<prefix>_fields()`` (the length of the
    record it writes) is ``fields``; None otherwise (an install not rebuilt since its sources
    changed: the twin runs)."""
    lib = load(name)
    if lib is None:
        return None
    try:
        if getattr(lib, f"rldiag_{prefix}_abi")() != abi or getattr(lib, f"rldiag_{prefix}_fields")() != fields:
            return None
    except AttributeError:  # older than the calling convention's number
        return None
    return lib


#: a C function's declaration for :func:`bound`: its return type (None: void) and argument types
Signature = tuple[Any, list[Any]]


def bound(name: str, prefix: str, abi: int, fields: int, functions: dict[str, Signature]) -> ctypes.CDLL | None:
    """:func:`checked`'s library with each of its ``functions`` (name -> (return type, argument
    types)) declared to ctypes; None where it is not there or not this version (the twin runs)."""
    lib = checked(name, prefix, abi, fields)
    if lib is None:
        return None
    for fn_name, (restype, argtypes) in functions.items():
        fn = getattr(lib, fn_name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def mask_pointers(mask: np.ndarray | None) -> tuple[int | None, int | None]:
    """``(float32 pointer, byte pointer)`` of a contiguous float32 or bool mask, the other None
    (both None without a mask): how every kernel takes a mask (``fmask`` / ``bmask``)."""
    if mask is None:
        return None, None
    if mask.dtype == np.float32:
        return mask.ctypes.data, None
    if mask.dtype == np.bool_:
        return None, mask.view(np.uint8).ctypes.data
    raise TypeError(f"a kernel's mask is float32 or bool, not {mask.dtype}")
