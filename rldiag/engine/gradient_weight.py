"""A token's gradient weight: how much of the actor's update a token carries (docs/algorithms-losses.md,
"Gradient weight"). The one definition; the filters' ``rldiag/filter/dropped_weight_share`` and any
health rule use it.

``g_t = |A_t| * w_t * u_t``:

- ``A_t`` the token's advantage;
- ``w_t`` its aggregation weight: the derivative of the aggregated loss (``loss_agg_mode`` with the
  segment's global normalisers, :func:`rldiag.engine.aggregation.aggregate`) with respect to the
  token's loss, 0 off the mask (:func:`aggregation_weights`);
- ``u_t`` 1 where PPO's clip is not active on the token, so that the loss's gradient through the
  ratio is not cut, else 0 (:func:`ppo_not_clipped`). rldiag's policy losses report no per-token
  clip indicator, so it is PPO's (``vanilla``) for every ``loss_mode``: with ``r`` the importance
  ratio, clipped where ``A > 0`` and ``r > 1 + clip_ratio_high``, where ``A < 0`` and
  ``r < 1 - clip_ratio_low``, and where ``A < 0`` and ``r > clip_ratio_c`` (the dual clip). Without
  a ratio (no log-probs) no token is clipped.

The rollout IS weights are not part of it.
"""

from __future__ import annotations

import torch

from rldiag.engine.aggregation import AggNorm, aggregate

__all__ = ["aggregation_weights", "gradient_weight", "ppo_not_clipped"]


def aggregation_weights(mode: str, mask: torch.Tensor, norm: AggNorm) -> torch.Tensor:
    """``w_t`` ``(tokens,)`` float32: the derivative of ``aggregate(mode, loss, mask, norm)``
    (summed over segments; each token is in one) with respect to each token's loss. Every
    aggregation mode is linear in the token losses, so this is exact and the same for any loss;
    it is 0 off the mask."""
    loss = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device, requires_grad=True)
    with torch.enable_grad():
        total = aggregate(mode, loss, mask, norm).sum()
        (grad,) = torch.autograd.grad(total, loss, allow_unused=True)
    return torch.zeros_like(loss, requires_grad=False) if grad is None else grad.detach()


def ppo_not_clipped(adv: torch.Tensor, ratio: torch.Tensor | None, clip_low: float, clip_high: float,
                    clip_c: float) -> torch.Tensor:
    """``u_t`` ``(tokens,)`` float32: 1 where PPO's clip (dual clip included) leaves the gradient
    through the ratio, 0 where it cuts it (see the module's docstring); all 1 without a ratio."""
    if ratio is None:
        return torch.ones_like(adv, dtype=torch.float32)
    clipped = ((adv > 0) & (ratio > 1 + clip_high)) | ((adv < 0) & ((ratio < 1 - clip_low) | (ratio > clip_c)))
    return (~clipped).to(torch.float32)


def gradient_weight(adv: torch.Tensor, mask: torch.Tensor, norm: AggNorm, mode: str, ratio: torch.Tensor | None,
                    clip_low: float, clip_high: float, clip_c: float) -> torch.Tensor:
    """Each token's gradient weight ``|A_t| * w_t * u_t`` ``(tokens,)`` float32 (0 off the mask)."""
    w = aggregation_weights(mode, mask, norm)
    return adv.abs().to(torch.float32) * w * ppo_not_clipped(adv, ratio, clip_low, clip_high, clip_c)
