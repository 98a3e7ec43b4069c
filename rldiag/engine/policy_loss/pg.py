"""Ratio-free policy gradients: ``gpg``, ``dro``, and the REINFORCE form of ``bypass_mode``."""

from __future__ import annotations

import torch

from rldiag.engine.policy_loss.base import (
    POLICY,
    POLICY_LOSSES,
    PolicyLossInput,
    PolicyLossOutput,
    agg,
    agg_weights,
    clamped_log_ratio,
    positive_setting,
    seg_masked_mean,
    weighted,
)


@POLICY_LOSSES.register("gpg", source="verl core_algos.compute_policy_loss_gpg; GPG arXiv:2504.02546")
def gpg(inp: PolicyLossInput) -> PolicyLossOutput:
    """``-A log pi`` aggregated by ``loss_agg_mode``. verl reports no metric for it (only
    ``actor/pg_loss``). ``ratio`` is the PPO ratio ``exp(clamp(log pi - log pi_old, +-20))``, a
    diagnostic the loss does not use."""
    losses = weighted(-inp.log_prob * inp.advantages, inp)
    return PolicyLossOutput(
        pg_loss=agg(losses, inp),
        pg_losses=losses,
        ratio=torch.exp(clamped_log_ratio(inp.log_prob, inp.old_log_prob)),
        weights=agg_weights(inp),
    )


def dro_beta(settings) -> float:
    """``policy_loss.dro_beta``, which verl asserts is above 0."""
    return positive_setting(settings, f"{POLICY}.dro_beta", "loss_mode=dro")


@POLICY_LOSSES.register("dro", check=dro_beta, source="verl docs/algo/dro.md (PR 7245); quadratic proximal penalty")
def dro(inp: PolicyLossInput) -> PolicyLossOutput:
    """``-(A log pi - beta/2 (log pi - log pi_old)^2)`` with ``beta`` =
    ``policy_loss.dro_beta`` (must be > 0; verl raises otherwise), unclamped log-ratio, aggregated
    by ``loss_agg_mode``. ``actor/ppo_kl`` = masked mean of ``-(log pi - log pi_old)``, as verl's
    ``compute_policy_loss_dro`` reports it."""
    beta = dro_beta(inp.settings)
    log_ratio = inp.log_prob - inp.old_log_prob
    losses = weighted(-(inp.log_prob * inp.advantages - 0.5 * beta * log_ratio.square()), inp)
    return PolicyLossOutput(
        pg_loss=agg(losses, inp),
        pg_losses=losses,
        ratio=torch.exp(clamped_log_ratio(inp.log_prob, inp.old_log_prob)),
        metrics={"actor/ppo_kl": seg_masked_mean(-log_ratio, inp)},
        weights=agg_weights(inp),
    )


def reinforce(
    inp: PolicyLossInput, rollout_log_prob: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None
) -> PolicyLossOutput:
    """verl's ``compute_policy_loss_reinforce``: ``-A log pi`` (times the IS weight
    ``pi/pi_rollout`` when given) on ``mask``, aggregated by the actor's ``loss_agg_mode``.
    ``actor/ppo_kl`` = masked mean of ``log pi_rollout - log pi`` (unclamped)."""
    losses = -inp.advantages * inp.log_prob
    if weights is not None:
        losses = losses * weights
    return PolicyLossOutput(
        pg_loss=agg(losses, inp, mask=mask),
        pg_losses=losses,
        ratio=torch.exp(clamped_log_ratio(inp.log_prob, rollout_log_prob)),
        metrics={"actor/ppo_kl": seg_masked_mean(rollout_log_prob - inp.log_prob, inp, mask)},
        weights=agg_weights(inp, mask=mask),
    )
