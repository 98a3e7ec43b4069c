"""The toy trainer's own RL maths, written from verl's semantics (verl.trainer.ppo.core_algos,
verl.utils.torch_functional, verl.workers.utils.losses), deliberately independent of
``rldiag.engine``: ``rldiag verify`` / a baseline recompute on the toy's runs is then a real
cross-check of two implementations.

All tensors are ``(B, R)`` right-padded response tensors unless stated; masks are 0/1 floats.
"""

from __future__ import annotations

from collections import defaultdict

import torch

MASK_EPS = 1e-8  # verl's masked_mean denominator epsilon
WHITEN_EPS = 1e-8  # inside rsqrt in masked_whiten
GRPO_EPS = 1e-6
LOG_RATIO_CLAMP = 20.0


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum over ``mask``; values outside it (even NaN) are ignored."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values)) * mask
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``masked_sum / (mask.sum() + 1e-8)``."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / (count + MASK_EPS)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(v - mean) * rsqrt(var + 1e-8)`` with the Bessel-corrected masked variance.

    Raises ``ValueError`` when the mask holds fewer than two tokens (as verl's masked_var).
    """
    mean = masked_mean(values, mask)
    centered = values - mean
    var = masked_mean(centered**2, mask)
    n = mask.sum()
    if n == 0:
        raise ValueError("At least one element in the mask has to be 1.")
    if n == 1:
        raise ValueError("The sum of the mask is one, which can cause a division by zero.")
    var = var * (n / (n - 1))
    return centered * torch.rsqrt(var + WHITEN_EPS)


@torch.no_grad()
def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016) with verl's mask skipping: at a mask-0 token (a tool
    observation, padding) neither the bootstrap value nor the running advantage changes.
    Returns ``(whitened advantages, returns = raw advantages + values)``."""
    next_value = torch.zeros_like(values[:, 0])
    last = torch.zeros_like(values[:, 0])
    out = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * last
        m = mask[:, t]
        next_value = values[:, t] * m + (1 - m) * next_value
        last = candidate * m + (1 - m) * last
        out.append(last)
    raw = torch.stack(out[::-1], dim=1)
    returns = raw + values
    return masked_whiten(raw, mask), returns


@torch.no_grad()
def grpo_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, uids: list[str], norm_by_std: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outcome GRPO: each row's score (sum of its token rewards) minus its uid group's mean,
    over the group's sample std + 1e-6; a group of one has mean 0 and std 1. The row's value
    is broadcast over its mask; returns equal advantages."""
    scores = rewards.sum(-1)
    groups: dict[str, list[torch.Tensor]] = defaultdict(list)
    for uid, s in zip(uids, scores):
        groups[uid].append(s)
    stats = {}
    for uid, members in groups.items():
        if len(members) == 1:
            stats[uid] = (torch.tensor(0.0), torch.tensor(1.0))
        else:
            stacked = torch.stack(members)
            stats[uid] = (stacked.mean(), stacked.std())
    out = scores.clone()
    for i, uid in enumerate(uids):
        mean, std = stats[uid]
        out[i] = (scores[i] - mean) / (std + GRPO_EPS) if norm_by_std else scores[i] - mean
    adv = out.unsqueeze(-1) * mask
    return adv, adv


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of the policy against the reference: ``kl``/``k1``, ``abs``,
    ``mse``/``k2``, ``low_var_kl``/``k3`` (clamped as verl does)."""
    if kind in ("kl", "k1"):
        return log_prob - ref_log_prob
    if kind == "abs":
        return (log_prob - ref_log_prob).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (log_prob - ref_log_prob).square()
    if kind in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_log_prob - log_prob, min=-20, max=20)
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    raise ValueError(f"unknown KL estimator {kind!r}")


def token_mean(loss: torch.Tensor, mask: torch.Tensor, batch_num_tokens: torch.Tensor) -> torch.Tensor:
    """``agg_loss(token-mean)`` with the global token count of the mini-batch (dp size 1)."""
    return masked_sum(loss, mask) / batch_num_tokens


def vanilla_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: float,
    batch_num_tokens: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with dual clip. Returns ``(pg_loss, {pg_clipfrac, ppo_kl,
    pg_clipfrac_lower})``; the loss carries gradients, the metrics are masked means."""
    neg_kl = torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(neg_kl)
    ppo_kl = masked_mean(-neg_kl, mask)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped1 = torch.maximum(loss1, loss2)
    clipfrac = masked_mean(torch.gt(loss2, loss1).float(), mask)
    loss3 = -advantages * clip_c
    clipped2 = torch.min(loss3, clipped1)
    clipfrac_lower = masked_mean(torch.gt(clipped1, loss3) * (advantages < 0).float(), mask)
    losses = torch.where(advantages < 0, clipped2, clipped1)
    pg_loss = token_mean(losses, mask, batch_num_tokens)
    return pg_loss, {"pg_clipfrac": clipfrac, "ppo_kl": ppo_kl, "pg_clipfrac_lower": clipfrac_lower}


def clipped_value_loss(
    vpreds: torch.Tensor, values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, cliprange: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``0.5 * token-mean(max((v' - G)^2, (clip(v', v - e, v + e) - G)^2))`` over the
    mini-batch, and the share of tokens where the clipped term is larger."""
    clipped = torch.max(torch.min(vpreds, values + cliprange), values - cliprange)
    l1 = (vpreds - returns) ** 2
    l2 = (clipped - returns) ** 2
    loss = 0.5 * token_mean(torch.max(l1, l2), mask, mask.sum())
    return loss, masked_mean(torch.gt(l2, l1).float(), mask)
