"""The mismatch pass's chunk record in one compiled loop (``native/mismatch_chunk.c``): the
record :func:`rldiag.engine.mismatch_scan.scan_chunk` computes with plain sums of products, and
the tokens it picks for the order statistics, from one read of the chunk's log-probs.

The numpy pass makes about 35 passes over a chunk's float64 arrays (one operation each); this
reads the chunk's float32 log-probs and mask once, in blocks of 128 tokens that stay in the
cache, eight float64 lanes at a time (one AVX-512 vector, or two four-lane ones: the same bits,
:func:`lanes`). Same tokens, same definitions; the sums are float64 in another order (eight
lanes over a block, then the blocks) and ``exp|d|`` is the kernel's own (within 2 units in the
last place, as numpy's), so that a statistic differs from the numpy pass's within the float64
rounding of its sums (the bound in docs/performance.md); counts, order statistics and picked
tokens are the same. A step's first chunk sets its threshold in the same call, from the same
sample as the numpy pass's. The centred rescan, the body's pass and a second pick keep the numpy
pass (rare, or their own reads).

A step's chunks write their picked tokens one after another into the same arrays
(:class:`Out`), so that the step's picks are one array, never joined; its order statistics are
then selected from them by :func:`select` (a radix selection in the same library, where
``np.partition`` takes about 12 ns an element) and the tokens above its 95th percentile summed by
:func:`above`.

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
ABI = 7


_LIB = native.bound("mismatch_chunk", "mismatch", ABI, len(scan.FIELDS), {
    "rldiag_mismatch_chunk": (ctypes.c_long, [ctypes.c_void_p] * 4 + [ctypes.c_long] * 2 + [ctypes.c_void_p]
                              + [ctypes.c_long] * 2 + [ctypes.c_double] * 6 + [ctypes.c_void_p] * 6),
    "rldiag_mismatch_select": (ctypes.c_long, [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p] + [ctypes.c_long] * 2
                               + [ctypes.c_double] + [ctypes.c_void_p] * 4),
    "rldiag_mismatch_above": (None, [ctypes.c_void_p] * 2 + [ctypes.c_long] + [ctypes.c_double] + [ctypes.c_void_p]),
    "rldiag_mismatch_lanes": (ctypes.c_int, []),
})

#: the log-prob dtypes the kernel reads (as float32: each widens exactly)
NARROW = (torch.float32, torch.bfloat16, torch.float16)


def built() -> bool:
    """Whether the kernel's library was built (and is this version's, and not turned off)."""
    return _LIB is not None


def lanes() -> int:
    """The float64 lanes of the kernel's vectors here: 8 where the processor has AVX-512 (one
    512-bit vector), else 4 (``RLDIAG_NATIVE_LANES=4`` in the environment takes 4 anyway); both
    give the same bits. 0 where the library was not built."""
    return 0 if _LIB is None else int(_LIB.rldiag_mismatch_lanes())


def usable(inp: scan.Inputs) -> bool:
    """Whether the kernel runs on these inputs: built, and both streams at most float32."""
    return _LIB is not None and inp.old.dtype in NARROW and inp.rollout.dtype in NARROW


#: the kernel's chunks are this many of the numpy pass's (:data:`rldiag.engine.mismatch_scan.CHUNK`):
#: a call's fixed cost (the chunk's views, its rows, the call) spread over more tokens; its
#: buffers are a few bytes a token of the chunk, not of the step
SPAN = 4


def chunk_size() -> int:
    """The kernel's chunk: :data:`SPAN` numpy chunks."""
    return scan.CHUNK * SPAN


#: a chunk of m tokens writes up to m + 7 picks' places (each octet may write eight)
SLACK = 8


class Out:
    """The kernel's output arrays, reused by every chunk: the record, the sample; the picks of
    the step so far (``kept`` of them: each chunk writes its own after the last chunk's, the
    arrays grown by half where a chunk might not fit); the 0/1 flags of a mask neither bool nor
    float32."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.rec = np.zeros(len(scan.FIELDS), dtype=np.float64)
        self.sample = np.empty(size // scan.SAMPLE + 1, dtype=np.float32)
        self.pick_d = np.empty(size + SLACK, dtype=np.float64)
        self.pick_y = np.empty(size + SLACK, dtype=np.float64)
        self.kept = 0
        self.flags = np.empty(size + 1, dtype=np.uint8)
        self.used = np.zeros(1, dtype=np.float64)
        self.spec = np.array([0.0, scan.THRESHOLD_RUN * scan.THRESHOLD_SAMPLE, scan.THRESHOLD_RUN, scan.PICK])

    def first_spec(self, sampled: int) -> np.ndarray:
        """The kernel's spec of a first threshold: the tokens sampled from, the runs' step and
        length, the top share (rldiag/engine/mismatch_scan.py's THRESHOLD_SAMPLE, THRESHOLD_RUN,
        PICK)."""
        self.spec[0] = sampled
        return self.spec

    def reserve(self, m: int) -> None:
        """Room for ``m`` more picks after the ``kept`` ones (which are kept)."""
        need = self.kept + m + SLACK
        if need > self.pick_d.shape[0]:
            size = max(need, self.pick_d.shape[0] + self.pick_d.shape[0] // 2)
            for name in ("pick_d", "pick_y"):
                grown = np.empty(size, dtype=np.float64)
                grown[:self.kept] = getattr(self, name)[:self.kept]
                setattr(self, name, grown)

    def step_picks(self, picked: scan.Picked) -> None:
        """``picked``'s d and y: this step's picks, as one array each (views of these arrays:
        read before the next step's first chunk)."""
        picked.d[:] = [self.pick_d[:self.kept]]
        picked.y[:] = [self.pick_y[:self.kept]]


def _f32(v: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(v if v.dtype == np.float32 else v.astype(np.float32))


def _streams(inp: scan.Inputs, a: int, me: int, flags_buf: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Tokens ``[a, a + me)`` as the kernel reads them: x and y float32, and the mask as its
    float32 values or else its 0/1 flags (a bool mask's own bytes; another, compared with 0 into
    ``flags_buf`` where given)."""
    xs, ys = _f32(scan.host(inp.old[a: a + me])), _f32(scan.host(inp.rollout[a: a + me]))
    ks = np.ascontiguousarray(scan.host(inp.mask[a: a + me]))
    if ks.dtype == np.float32:
        return xs, ys, None, ks
    if ks.dtype == np.bool_:
        return xs, ys, ks.view(np.uint8), None
    out = None if flags_buf is None else flags_buf[:me].view(np.bool_)
    return xs, ys, np.greater(ks, 0, out=out).view(np.uint8), None


def _ptr(v: np.ndarray | None) -> int | None:
    return None if v is None else v.ctypes.data


def scan_chunk(inp: scan.Inputs, out: Out, a: int, m: int, me: int, picked: scan.Picked,
               sampled: int = 0) -> np.ndarray:
    """The record of the chunk ``[a, a + m)`` (reading ``me`` tokens: the next one's pair), as
    :func:`rldiag.engine.mismatch_scan.scan_chunk` with plain sums of products; its kept tokens
    and sample go to ``picked`` (the tokens as views of ``out``'s arrays, after the ``out.kept``
    before them: ``out.kept = 0`` starts a step). A ``picked.threshold`` NaN: a step's first
    chunk, whose threshold the kernel sets first, as
    :func:`rldiag.engine.mismatch_scan.first_threshold` from the sample of its first ``sampled``
    tokens (the same values, selected by the library), into ``picked.threshold``.
    ``(len(FIELDS),)`` float64."""
    xs, ys, flags, fmask = _streams(inp, a, me, out.flags)
    first = int(np.searchsorted(inp.offsets, a, side="right")) - 1
    last = int(np.searchsorted(inp.offsets, a + me - 1, side="right")) - 1
    starts = np.ascontiguousarray(inp.offsets[first + 1: last + 1] - a, dtype=np.int64)
    assert _LIB is not None
    out.reserve(m)
    at = out.kept
    kept = _LIB.rldiag_mismatch_chunk(
               xs.ctypes.data, ys.ctypes.data, _ptr(flags), _ptr(fmask), m, me, starts.ctypes.data, starts.shape[0],
               int(inp.offsets[first]) - a, picked.threshold, scan.CONFIDENT, scan.UNCONFIDENT, scan.EXTREME,
               scan.HALF_MIN, scan.HALF_MAX, out.rec.ctypes.data, out.sample.ctypes.data,
               out.pick_d.ctypes.data + 8 * at, out.pick_y.ctypes.data + 8 * at, out.first_spec(sampled).ctypes.data,
               out.used.ctypes.data)
    if kept < 0:
        raise MemoryError(f"mismatch pass: no memory for the first threshold's sample of {sampled} tokens")
    picked.threshold = float(out.used[0])
    rec = out.rec.copy()
    if picked.holds_extreme:
        rec[scan.F["extreme"]] = 0.0  # counted among the picked tokens
    out.kept = at + kept
    picked.d.append(out.pick_d[at: at + kept])
    picked.y.append(out.pick_y[at: at + kept])
    picked.sample.append(out.sample[:(m + scan.SAMPLE - 1) // scan.SAMPLE].copy())
    return rec


def select(d: np.ndarray, ranks: list[int], k: int, extreme: float) -> tuple[np.ndarray, float, int]:
    """The order statistics of the picked tokens' ``|d|`` (``d``: ``(n,)`` float64): the values of
    ascending ``ranks`` (each in ``[0, n)``), exactly those of a sort; the summed ``d^2 / 2`` of the
    ``k`` largest (``0 <= k <= n``; four float64 lanes in the tokens' order, then the lanes: the
    same bits every time), and how many ``|d|`` exceed ``extreme``."""
    assert _LIB is not None
    d = np.ascontiguousarray(d, dtype=np.float64)
    n = d.shape[0]
    r = np.ascontiguousarray(ranks, dtype=np.int64)
    vals = np.empty(max(r.shape[0], 1), dtype=np.float64)
    top = np.zeros(2, dtype=np.float64)
    keys = np.empty(max(n, 1), dtype=np.uint64)
    spare = np.empty(max(n, 1), dtype=np.uint64)
    if _LIB.rldiag_mismatch_select(d.ctypes.data, n, r.ctypes.data, r.shape[0], k, extreme, vals.ctypes.data,
                                   top.ctypes.data, keys.ctypes.data, spare.ctypes.data) != 0:
        raise ValueError(f"mismatch select: ranks {ranks} or k {k} outside {n} tokens")
    return vals[: r.shape[0]], float(top[0]), int(top[1])


def above(d: np.ndarray, y: np.ndarray, level: float) -> np.ndarray:
    """The picked tokens with ``|d|`` above ``level``: their count, sums of d, y and ``|d|``, and
    the sums of products of d and y centred on their own means (dd, dy, yy). ``(7,)`` float64."""
    assert _LIB is not None
    d = np.ascontiguousarray(d, dtype=np.float64)
    y = np.ascontiguousarray(y, dtype=np.float64)
    out = np.empty(7, dtype=np.float64)
    _LIB.rldiag_mismatch_above(d.ctypes.data, y.ctypes.data, d.shape[0], level, out.ctypes.data)
    return out
