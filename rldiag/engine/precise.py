"""Sums, means and variances accumulated in float64, rounded to float32 once.

verl's own estimators keep verl's float32 reductions (their numbers must be verl's); the
Claw-R1 estimators (:mod:`rldiag.engine.advantage.agentic`) have no verl reference, and are
held to the float64 computation of their formulas. A float32 sum of a step's ~1,000 values,
left to right, is off by a few 1e-6 of the mean; through a whitening ``(x - mean) / (std +
eps)`` that is a shift of every output, and over an exactly tied step (``std = 0``) one ulp of
the mean becomes an O(1) value where the exact answer is 0. Here:

- per-row sums of a token tensor are accumulated in float64 a block of :data:`BLOCK` tokens at a
  time (a float64 copy of at most one block: never of all the tokens); per-segment sums of
  per-row values in float64 ``(rows,)``, one value per row;
- a mean is rounded to float32 as an unevaluated pair ``hi + lo`` (``hi = fl32(mean)``,
  ``lo = fl32(mean - hi)``), and a token's deviation is ``(x - hi) - lo``: accurate to
  float32 of the deviation itself, not of the mean, and exactly 0 where ``x`` is the mean;
- the exact mean of n equal float32 values is that value (their float64 sum is exact), so an
  exactly tied segment whitens to 0 exactly.
"""

from __future__ import annotations

import torch

from rldiag.engine.layout import Rows

#: tokens converted to float64 at a time (8 MiB)
BLOCK = 1 << 20


def row_sums64(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Sum of ``x`` ``(tokens,)`` over each row, accumulated in float64: ``(rows,)`` float64.

    The tokens are taken :data:`BLOCK` at a time: each block's tokens are converted to float64
    and summed per row over the part of each row inside it (``torch.segment_reduce`` over the
    offsets clipped to the block), the partial sums added per row. A row's sum is accurate to
    float64 rounding whatever its length, and n equal float32 values (n below 2^29) sum to
    exactly n times the value.
    """
    out = torch.zeros(rows.n_rows, dtype=torch.float64, device=x.device)
    n = x.numel()
    for start in range(0, n, BLOCK):
        end = min(start + BLOCK, n)
        part = x[start:end].to(torch.float64)
        offsets = rows.offsets.clamp(start, end) - start
        out += torch.segment_reduce(part, "sum", offsets=offsets, initial=0.0)
    return out


def mean_pair(mean64: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 mean as ``(hi, lo)`` in ``dtype``: ``hi`` the mean rounded, ``lo`` what is left."""
    hi = mean64.to(dtype)
    return hi, (mean64 - hi.to(torch.float64)).to(dtype)
