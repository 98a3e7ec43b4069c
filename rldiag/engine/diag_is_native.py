"""The diagnostic token-level TIS weights' exact statistics of a step in one compiled read
(``native/tis_counts.c``), for :func:`rldiag.engine.diag_is.tis_statistics` (its twin: numpy's
two counts, torch's clamp and ``amax``, numpy's masked minimum): the weights above and below the
ratio fractions' bounds, the truncation in place, and the truncated weights' extrema. Counts, a
clamp and extrema are exact: the same values as the twin's (tests/engine/test_diag_is_native.py).

Used where the library was built and the weights are a float32 host tensor (the mask float32 or
bool); elsewhere the twin runs.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np
import torch

from rldiag.engine import host, native

#: the calling convention these bindings were written for (``rldiag_tis_abi`` in the C)
ABI = 1
#: the fields the kernel writes, in its order
FIELDS = ("above", "below", "max", "min")


_LIB = native.bound("tis_counts", "tis", ABI, len(FIELDS), {"rldiag_tis_counts": (
    ctypes.c_long, [ctypes.c_void_p] * 3 + [ctypes.c_long] + [ctypes.c_float] * 3 + [ctypes.c_void_p])})


def built() -> bool:
    """Whether the kernel's library was built (and is this version's, and not turned off)."""
    return _LIB is not None


class StepCounts(NamedTuple):
    """One step's counts of raw weights above ``up`` and below ``lo``, and the truncated
    weights' largest value and least value on the mask."""

    above: int
    below: int
    max: float
    min: float


def usable(w: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether :func:`step_counts` applies (the library built; ``w`` a contiguous float32 host
    tensor it may write; the mask float32 or bool, of ``w``'s shape)."""
    return (_LIB is not None and w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous()
            and w.dim() == 1 and mask.shape == w.shape and mask.dtype in (torch.float32, torch.bool)
            and mask.device.type == "cpu")


def step_counts(w: torch.Tensor, mask: torch.Tensor, up: float, lo: float, cap: float) -> StepCounts:
    """A step's slice of the raw weights ``w`` ``(tokens,)`` (where :func:`usable`): counted,
    truncated to ``cap`` in place, its extrema."""
    assert _LIB is not None
    v = host.view(w)
    m = np.ascontiguousarray(host.view(mask))
    assert v is not None and v.flags.c_contiguous
    out = np.zeros(len(FIELDS), dtype=np.float64)
    fmask, bmask = native.mask_pointers(m)
    _LIB.rldiag_tis_counts(v.ctypes.data, fmask, bmask, v.shape[0], up, lo, cap, out.ctypes.data)
    return StepCounts(int(out[0]), int(out[1]), float(out[2]), float(out[3]))
