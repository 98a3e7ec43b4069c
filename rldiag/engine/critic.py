"""Critic metrics: clipped value loss (seed 001 section 8) and explained variance."""

from __future__ import annotations

import torch

from rldiag.engine.aggregation import AggNorm, aggregate
from rldiag.engine.segments import step_masked_mean, step_masked_var

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

    ``vpreds``, ``values`` (before the update), ``returns``, ``mask``: ``(rows, tokens)``.
    Returns metrics ``(n_steps,)``: vf_loss, vf_clipfrac, vpred_mean.
    """
    clipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    l1 = (vpreds - returns) ** 2
    l2 = (clipped - returns) ** 2
    loss = 0.5 * aggregate(agg_mode, torch.max(l1, l2), mask, norm)
    return {
        "critic/vf_loss": loss,
        "critic/vf_clipfrac": step_masked_mean(torch.gt(l2, l1).float(), mask, norm.step_ids, norm.n_steps),
        "critic/vpred_mean": step_masked_mean(vpreds, mask, norm.step_ids, norm.n_steps),
    }


def explained_variance(
    returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, step_ids: torch.Tensor, n_steps: int
) -> torch.Tensor:
    """``1 - Var(G - V) / (Var(G) + 1e-5)`` over each step's masked tokens, unbiased variances
    (``torch.var``), as verl's ``critic/vf_explained_var``. ``(n_steps,)``"""
    return 1.0 - step_masked_var(returns - values, mask, step_ids, n_steps) / (
        step_masked_var(returns, mask, step_ids, n_steps) + EXPLAINED_VAR_EPS
    )
