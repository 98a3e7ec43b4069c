"""A few token-sized comparisons and index scans, done by numpy where the tensor is on the host.

On the CPU, torch (2.x) writes a comparison into a bool tensor, scans one for its true positions
(``torch.nonzero``) or counts equal values several times slower than numpy does over the same
memory (measured on 262,144 float32 tokens, one thread: ``x > t`` 0.15 ms against 0.02 ms,
``count_nonzero(x == t)`` 0.25 against 0.03, ``nonzero`` of a sparse bool tensor 0.25 against
0.04; an int32 running sum of 524,288 values 0.31 against 0.22). Each function here reads a
CPU tensor as a numpy view (no copy) and gives back a torch tensor sharing numpy's result; on
any other device, or for a dtype numpy lacks (bfloat16), the plain torch form. Comparisons,
index scans and integer sums are exact, so the results are the same on either path
(tests/engine/test_host.py).

Token tensors are flat ``(tokens,)``.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "all_finite", "count_above", "count_below", "count_equal", "count_true", "greater_on", "indicator_on", "indices_above",
    "min_where", "nonzero_indices", "positive", "positive_float", "running_count", "running_sum_on", "values", "view",
]


def view(x: torch.Tensor) -> np.ndarray | None:
    """``x`` as a numpy array sharing its memory, or None (not on the host, or a dtype numpy
    lacks)."""
    if x.device.type != "cpu" or x.dtype in (torch.bfloat16, torch.complex32) or x.is_conj() or x.is_neg():
        return None
    return x.detach().numpy()


def values(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a numpy array: a view of a CPU tensor, a copy of another device's;
    16-bit brain floats (no numpy type) widened to float32, exactly."""
    if t.dtype == torch.bfloat16:
        t = t.to(torch.float32)
    return t.detach().cpu().numpy()


def all_finite(x: torch.Tensor) -> bool:
    """Whether every value of ``x`` is finite (``bool(torch.isfinite(x).all())``; an integer or
    bool tensor is)."""
    v = view(x)
    return bool(torch.isfinite(x).all()) if v is None else bool(np.isfinite(v).all())


def positive(x: torch.Tensor) -> torch.Tensor:
    """``(tokens,)`` bool: ``x > 0``."""
    v = view(x)
    return x > 0 if v is None else torch.from_numpy(v > 0)


def positive_float(x: torch.Tensor) -> torch.Tensor:
    """``(tokens,)`` float32: 1 where ``x > 0``, else 0 (NaN included)."""
    v = view(x)
    return (x > 0).to(torch.float32) if v is None else torch.from_numpy((v > 0).astype(np.float32))


def indicator_on(indicator: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(tokens,)`` float32: the indicator (bool, or numbers) as float32, times 1 where
    ``mask > 0`` and 0 elsewhere (``indicator.to(float32) * (mask > 0).to(float32)``)."""
    v, m = view(indicator), view(mask)
    if v is None or m is None:
        return indicator.to(torch.float32) * (mask > 0).to(torch.float32)
    out = v.astype(np.float32)
    np.multiply(out, m > 0, out=out)
    return torch.from_numpy(out)


def greater_on(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(tokens,)`` float32: 1 where ``a > b`` and ``mask > 0``, else 0 (a NaN is never
    greater): :func:`indicator_on` of ``a > b``. ``b`` may be a 0-dim tensor of ``a``'s dtype."""
    va, vb, m = view(a), view(b), view(mask)
    if va is None or vb is None or m is None:
        return (a > b).to(torch.float32) * (mask > 0).to(torch.float32)
    out = np.greater(va, vb[()] if vb.ndim == 0 else vb).astype(np.float32)
    np.multiply(out, m > 0, out=out)
    return torch.from_numpy(out)


def nonzero_indices(cond: torch.Tensor) -> torch.Tensor:
    """``(k,)`` int64: the positions where the 1-d ``cond`` (bool, or nonzero numbers) holds, in
    order (``torch.nonzero(cond).flatten()``)."""
    v = view(cond)
    if v is None:
        return torch.nonzero(cond).flatten()
    return torch.from_numpy(np.flatnonzero(v).astype(np.int64, copy=False))


def count_true(cond: torch.Tensor) -> int:
    """How many entries of ``cond`` are true (nonzero)."""
    v = view(cond)
    return int(torch.count_nonzero(cond)) if v is None else int(np.count_nonzero(v))


def indices_above(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``(k,)`` int64: the positions of the 1-d ``x`` whose value is above the scalar ``t`` (a
    0-dim tensor of ``x``'s dtype), in order; a NaN is never above."""
    v = view(x)
    if v is None:
        return torch.nonzero(x > t).flatten()
    return torch.from_numpy(np.flatnonzero(v > _scalar(t, v)).astype(np.int64, copy=False))


def count_equal(x: torch.Tensor, t: torch.Tensor) -> int:
    """How many values of ``x`` equal the scalar ``t`` (a 0-dim tensor of ``x``'s dtype)."""
    v = view(x)
    return int(torch.count_nonzero(x == t)) if v is None else int(np.count_nonzero(v == _scalar(t, v)))


def count_above(x: torch.Tensor, t: torch.Tensor) -> int:
    """How many values of ``x`` are above the scalar ``t`` (a 0-dim tensor of ``x``'s dtype)."""
    v = view(x)
    return int(torch.count_nonzero(x > t)) if v is None else int(np.count_nonzero(v > _scalar(t, v)))


def count_below(x: torch.Tensor, t: torch.Tensor) -> int:
    """How many values of ``x`` are below the scalar ``t`` (a 0-dim tensor of ``x``'s dtype)."""
    v = view(x)
    return int(torch.count_nonzero(x < t)) if v is None else int(np.count_nonzero(v < _scalar(t, v)))


def min_where(x: torch.Tensor, cond: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """0-dim: the least of ``x`` where ``cond > 0`` and ``fill`` (a 0-dim tensor of ``x``'s dtype)
    elsewhere, ``torch.where(cond > 0, x, fill).amin()`` (a NaN wins, as there); ``x`` non-empty."""
    v, c = view(x), view(cond)
    if v is None or c is None:
        return torch.where(cond > 0, x, fill).amin()
    return torch.from_numpy(np.asarray(np.where(c > 0, v, _scalar(fill, v)).min(), dtype=v.dtype))


def running_count(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(tokens,)`` of the integer ``dtype`` (int32 or int64): how many entries of ``mask`` up to
    and including each are above 0, ``torch.cumsum(mask > 0, 0, dtype=dtype)``."""
    v = view(mask)
    if v is None:
        return torch.cumsum(mask > 0, 0, dtype=dtype)
    return torch.from_numpy(np.cumsum(v > 0, dtype=np.int32 if dtype == torch.int32 else np.int64))


def running_sum_on(count: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """``(tokens,)`` int32: the running sum of the int32 ``count`` (written over it on the
    host), times the bool ``on`` (0 where it is false): ``torch.cumsum(count, 0) * on``."""
    v, o = view(count), view(on)
    if v is None or o is None:
        return torch.cumsum(count, 0, dtype=torch.int32).mul_(on)
    np.cumsum(v, out=v)
    np.multiply(v, o, out=v)
    return count


def _scalar(t: torch.Tensor, like: np.ndarray) -> np.generic:
    """The 0-dim tensor ``t`` as a numpy scalar of ``like``'s dtype (the comparison torch makes)."""
    return like.dtype.type(t.item())
