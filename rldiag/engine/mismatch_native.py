"""The mismatch pass's chunk record in one compiled loop (``native/mismatch_chunk.c``): the
record :func:`rldiag.engine.mismatch_scan.scan_chunk` computes with plain sums of products, and
the tokens it picks for the order statistics, from one read of the chunk's log-probs.

The numpy pass makes about 35 passes over a chunk's float64 arrays (one operation each); this
reads the chunk's float32 log-probs and mask once, in blocks of 256 tokens that stay in the
cache, four float64 lanes at a time. Same tokens, same definitions; the sums are float64 in
another order (four lanes over a block, then the blocks) and ``exp|d|`` is the kernel's own
(within 2 units in the last place, as numpy's), so that a statistic differs from the numpy
pass's within the float64 rounding of its sums (the bound in docs/performance.md); counts,
order statistics and picked tokens are the same. The centred rescan,
the body's pass and a second pick keep the numpy pass (rare, or their own reads).

Used where the library was built (``rldiag.engine.native``) and both log-prob streams are
float32, bfloat16 or float16 (widened to float32 exactly); float64 log-probs take the numpy pass
(float32 would round them).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from rldiag.engine import mismatch_scan as scan
from rldiag.engine import native

#: the calling convention these bindings were written for (``rldiag_mismatch_abi`` in the C)
ABI = 2



def _bind(lib: ctypes.CDLL | None) -> ctypes.CDLL | None:
    """The library, its kernel's types declared; None where it is another version's (an install
    not rebuilt since its sources changed: the numpy pass runs)."""
    if lib is None:
        return None
    try:
        if lib.rldiag_mismatch_abi() != ABI or lib.rldiag_mismatch_fields() != len(scan.FIELDS):
            return None
    except AttributeError:  # older than the calling convention's number
        return None
    fn = lib.rldiag_mismatch_chunk
    fn.restype = ctypes.c_long
    fn.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_long] * 2 + [ctypes.c_void_p] + [ctypes.c_long] * 2
                   + [ctypes.c_double] * 6 + [ctypes.c_void_p] * 4)
    return lib


_LIB = _bind(native.load("mismatch_chunk"))

#: the log-prob dtypes the kernel reads (as float32: each widens exactly)
NARROW = (torch.float32, torch.bfloat16, torch.float16)


def built() -> bool:
    """Whether the kernel's library was built (and is this version's, and not turned off)."""
    return _LIB is not None


def usable(inp: scan.Inputs) -> bool:
    """Whether the kernel runs on these inputs: built, and both streams at most float32."""
    return _LIB is not None and inp.old.dtype in NARROW and inp.rollout.dtype in NARROW


class Out:
    """The kernel's output arrays, reused by every chunk: the record, the sample and the picks;
    the 0/1 flags of a mask neither bool nor float32."""

    def __init__(self, size: int) -> None:
        self.rec = np.zeros(len(scan.FIELDS), dtype=np.float64)
        self.sample = np.empty(size // scan.SAMPLE + 1, dtype=np.float32)
        self.pick_d = np.empty(size + 1, dtype=np.float64)
        self.pick_y = np.empty(size + 1, dtype=np.float64)
        self.flags = np.empty(size + 1, dtype=np.uint8)


def _f32(v: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(v if v.dtype == np.float32 else v.astype(np.float32))


def first_threshold(inp: scan.Inputs, a: int, m: int) -> float:
    """:func:`rldiag.engine.mismatch_scan.first_threshold` of the step's first chunk ``[a, a + m)``,
    from its sampled tokens only: their ``|d|`` in float64 (0 off the actor tokens), the same
    values the numpy pass samples."""
    xs = scan.host(inp.old[a: a + m: scan.SAMPLE]).astype(np.float64)
    ys = scan.host(inp.rollout[a: a + m: scan.SAMPLE]).astype(np.float64)
    ks = scan.host(inp.mask[a: a + m: scan.SAMPLE])
    actor = (ks > 0) & np.isfinite(xs) & np.isfinite(ys)
    return scan.threshold(np.where(actor, np.abs(xs - ys), 0.0), scan.PICK)


def scan_chunk(inp: scan.Inputs, out: Out, a: int, m: int, me: int, picked: scan.Picked) -> np.ndarray:
    """The record of the chunk ``[a, a + m)`` (reading ``me`` tokens: the next one's pair), as
    :func:`rldiag.engine.mismatch_scan.scan_chunk` with plain sums of products; its kept tokens
    and sample go to ``picked``. ``(len(FIELDS),)`` float64."""
    xs, ys = _f32(scan.host(inp.old[a: a + me])), _f32(scan.host(inp.rollout[a: a + me]))
    ks = np.ascontiguousarray(scan.host(inp.mask[a: a + me]))
    flags = fmask = None  # a float32 mask is read as such; another, as its 0/1 flags
    if ks.dtype == np.float32:
        fmask = ks
    else:
        flags = ks.view(np.uint8) if ks.dtype == np.bool_ else np.greater(ks, 0, out=out.flags[:me].view(np.bool_))
    first = int(np.searchsorted(inp.offsets, a, side="right")) - 1
    last = int(np.searchsorted(inp.offsets, a + me - 1, side="right")) - 1
    starts = np.ascontiguousarray(inp.offsets[first + 1: last + 1] - a, dtype=np.int64)
    assert _LIB is not None
    kept = _LIB.rldiag_mismatch_chunk(xs.ctypes.data, ys.ctypes.data, None if flags is None else flags.ctypes.data,
               None if fmask is None else fmask.ctypes.data, m, me, starts.ctypes.data, starts.shape[0],
               int(inp.offsets[first]) - a, picked.threshold, scan.CONFIDENT, scan.UNCONFIDENT, scan.EXTREME,
               scan.HALF_MIN, scan.HALF_MAX, out.rec.ctypes.data, out.sample.ctypes.data, out.pick_d.ctypes.data,
               out.pick_y.ctypes.data)
    rec = out.rec.copy()
    if picked.holds_extreme:
        rec[scan.F["extreme"]] = 0.0  # counted among the picked tokens
    picked.d.append(out.pick_d[:kept].copy())
    picked.y.append(out.pick_y[:kept].copy())
    picked.sample.append(out.sample[:(m + scan.SAMPLE - 1) // scan.SAMPLE].copy())
    return rec
