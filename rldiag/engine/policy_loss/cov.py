"""Covariance-selected losses ``clip_cov`` and ``kl_cov`` (arXiv:2505.22617, "The Entropy
Mechanism of Reinforcement Learning for Reasoning Language Models", s4).

Both rank tokens by ``cov_t = (A_t - mean A) (log pi_t - mean log pi)`` over the batch verl
computes the loss on (one micro-batch of a step); here over each segment, vectorised by sorting
on (segment, key) once.
"""

from __future__ import annotations

import torch

from rldiag.engine.policy_loss.base import (
    POLICY,
    POLICY_LOSSES,
    PolicyLossInput,
    PolicyLossOutput,
    agg,
    agg_weights,
    positive_setting,
    seg_masked_mean,
    weighted,
)
from rldiag.engine.segments import seg_count, seg_sum


def _covariance(adv: torch.Tensor, lp: torch.Tensor, mask: torch.Tensor, rows, seg: torch.Tensor, n: int,
                eps: float) -> torch.Tensor:
    """``(A - mean A)(log pi - mean log pi)`` ``(tokens,)`` about each segment's masked means
    (``sum / (count + eps)``), in float64. Sums of float32 values in float64 are (nearly always)
    exact, so the ranking does not depend on the summation order or on which steps are packed together, and
    equal advantages give exactly equal covariances (ties then go by position)."""
    m = mask.to(torch.float64)
    a, lg = adv.to(torch.float64), lp.to(torch.float64)
    cnt = seg_sum(rows.sum(m), seg, n) + eps
    mean_a = seg_sum(rows.masked_sum(a, m), seg, n) / cnt
    mean_l = seg_sum(rows.masked_sum(lg, m), seg, n) / cnt
    return (a - rows.expand(mean_a[seg])) * (lg - rows.expand(mean_l[seg]))


def _or(value, default: float) -> float:
    """verl's ``x if x is not None else default`` for the policy_loss parameters."""
    return float(default if value is None else value)


def clip_cov_ratio(settings) -> float:
    """``policy_loss.clip_cov_ratio`` (verl's default 0.0002 when unset), which must be above 0."""
    return positive_setting(settings, f"{POLICY}.clip_cov_ratio", "loss_mode=clip_cov", default=0.0002)


def kl_cov_ratio(settings) -> float:
    """``policy_loss.kl_cov_ratio`` (verl's default 0.0002 when unset), which must be above 0."""
    return positive_setting(settings, f"{POLICY}.kl_cov_ratio", "loss_mode=kl_cov", default=0.0002)


@POLICY_LOSSES.register("clip_cov", check=clip_cov_ratio,
                        source="verl core_algos.compute_policy_loss_clip_cov; Clip-Cov arXiv:2505.22617 s4.2")
def clip_cov(inp: PolicyLossInput) -> PolicyLossOutput:
    """PPO clip (no dual clip, unclamped ratio) with the gradient of some high-covariance tokens
    cut: candidates are unclipped masked tokens with ``clip_cov_lb < cov < clip_cov_ub``
    (``cov`` about the segment's masked means); verl zeroes ``k = max(int(clip_cov_ratio N), 1)``
    of them chosen by ``torch.randperm`` (N = masked tokens of the segment).

    verl's choice is random when there are more than ``k`` candidates. rldiag reports the
    expectation over that choice: each candidate's loss is multiplied by ``1 - k / n_cand``
    (exact when ``n_cand <= k``: then every candidate is cut, as in verl). ``actor/pg_clipfrac``
    (``min(k, n_cand) / N``) and ``actor/ppo_kl`` are deterministic and exact.
    ``rldiag/clip_cov/candidates`` and ``rldiag/clip_cov/clipped`` count tokens per step.
    """
    s = inp.settings
    ratio_cfg = clip_cov_ratio(inp.settings)
    lb = _or(s[f"{POLICY}.clip_cov_lb"], 1.0)
    ub = _or(s[f"{POLICY}.clip_cov_ub"], 5.0)
    seg, n = inp.norm.seg_ids, inp.norm.n_seg
    adv, lp, mask = inp.advantages, inp.log_prob, inp.mask
    log_ratio = lp - inp.old_log_prob
    ratio = torch.exp(log_ratio)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - s.clip_low, 1 + s.clip_high)
    valid = mask > 0
    clipped_by_origin = (l2 > l1) & valid
    rows = inp.rows
    cov = _covariance(adv, lp, mask, rows, seg, n, eps=1e-8)  # verl's masked_mean: sum / (count + 1e-8)
    cand = valid & ~clipped_by_origin & (cov < ub) & (cov > lb)
    n_tok = seg_sum(rows.sum(mask).to(torch.float64), seg, n)
    k = torch.floor(n_tok * ratio_cfg).clamp_min(1.0)  # max(int(ratio * N), 1)
    n_cand = seg_sum(rows.count(cand).to(torch.float64), seg, n)
    chosen = torch.minimum(k, n_cand)
    p_cut = torch.where(n_cand > 0, chosen / n_cand.clamp_min(1.0), torch.zeros_like(n_cand)).to(adv.dtype)
    corr = torch.where(cand, 1.0 - rows.expand(p_cut[seg]), torch.ones_like(adv))
    losses = weighted(torch.maximum(l1, l2) * corr, inp)
    clipfrac = chosen.to(torch.float32) / (n_tok.to(torch.float32) + 1e-8)
    return PolicyLossOutput(
        pg_loss=agg(losses, inp),
        pg_losses=losses,
        ratio=ratio,
        metrics={"actor/pg_clipfrac": clipfrac, "actor/ppo_kl": seg_masked_mean(-log_ratio, inp)},
        sums={"rldiag/clip_cov/candidates": n_cand.to(torch.float32), "rldiag/clip_cov/clipped": chosen.to(torch.float32)},
        weights=agg_weights(inp),
        clipped=torch.where(cand, 1.0 - corr, torch.zeros_like(corr)).to(torch.float32),
    )


def top_share(key: torch.Tensor, valid: torch.Tensor, rows, seg: torch.Tensor, n: int, ratio: float) -> torch.Tensor:
    """Tokens with the ``max(1, int(n_s ratio))`` largest ``key`` among the ``n_s`` valid tokens of
    each segment ``(tokens,)`` bool. Ties go to the earlier token (row by row, in row order)."""
    flat_valid = valid
    idx = torch.nonzero(flat_valid).flatten()
    tok_seg = rows.expand(seg)[idx]
    tok_key = key[idx]
    order = torch.sort(tok_key, descending=True, stable=True).indices
    order = order[torch.sort(tok_seg[order], stable=True).indices]  # (segment, key desc, index)
    cnt = seg_count(tok_seg, n, torch.long)
    start = torch.cumsum(cnt, 0) - cnt
    rank = torch.arange(order.numel(), device=key.device) - start[tok_seg[order]]
    k = torch.floor(cnt.to(torch.float64) * ratio).to(torch.long).clamp_min(1)
    picked = idx[order[rank < k[tok_seg[order]]]]
    out = torch.zeros_like(flat_valid)
    out[picked] = True
    return out


@POLICY_LOSSES.register("kl_cov", check=kl_cov_ratio,
                        source="verl core_algos.compute_policy_loss_kl_cov; KL-Cov arXiv:2505.22617 s4.2")
def kl_cov(inp: PolicyLossInput) -> PolicyLossOutput:
    """Unclipped ``-A r`` plus ``ppo_kl_coef |log r|`` on the top ``max(1, int(kl_cov_ratio N))``
    tokens by ``cov`` (plain means over the segment's masked tokens; N = masked tokens).
    ``actor/ppo_kl`` is the masked mean of ``|log r|`` (verl reports the absolute value; it has no
    clip fraction for this loss). verl takes ``torch.topk``; among exactly tied covariances at the
    cut its pick is unspecified, rldiag takes the earlier token.
    """
    ratio_cfg = kl_cov_ratio(inp.settings)
    coef = _or(inp.settings[f"{POLICY}.ppo_kl_coef"], 1.0)  # verl's fallback when the key is null
    seg, n = inp.norm.seg_ids, inp.norm.n_seg
    adv, lp, mask = inp.advantages, inp.log_prob, inp.mask
    log_ratio = lp - inp.old_log_prob
    ratio = torch.exp(log_ratio)
    valid = mask > 0
    rows = inp.rows
    cov = _covariance(adv, lp, mask, rows, seg, n, eps=0.0)  # plain means
    top = top_share(cov, valid, rows, seg, n, ratio_cfg)
    base = -adv * ratio
    losses = weighted(torch.where(top, base + coef * log_ratio.abs(), base), inp)
    return PolicyLossOutput(
        pg_loss=agg(losses, inp),
        pg_losses=losses,
        ratio=ratio,
        metrics={"actor/ppo_kl": seg_masked_mean(log_ratio.abs(), inp)},
        sums={"rldiag/kl_cov/selected": seg_sum(rows.count(top), seg, n)},
        weights=agg_weights(inp),
    )
