"""The diagnostic token-level TIS weights' exact statistics of a step in one compiled read
(``native/tis_counts.c``), for :func:`rldiag.engine.diag_is.tis_statistics` (its twin: torch's
``mul_`` by the mask, numpy's two counts, torch's clamp and ``amax``, numpy's masked minimum): the
weights made 0 off the mask, those above and below the ratio fractions' bounds, the truncation in
place, and the truncated weights' extrema. A product, counts, a clamp and extrema are exact: the
same values as the twin's (tests/engine/test_diag_is_native.py). Then :func:`spread`: the
standard deviation's and the effective sample size's token terms by the twin's float32
operations in its order (the same bits), one read each where torch makes three passes and two.
And :func:`sequence`: the sequence level's statistics from the rows, numpy's operations in its
order (the same bits as :func:`rldiag.engine.diag_is._sequence_table`), in one call.

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
ABI = 4
#: the fields the kernel writes, in its order
FIELDS = ("above", "below", "max", "min")


_LIB = native.bound("tis_counts", "tis", ABI, len(FIELDS), {
    "rldiag_tis_counts": (ctypes.c_long, [ctypes.c_void_p] * 3 + [ctypes.c_long] + [ctypes.c_float] * 3
                          + [ctypes.c_void_p] * 3),
    "rldiag_tis_spread": (ctypes.c_long, [ctypes.c_void_p] * 3 + [ctypes.c_long] + [ctypes.c_float] * 2
                          + [ctypes.c_void_p] * 2),
    "rldiag_tis_sequence": (ctypes.c_long, [ctypes.c_void_p] * 4 + [ctypes.c_long, ctypes.c_void_p, ctypes.c_long]
                            + [ctypes.c_float] * 3 + [ctypes.c_double] + [ctypes.c_void_p] * 2),
})

#: the rows of :func:`sequence`'s table, in its order
SEQUENCE_ROWS = ("mean", "std", "eff_sample_size", "ratio_fraction_high", "ratio_fraction_low", "max_log", "min_log")


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


def step_counts(w: torch.Tensor, mask: torch.Tensor, up: float, lo: float, cap: float,
                log_ratio: torch.Tensor | None = None, products: torch.Tensor | None = None) -> StepCounts:
    """A step's slice of the raw weights ``w = exp(clamp(d))`` ``(tokens,)`` (where :func:`usable`):
    multiplied by the mask and truncated to ``cap`` in place, counted before the truncation, its
    extrema after; with ``log_ratio`` (``d``, float32, ``w``'s shape), ``products`` (float32,
    contiguous) gets ``d * mask``."""
    assert _LIB is not None
    v = host.view(w)
    m = np.ascontiguousarray(host.view(mask))
    assert v is not None and v.flags.c_contiguous
    out = np.zeros(len(FIELDS), dtype=np.float64)
    fmask, bmask = native.mask_pointers(m)
    d = dm = None
    if log_ratio is not None and products is not None:
        dv, pv = host.view(log_ratio), host.view(products)
        assert dv is not None and pv is not None and dv.flags.c_contiguous and pv.flags.c_contiguous
        assert dv.dtype == pv.dtype == np.float32 and dv.shape == pv.shape == v.shape
        d, dm = dv.ctypes.data, pv.ctypes.data
    _LIB.rldiag_tis_counts(v.ctypes.data, fmask, bmask, v.shape[0], up, lo, cap, d, dm, out.ctypes.data)
    return StepCounts(int(out[0]), int(out[1]), float(out[2]), float(out[3]))


def spread(w: torch.Tensor, mask: torch.Tensor, mean: float, den: float, dev: torch.Tensor, norm: torch.Tensor) -> None:
    """A step's slice of the truncated weights ``w`` ``(tokens,)`` (where :func:`usable`): into
    ``dev`` ``(w - mean)^2 mask`` and into ``norm`` ``(w / den)^2`` (float32, contiguous, ``w``'s
    shape), ``mean`` and ``den`` float32 values (``den = mean + 1e-8`` as torch adds it in float32)."""
    assert _LIB is not None
    v, o1, o2 = host.view(w), host.view(dev), host.view(norm)
    m = np.ascontiguousarray(host.view(mask))
    assert v is not None and o1 is not None and o2 is not None and v.flags.c_contiguous
    for o in (o1, o2):
        assert o.dtype == np.float32 and o.flags.c_contiguous and o.shape == v.shape
    fmask, bmask = native.mask_pointers(m)
    _LIB.rldiag_tis_spread(v.ctypes.data, fmask, bmask, v.shape[0], mean, den, o1.ctypes.data, o2.ctypes.data)


def sequence(ratio: np.ndarray, log_ratio: np.ndarray, row_count: np.ndarray, step_ids: np.ndarray,
             count: np.ndarray, cap: float, log_up: np.float32, log_lo: np.float32, eps: float) -> np.ndarray:
    """The sequence level's table ``(7, n)`` float32 (:data:`SEQUENCE_ROWS`) from the rows' float32
    ``ratio``, summed ``log_ratio`` and actor tokens ``row_count`` ``(rows,)``, their int64 steps
    ``step_ids`` (ascending) and the steps' float32 actor tokens ``count`` ``(n,)``: the numpy twin's
    operations (:func:`rldiag.engine.diag_is._sequence_table`) in its order, the same bits."""
    assert _LIB is not None
    f32 = [np.ascontiguousarray(v, dtype=np.float32) for v in (ratio, log_ratio, row_count, count)]
    sid = np.ascontiguousarray(step_ids, dtype=np.int64)
    n = f32[3].shape[0]
    out = np.empty((7, n), dtype=np.float32)
    scratch = np.empty(max(n, 1), dtype=np.float64)
    if _LIB.rldiag_tis_sequence(f32[0].ctypes.data, f32[1].ctypes.data, f32[2].ctypes.data, sid.ctypes.data,
                                sid.shape[0], f32[3].ctypes.data, n, cap, float(log_up), float(log_lo), eps,
                                scratch.ctypes.data, out.ctypes.data) != 0:
        raise ValueError("diag_is sequence level: the rows are not in step order")
    return out
