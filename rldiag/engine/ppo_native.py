"""verl's PPO clipped surrogate with dual clip per token in one compiled read
(``native/ppo_clip.c``), for :func:`rldiag.engine.policy_loss.clip.ppo_clip` (its torch twin,
:func:`~rldiag.engine.policy_loss.clip.ppo_terms` and the clip indicators: about fourteen passes
over token-sized tensors): the losses (times the IS weights where given), the clip indicator on
the mask and each row's count of tokens where the dual clip binds, from the advantages and the
ratios torch computed. Every value is the twin's float32 operation in its order, so the same bits
(tests/engine/test_ppo_native.py holds them with ``torch.equal``).

Used where the library was built, the tensors are on the host and float32 (the mask float32 or
bool); elsewhere the twin runs.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from rldiag.engine import host, native

#: the calling convention these bindings were written for (``rldiag_ppo_abi`` in the C)
ABI = 1


_LIB = native.bound("ppo_clip", "ppo", ABI, 1, {"rldiag_ppo_clip": (
    ctypes.c_long, [ctypes.c_void_p] * 6 + [ctypes.c_long] + [ctypes.c_float] * 3 + [ctypes.c_void_p] * 3)})


def built() -> bool:
    """Whether the kernel's library was built (and is this version's, and not turned off)."""
    return _LIB is not None


def ppo_tokens(adv: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None,
               offsets: torch.Tensor, lo: float, hi: float, c: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(losses, clipped, lower)``: the losses and the clip indicator ``(tokens,)`` float32 and
    each row's dual-clip count ``(rows,)`` float32, or None where the kernel does not apply.
    ``adv``, ``ratio``, ``mask``, ``weights``: ``(tokens,)``; ``offsets``: ``(rows + 1,)``; ``lo``,
    ``hi``: the clip bounds ``1 - clip_low``, ``1 + clip_high``; ``c`` the dual clip's."""
    if _LIB is None or adv.dtype != torch.float32 or ratio.dtype != torch.float32:
        return None
    if mask.dtype not in (torch.float32, torch.bool) or offsets.device.type != "cpu":
        return None
    if weights is not None and weights.dtype != torch.float32:
        return None
    tensors = [adv, ratio, mask] + ([] if weights is None else [weights])
    n = int(offsets[-1]) if offsets.numel() else 0
    views = [host.view(t) for t in tensors]
    if any(v is None or v.shape != (n,) for v in views):
        return None
    a, r, m = (np.ascontiguousarray(v) for v in views[:3])
    w = None if weights is None else np.ascontiguousarray(views[3])
    off = np.ascontiguousarray(offsets.numpy(), dtype=np.int64)
    n_rows = max(off.shape[0] - 1, 0)
    losses, clipped = np.empty(n, dtype=np.float32), np.empty(n, dtype=np.float32)
    lower = np.empty(n_rows, dtype=np.float64)
    fmask, bmask = native.mask_pointers(m)
    _LIB.rldiag_ppo_clip(a.ctypes.data, r.ctypes.data, fmask, bmask, None if w is None else w.ctypes.data,
                         off.ctypes.data, n_rows, lo, hi, c, losses.ctypes.data, clipped.ctypes.data, lower.ctypes.data)
    return torch.from_numpy(losses), torch.from_numpy(clipped), torch.from_numpy(lower.astype(np.float32))
