"""What the rollout-correction modules share: verl's clamp bound, the metrics type, and the
per-row / per-segment statistics both the IS weights and the rejection options report."""

from __future__ import annotations

import torch

from rldiag.engine.layout import Rows
from rldiag.engine.segments import MEAN_EPS, seg_std, step_mask_count, step_masked_mean

#: verl's SAFETY_BOUND: log-ratios are clamped to +-20 before exp.
SAFETY_BOUND = 20.0

Metrics = dict[str, torch.Tensor]


def row_mean(values: torch.Tensor, mask: torch.Tensor, rows: Rows) -> torch.Tensor:
    """verl's ``masked_mean(values, mask, axis=-1)``: ``(rows,)``, 0 for a row without tokens."""
    return rows.masked_sum(values, mask) / (rows.sum(mask) + MEAN_EPS)


def seq_std0(x: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    """Bessel std per segment, 0 where the segment has a single value (verl's guard)."""
    _, std, cnt = seg_std(x, seg, n)
    return torch.where(cnt > 1, std, torch.zeros_like(std))


def clamped_std(values: torch.Tensor, mask: torch.Tensor, rows: Rows, seg: torch.Tensor, n: int, lo: float,
                 hi: float) -> torch.Tensor:
    """``sqrt(max(E[c^2] - E[c]^2, 0))`` of ``c = clamp(values, lo, hi)`` over masked tokens; 0
    where a segment has at most one token. Computed two-pass, ``E[(c - E[c])^2]``: verl's one-pass
    float32 form agrees to float32 precision except when the spread is below ~3e-4 of the values'
    size, where verl's result is rounding noise (and the 1e-8 of its masked means adds up to
    ``sqrt(1e-8 / n)`` of the size); the two-pass value is the spread itself."""
    c = torch.clamp(values, min=lo, max=hi)
    mean = step_masked_mean(c, mask, rows, seg, n)
    var = step_masked_mean((c - rows.expand(mean[seg])).square(), mask, rows, seg, n)
    std = torch.sqrt(torch.clamp(var, min=0.0))
    return torch.where(step_mask_count(mask, rows, seg, n) > 1, std, torch.zeros_like(std))
