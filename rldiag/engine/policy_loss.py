"""Policy losses, keyed by verl's ``actor_rollout_ref.actor.policy_loss.loss_mode`` strings.

One signature: ``fn(inp: PolicyLossInput) -> PolicyLossOutput``. Token losses are
``(rows, tokens)``; the aggregated loss and every metric are ``(n_steps,)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rldiag.config.settings import Settings
from rldiag.engine.aggregation import AggNorm, aggregate
from rldiag.engine.segments import step_masked_mean
from rldiag.errors import ConfigError
from rldiag.registry import Registry

LOG_RATIO_CLAMP = 20.0


@dataclass
class PolicyLossInput:
    old_log_prob: torch.Tensor  # (rows, tokens)
    log_prob: torch.Tensor  # (rows, tokens)
    advantages: torch.Tensor  # (rows, tokens)
    mask: torch.Tensor  # (rows, tokens) post-correction response_mask
    agg_mode: str
    norm: AggNorm
    settings: Settings
    rollout_is_weights: torch.Tensor | None = None  # (rows, tokens)


@dataclass
class PolicyLossOutput:
    pg_loss: torch.Tensor  # (n_steps,)
    pg_losses: torch.Tensor  # (rows, tokens), IS weights applied
    ratio: torch.Tensor  # (rows, tokens)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (n_steps,)


PolicyLossFn = Callable[[PolicyLossInput], PolicyLossOutput]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss mode")


def clamped_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """``clamp(log_prob - old_log_prob, -20, 20)``: verl's guard before ``exp``."""
    return torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)


@POLICY_LOSSES.register("vanilla", source="seed 001 s4, seed 003 s6; arXiv:1707.06347; dual clip arXiv:1912.09729")
def vanilla(inp: PolicyLossInput) -> PolicyLossOutput:
    """PPO clipped surrogate with asymmetric clip (clip_ratio_low/high) and dual clip (clip_ratio_c).

    Metrics: ``actor/pg_clipfrac`` (share of tokens where the clipped branch is larger),
    ``actor/ppo_kl`` (masked mean of ``old - new`` log-prob, clamped), ``actor/pg_clipfrac_lower``
    (share of negative-advantage tokens capped by the dual clip).
    """
    s, norm = inp.settings, inp.norm
    clip_c = float(s["actor_rollout_ref.actor.clip_ratio_c"])
    if not clip_c > 1.0:
        raise ConfigError(f"actor_rollout_ref.actor.clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_c}")
    adv = inp.advantages
    log_ratio = clamped_log_ratio(inp.log_prob, inp.old_log_prob)
    ratio = torch.exp(log_ratio)
    ppo_kl = step_masked_mean(-log_ratio, inp.mask, norm.step_ids, norm.n_steps)

    losses1 = -adv * ratio
    losses2 = -adv * torch.clamp(ratio, 1 - s.clip_low, 1 + s.clip_high)  # arXiv:1707.06347 eq. 7
    clipped1 = torch.maximum(losses1, losses2)
    clipfrac = step_masked_mean(torch.gt(losses2, losses1).float(), inp.mask, norm.step_ids, norm.n_steps)

    losses3 = -adv * clip_c  # dual clip, arXiv:1912.09729
    clipped2 = torch.minimum(losses3, clipped1)
    negative = (adv < 0).float()
    clipfrac_lower = step_masked_mean(
        torch.gt(clipped1, losses3).float() * negative, inp.mask, norm.step_ids, norm.n_steps
    )
    pg_losses = torch.where(adv < 0, clipped2, clipped1)
    if inp.rollout_is_weights is not None:
        pg_losses = pg_losses * inp.rollout_is_weights
    pg_loss = aggregate(inp.agg_mode, pg_losses, inp.mask, norm)
    return PolicyLossOutput(
        pg_loss=pg_loss,
        pg_losses=pg_losses,
        ratio=ratio,
        metrics={
            "actor/pg_clipfrac": clipfrac,
            "actor/ppo_kl": ppo_kl,
            "actor/pg_clipfrac_lower": clipfrac_lower,
        },
    )


def policy_loss(name: str, inp: PolicyLossInput) -> PolicyLossOutput:
    return POLICY_LOSSES.get(name)(inp)
