"""Critic metrics: clipped value loss (verl ``core_algos.compute_value_loss``) and explained variance."""

from __future__ import annotations

import torch

from rldiag.engine import kernels
from rldiag.engine.aggregation import AggNorm, aggregate
from rldiag.engine.layout import Rows
from rldiag.engine.segments import (
    MEAN_EPS,
    seg_sum,
    step_mask_count,
    step_masked_mean,
    step_masked_var,
)

EXPLAINED_VAR_EPS = 1e-5


def value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
    agg_mode: str,
    norm: AggNorm,
) -> dict[str, torch.Tensor]:
    """``critic/vf_loss = 0.5 * agg(max((v' - G)^2, (clip(v', v - e, v + e) - G)^2))``.

    ``vpreds``, ``values`` (before the update), ``returns``, ``mask``: ``(tokens,)``.
    Returns metrics ``(norm.n_seg,)``, one per segment: vf_loss, vf_clipfrac, vpred_mean.
    """
    if cliprange_value >= 0:  # clamp(x, lo, hi) is max(min(x, hi), lo) whenever lo <= hi
        clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    else:
        clipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    l1 = torch.sub(vpreds, returns).square_()
    l2 = clipped.sub_(returns).square_()
    loss = 0.5 * aggregate(agg_mode, torch.max(l1, l2), mask, norm)
    rows = norm.rows
    count = step_mask_count(mask, rows, norm.seg_ids, norm.n_seg) + MEAN_EPS
    clipped_more = kernels.count_greater_masked(l2, l1, mask, rows)  # verl: masked_mean(l2 > l1)
    return {
        "critic/vf_loss": loss,
        "critic/vf_clipfrac": seg_sum(clipped_more, norm.seg_ids, norm.n_seg) / count,
        "critic/vpred_mean": step_masked_mean(vpreds, mask, rows, norm.seg_ids, norm.n_seg),
    }


def explained_variance(
    returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, rows: Rows, step_ids: torch.Tensor, n_steps: int
) -> torch.Tensor:
    """``1 - Var(G - V) / (Var(G) + 1e-5)`` over each step's masked tokens, unbiased variances
    (``torch.var``), as verl's ``critic/vf_explained_var``. ``(n_steps,)``"""
    return 1.0 - step_masked_var(returns - values, mask, rows, step_ids, n_steps) / (
        step_masked_var(returns, mask, rows, step_ids, n_steps) + EXPLAINED_VAR_EPS
    )
