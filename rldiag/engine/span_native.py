"""Masked sums of several token columns over each span of a layout in one compiled read
(``native/span_sums.c``), for the turns stages (:mod:`rldiag.engine.stages.turns`; the twin:
:meth:`rldiag.engine.layout.Rows.mask_count` and :meth:`~rldiag.engine.layout.Rows.masked_sum`,
two passes a column): per span the mask's sum, each column's masked sum and, where given, the
masked sum of a float32 difference of two columns. float32 terms as the twin's, summed in float32
blocks added in float64: within float32's rounding of the twin's sums
(tests/engine/test_span_native.py).

Used where the library was built and every tensor is a float32 host tensor of the layout's
tokens (the mask float32 or bool); elsewhere the twin runs.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from rldiag.engine import host, native

#: the calling convention these bindings were written for (``rldiag_spans_abi`` in the C)
ABI = 1
#: the most series one call sums (the mask's, the columns', the difference's)
MAX_SERIES = 8


_LIB = native.bound("span_sums", "spans", ABI, MAX_SERIES, {"rldiag_span_sums": (
    ctypes.c_long, [ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 5 + [ctypes.c_long, ctypes.c_void_p])})


def built() -> bool:
    """Whether the kernel's library was built (and is this version's, and not turned off)."""
    return _LIB is not None


def span_sums(columns: Sequence[torch.Tensor], mask: torch.Tensor | None, offsets: torch.Tensor,
              diff: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """``(count, sums)``: the mask's sum over each span ``(spans,)`` and the masked sum of each
    column, then of ``diff[0] - diff[1]``, ``(spans,)`` each, float32; or None where the kernel
    does not apply. ``columns``, ``mask``, ``diff``: ``(tokens,)``; ``offsets``: ``(spans + 1,)``.
    ``mask`` None: plain sums (every token with weight 1; the count is the span's length)."""
    width = 1 + len(columns) + (diff is not None)
    if _LIB is None or width > MAX_SERIES or offsets.device.type != "cpu":
        return None
    if mask is not None and mask.dtype not in (torch.float32, torch.bool):
        return None
    n = int(offsets[-1]) if offsets.numel() else 0
    values = list(columns) + ([] if diff is None else list(diff))
    if any(t.dtype != torch.float32 for t in values):
        return None
    views = [host.view(t) for t in values] + ([] if mask is None else [host.view(mask)])
    if any(v is None or v.shape != (n,) for v in views):
        return None
    arrays = [np.ascontiguousarray(v) for v in views]
    m = None if mask is None else arrays.pop()
    cols = arrays[:len(columns)]
    pointers = (ctypes.c_void_p * max(len(cols), 1))(*[c.ctypes.data for c in cols])
    da = db = None
    if diff is not None:
        da, db = arrays[-2].ctypes.data, arrays[-1].ctypes.data
    off = np.ascontiguousarray(offsets.numpy(), dtype=np.int64)
    n_spans = max(off.shape[0] - 1, 0)
    out = np.zeros((n_spans, width), dtype=np.float64)
    fmask, bmask = native.mask_pointers(m)
    code = _LIB.rldiag_span_sums(ctypes.cast(pointers, ctypes.c_void_p), len(cols), da, db, fmask, bmask,
                                 off.ctypes.data, n_spans, out.ctypes.data)
    assert code == 0
    sums = torch.from_numpy(out.astype(np.float32))
    return sums[:, 0], [sums[:, j] for j in range(1, width)]
