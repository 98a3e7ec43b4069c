"""The gradient weight of a step's tokens in one compiled read (``native/grad_weight.c``), for
:func:`rldiag.engine.health.gradient_weight_shares` (its torch twin: about fifteen passes over
token-sized tensors a piece): the ranking of the unclipped weight on the actor tokens (-1
elsewhere) that the top share selects from, and the step's actor tokens, unclipped weight and
clipped share's numerator and denominator. The float32 values are torch's to the bit; the sums
are float64 in another order than the twin's (the tests hold the shares to float64's rounding).

Used where the library was built and the tensors are on the host, the advantages and weights
float32, the mask and the clip indicator float32 or bool; elsewhere the twin runs.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np
import torch

from rldiag.engine import host, native

#: the calling convention these bindings were written for (``rldiag_gw_abi`` in the C)
ABI = 1
#: the per-step fields the kernel writes, in its order
FIELDS = ("count", "total", "num", "den")


_LIB = native.bound("grad_weight", "gw", ABI, len(FIELDS),
                    {"rldiag_grad_weight": (ctypes.c_long, [ctypes.c_void_p] * 6 + [ctypes.c_long] + [ctypes.c_void_p] * 2)})


def built() -> bool:
    """Whether the kernel's library was built (and is this version's, and not turned off)."""
    return _LIB is not None


class StepWeights(NamedTuple):
    """One step's pass: ``ranked`` ``(tokens,)`` float32, its actor tokens and its float64 sums."""

    ranked: torch.Tensor
    actor: int
    total: float
    num: float
    den: float


def usable(adv: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, clipped: torch.Tensor | None) -> bool:
    """Whether :func:`step_pass` applies to these tensors (the library built, all on the host,
    flat, one length, the dtypes the kernel reads)."""
    if _LIB is None or adv.dtype != torch.float32 or weights.dtype != torch.float32:
        return False
    tensors = [adv, weights, mask] + ([] if clipped is None else [clipped])
    if any(t.device.type != "cpu" or t.dim() != 1 or t.shape != adv.shape for t in tensors):
        return False
    return all(t.dtype in (torch.float32, torch.bool) for t in tensors[2:])


def step_pass(adv: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, clipped: torch.Tensor | None) -> StepWeights:
    """One step's tokens ``(tokens,)`` (where :func:`usable`): the ranking and the sums."""
    assert _LIB is not None
    arrays = [np.ascontiguousarray(host.view(t)) for t in (adv, weights, mask)]
    clip = None if clipped is None else np.ascontiguousarray(host.view(clipped))
    m, c = native.mask_pointers(arrays[2]), native.mask_pointers(clip)
    n = arrays[0].shape[0]
    ranked = np.empty(n, dtype=np.float32)
    out = np.zeros(len(FIELDS), dtype=np.float64)
    _LIB.rldiag_grad_weight(arrays[0].ctypes.data, arrays[1].ctypes.data, m[0], m[1], c[0], c[1], n,
                            ranked.ctypes.data, out.ctypes.data)
    return StepWeights(torch.from_numpy(ranked), int(out[0]), float(out[1]), float(out[2]), float(out[3]))
