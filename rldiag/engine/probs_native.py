"""verl's comparison of the trainer's and the rollout engine's token probabilities in one compiled
read (``native/rollout_probs.c``): per step, the summed weight and the weighted means and centred
sums of squares of ``|p_old - p_rollout|``, ``p_old`` and ``p_rollout``, their centred sum of
products and the largest gap; :func:`rldiag.engine.metrics.rollout_probs_metrics` turns them into
verl's metrics. Its twin there is torch's (about 25 passes over token-sized float32 tensors): the
same float32 probabilities and gaps up to the last bit of a float32 exponential (the kernel's
eight-lane exponential, ``vexp8f`` in ``native/lanes.h``, is within one unit in the last place,
as torch's own, and differs from torch's in that unit on about 10 % of tokens), every sum in
float64 (torch's: float32 per row), so that a metric differs from the twin's by about float32's
rounding (the tests hold them to 1e-5).

Used where the library was built, the batch is on the host, both log-prob streams are float32 and
the mask is float32 or bool; elsewhere the twin runs.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from rldiag.engine import host, native
from rldiag.engine.layout import Rows

#: the calling convention these bindings were written for (``rldiag_probs_abi`` in the C)
ABI = 1
#: the per-step fields the kernel writes, in its order
FIELDS = ("n", "diff_mean", "diff_m2", "diff_max", "old_mean", "roll_mean", "old_m2", "roll_m2", "cross")


_LIB = native.bound("rollout_probs", "probs", ABI, len(FIELDS),
                    {"rldiag_rollout_probs": (ctypes.c_long, [ctypes.c_void_p] * 6 + [ctypes.c_long] * 2 + [ctypes.c_void_p])})


def built() -> bool:
    """Whether the kernel's library was built (and is this version's, and not turned off)."""
    return _LIB is not None


def step_fields(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, rows: Rows, step_ids: torch.Tensor,
                n_steps: int) -> dict[str, np.ndarray] | None:
    """Per step (:data:`FIELDS` -> ``(n_steps,)`` float64), or None where the kernel does not apply.
    ``old``, ``rollout``, ``mask``: ``(tokens,)``; ``step_ids``: ``(rows,)``."""
    if _LIB is None or old.dtype != torch.float32 or rollout.dtype != torch.float32:
        return None
    if mask.dtype not in (torch.float32, torch.bool) or rows.offsets.device.type != "cpu":
        return None
    x, y, m = host.view(old), host.view(rollout), host.view(mask)
    if x is None or y is None or m is None or not (x.shape == y.shape == m.shape == (rows.n_tokens,)):
        return None
    x, y, m = np.ascontiguousarray(x), np.ascontiguousarray(y), np.ascontiguousarray(m)
    offsets = np.ascontiguousarray(rows.offsets.numpy(), dtype=np.int64)
    steps = np.ascontiguousarray(step_ids.detach().cpu().numpy(), dtype=np.int64)
    out = np.empty((max(n_steps, 1), len(FIELDS)), dtype=np.float64)
    fmask, bmask = native.mask_pointers(m)
    if _LIB.rldiag_rollout_probs(x.ctypes.data, y.ctypes.data, fmask, bmask, offsets.ctypes.data, steps.ctypes.data,
                                 rows.n_rows, n_steps, out.ctypes.data) != 0:
        raise ValueError(f"rollout probabilities: a row's step outside [0, {n_steps})")
    return {k: out[:n_steps, i] for i, k in enumerate(FIELDS)}
