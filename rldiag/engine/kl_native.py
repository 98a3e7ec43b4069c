"""The per-row masked sums of the KL estimators k1, k2 and k3 of ``d = a - b`` in one compiled
read (``native/kl_sums.c``), for :func:`rldiag.engine.kl.kl_row_sums` (its torch twin, about a
dozen passes over token-sized float32 tensors). ``d`` and k3's clamped argument are float32 as
torch's; the squares, k3's exponential and every sum are float64, so k1 and k2 differ from the
twin's by its float32 rounding, and k3 by the float32 rounding of ``exp`` the twin carries (about
6e-8 of ``exp(x)`` a token): tests/engine/test_kl_native.py holds them to that.

Used where the library was built, the tensors are on the host, both log-prob streams are float32
and the mask is float32 or bool; elsewhere the twin runs.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from rldiag.engine import host, native

#: the calling convention these bindings were written for (``rldiag_kl_abi`` in the C)
ABI = 1
#: the per-row fields the kernel writes, in its order (k2 before halving)
FIELDS = ("k1", "d2", "k3")


_LIB = native.bound("kl_sums", "kl", ABI, len(FIELDS),
                    {"rldiag_kl_sums": (ctypes.c_long, [ctypes.c_void_p] * 5 + [ctypes.c_long, ctypes.c_void_p])})


def built() -> bool:
    """Whether the kernel's library was built (and is this version's, and not turned off)."""
    return _LIB is not None


def row_sums(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, offsets: torch.Tensor) -> np.ndarray | None:
    """``(rows, 3)`` float64: per row the masked sums of ``d = a - b``, ``d^2`` and k3 (verl's
    ``low_var_kl`` of ``a`` against ``b``), or None where the kernel does not apply. ``a``,
    ``b``, ``mask``: ``(tokens,)``; ``offsets``: ``(rows + 1,)`` the rows' token offsets."""
    if _LIB is None or a.dtype != torch.float32 or b.dtype != torch.float32:
        return None
    if mask.dtype not in (torch.float32, torch.bool) or offsets.device.type != "cpu":
        return None
    x, y, m = host.view(a), host.view(b), host.view(mask)
    n_tokens = int(offsets[-1]) if offsets.numel() else 0
    if x is None or y is None or m is None or not (x.shape == y.shape == m.shape == (n_tokens,)):
        return None
    x, y, m = np.ascontiguousarray(x), np.ascontiguousarray(y), np.ascontiguousarray(m)
    off = np.ascontiguousarray(offsets.numpy(), dtype=np.int64)
    n_rows = max(off.shape[0] - 1, 0)
    out = np.empty((n_rows, len(FIELDS)), dtype=np.float64)
    fmask, bmask = native.mask_pointers(m)
    _LIB.rldiag_kl_sums(x.ctypes.data, y.ctypes.data, fmask, bmask, off.ctypes.data, n_rows, out.ctypes.data)
    return out
