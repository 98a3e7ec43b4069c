"""The rows' sums of a float32 host token column finished in one compiled call
(``native/row_sums.c``), for :meth:`rldiag.engine.layout.Rows.sum` (its twin:
:meth:`~rldiag.engine.layout.Rows._chunked_sum`'s torch operations): torch sums the whole chunks
of ``PIECE`` tokens, as the twin does; the kernel adds them up in float64, takes each row's
difference of running totals and its edge tokens in float64, in the twin's order, and rounds to
float32. The same bits as the twin's (tests/engine/test_rows_native.py); one call where the twin
makes nine torch operations, each a few microseconds of fixed cost on arrays of a few thousand
values, and :meth:`~rldiag.engine.layout.Rows.sum` runs about twenty times a step.

Used where the library was built and the column is a contiguous float32 host tensor (the offsets
on the host); elsewhere the twin runs.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from rldiag.engine import host, native

#: the calling convention these bindings were written for (``rldiag_rows_abi`` in the C)
ABI = 2

_LIB = native.bound("row_sums", "rows", ABI, 1, {"rldiag_rows_finish": (
    ctypes.c_long, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                    ctypes.c_void_p, ctypes.c_void_p])})


def built() -> bool:
    """Whether the kernel's library was built (and is this version's, and not turned off)."""
    return _LIB is not None


def usable(x: torch.Tensor, offsets: torch.Tensor) -> bool:
    """Whether :func:`row_sums` applies: the library built, ``x`` a flat contiguous float32 host
    tensor outside autograd's graph (the kernel's sums have no derivative: a tensor that requires
    one takes the twin) and ``offsets`` int64 on the host."""
    return (_LIB is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 1
            and x.is_contiguous() and not x.requires_grad and offsets.device.type == "cpu"
            and offsets.dtype == torch.int64)


def row_sums(x: torch.Tensor, offsets: torch.Tensor, piece: int) -> torch.Tensor | None:
    """Each row's sum ``(rows,)`` float32 of ``x`` ``(tokens,)`` over the rows of ``offsets``
    ``(rows + 1,)`` (where :func:`usable`), accumulated as the twin does over chunks of ``piece``
    tokens; None where a row's sum is not finite (the twin's would not be either: the caller sums every
    row in float64 then, keeping it in its row)."""
    assert _LIB is not None
    nc = x.numel() // piece
    chunk = x[: nc * piece].view(nc, piece).sum(-1)  # torch's float32 chunk sums, as the twin's
    v, c = host.view(x), host.view(chunk)
    off = np.ascontiguousarray(offsets.numpy())
    assert v is not None and c is not None and c.flags.c_contiguous
    rows = off.shape[0] - 1
    before = np.empty(nc + 1, dtype=np.float64)
    out = np.empty(max(rows, 0), dtype=np.float32)
    bad = _LIB.rldiag_rows_finish(v.ctypes.data, c.ctypes.data, nc, piece, off.ctypes.data, rows, before.ctypes.data,
                                  out.ctypes.data)
    return None if bad else torch.from_numpy(out)
