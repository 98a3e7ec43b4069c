"""A token's gradient weight: how much of the actor's update a token carries (docs/algorithms-losses.md,
"Gradient weight"). The one definition; the filters' ``rldiag/filter/dropped_weight_share`` uses it,
and so may any rule on the update's health.

``g_t = |A_t| * w_t * (1 - c_t)``:

- ``A_t`` the token's advantage;
- ``w_t`` its aggregation weight, the token's weight in its segment's ``pg_loss``
  (:attr:`PolicyLossOutput.weights <rldiag.engine.policy_loss.PolicyLossOutput>`: the loss's
  ``loss_agg_mode``, or the one it forces, with the global normalisers; 0 off the mask);
- ``c_t`` the loss's own clip indicator (:attr:`PolicyLossOutput.clipped`): 1 where the token
  counts toward ``actor/pg_clipfrac`` (PPO: the clip is active, the gradient through the ratio is
  cut; clip_cov: the probability the token is cut), 0 elsewhere; none for a loss without a clip
  fraction (gpg, dro, kl_cov) or without a policy loss at all.

The rollout IS weights are not part of it.
"""

from __future__ import annotations

import torch

__all__ = ["gradient_weight", "unclipped_part"]


def gradient_weight(adv: torch.Tensor, weights: torch.Tensor, clipped: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's gradient weight ``|A_t| * w_t * (1 - c_t)`` ``(tokens,)`` float32: ``adv`` the
    advantages, ``weights`` the aggregation weights and ``clipped`` the clip indicator of a
    :class:`~rldiag.engine.policy_loss.PolicyLossOutput` (None: nothing clipped)."""
    return unclipped_part(adv.abs().to(torch.float32) * weights.to(torch.float32), clipped)


def unclipped_part(g: torch.Tensor, clipped: torch.Tensor | None) -> torch.Tensor:
    """``g * (1 - c_t)`` ``(tokens,)`` float32: the gradient weight of ``clipped`` from the one
    without a clip (``gradient_weight(adv, weights)``), the same values as computing it anew."""
    return g if clipped is None else g * (1.0 - clipped.to(torch.float32))
