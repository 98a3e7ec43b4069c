"""Ratio-based losses: PPO (``vanilla``), ``up``, ``gspo``, ``sapo``, ``cispo``, ``dppo_tv``,
``dppo_kl``, ``geo_mean``. verl's ``compute_policy_loss_*`` of ``verl/trainer/ppo/core_algos.py``.

Metrics as verl returns them: a masked mean over the segment (``+1e-8`` in the denominator) of
an indicator; ``actor/ppo_kl`` is the masked mean of ``old - new`` log-prob (clamped to +-20 only
where the loss clamps its log-ratio).
"""

from __future__ import annotations

import torch

from rldiag.engine import host, kernels, ppo_native
from rldiag.engine.policy_loss.base import (
    ACTOR,
    POLICY_LOSSES,
    PolicyLossInput,
    PolicyLossOutput,
    agg,
    agg_weights,
    clamped_log_ratio,
    dual_clip_c,
    masked,
    seg_masked_mean,
    weighted,
    zeros,
)
from rldiag.engine.segments import (
    MEAN_EPS,
    seg_count,
    seg_mean,
    seg_sum,
    step_mask_count,
)


def ppo_terms(adv: torch.Tensor, ratio: torch.Tensor, clip_low: float, clip_high: float, clip_c: float):
    """PPO's clipped surrogate with dual clip, per token ``(tokens,)``.

    Returns ``(l1, l2, clipped1, l3, losses)``: ``l1 = -A r``, ``l2 = -A clip(r, 1 - lo, 1 + hi)``
    (arXiv:1707.06347 eq. 7), ``clipped1 = max(l1, l2)``, ``l3 = |A| c`` (the dual-clip bound
    ``-A c`` where ``A < 0``, the only tokens it applies to) and the loss ``min(l3, clipped1)``
    where ``A < 0`` (dual clip, arXiv:1912.09729), else ``clipped1``
    (:func:`rldiag.engine.kernels.dual_clip`).
    """
    neg = -adv  # once for both products (the same values as negating in each)
    l1 = neg * ratio
    l2 = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    torch.mul(neg, l2, out=l2)  # -A clip(r), written over the clipped ratio
    del neg
    clipped1 = torch.maximum(l1, l2)
    l3 = torch.abs(adv).mul_(clip_c)
    losses = kernels.dual_clip(adv, clipped1, l3)
    return l1, l2, clipped1, l3, losses


def ppo_clip(inp: PolicyLossInput, old: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None) -> PolicyLossOutput:
    """verl's ``compute_policy_loss_vanilla`` against ``old`` on ``mask`` with IS ``weights``."""
    s = inp.settings
    clip_c = dual_clip_c(inp.settings)
    adv = inp.advantages
    log_ratio = clamped_log_ratio(inp.log_prob, old)
    ratio = torch.exp(log_ratio)
    norm, rows = inp.norm, inp.rows
    count = step_mask_count(mask, rows, norm.seg_ids, norm.n_seg) + MEAN_EPS
    # on the host, the losses, the clip indicator and the dual clip's row counts in one compiled
    # read (rldiag.engine.ppo_native: the same float32 operations, the same bits)
    fused = ppo_native.ppo_tokens(adv, ratio, mask, weights, rows.offsets, 1 - s.clip_low, 1 + s.clip_high, clip_c)
    if fused is not None:
        losses, clipped, lower_rows = fused
    else:
        l1, l2, clipped1, l3, losses = ppo_terms(adv, ratio, s.clip_low, s.clip_high, clip_c)
        if weights is not None:
            losses = losses * weights
        # the clipped tokens (l2 > l1 on the mask), 0/1: their per-row count is pg_clipfrac's (the
        # same integers as counting the comparison; remembered for the rows stage's clipped_tokens)
        clipped = host.greater_on(l2, l1, mask)
        # verl: masked_mean(clipped1 > l3 and A < 0); clipped1 > l3 = |A| c happens only where
        # A < 0 (elsewhere clipped1 <= 0 <= l3)
        lower_rows = kernels.count_greater_masked(clipped1, l3, mask, rows)
    return PolicyLossOutput(
        pg_loss=agg(losses, inp, mask=mask),
        pg_losses=losses,
        ratio=ratio,
        metrics={
            "actor/pg_clipfrac": seg_sum(rows.column_sum(clipped), norm.seg_ids, norm.n_seg) / count,
            # the sum of -x is exactly minus the sum of x
            "actor/ppo_kl": -seg_sum(rows.masked_sum(log_ratio, mask), norm.seg_ids, norm.n_seg) / count,
            "actor/pg_clipfrac_lower": seg_sum(lower_rows, norm.seg_ids, norm.n_seg) / count,
        },
        weights=agg_weights(inp, mask=mask),
        clipped=clipped,
    )


@POLICY_LOSSES.register("vanilla", check=dual_clip_c,
                        source="verl core_algos.compute_policy_loss_vanilla; arXiv:1707.06347; dual clip arXiv:1912.09729")
def vanilla(inp: PolicyLossInput) -> PolicyLossOutput:
    """PPO clipped surrogate, asymmetric clip (clip_ratio_low/high), dual clip (clip_ratio_c).

    Metrics: ``actor/pg_clipfrac`` (clipped branch larger), ``actor/ppo_kl``,
    ``actor/pg_clipfrac_lower`` (negative-advantage tokens capped by the dual clip).
    """
    return ppo_clip(inp, inp.old_log_prob, inp.mask, inp.rollout_is_weights)


@POLICY_LOSSES.register("up", check=dual_clip_c, source="verl core_algos.compute_policy_loss_up; UP-GRPO arXiv:2607.06987 eq. 15")
def up(inp: PolicyLossInput) -> PolicyLossOutput:
    """Unbounded positive: ``-A`` (self-anchored ratio, value 1) where ``A > 0``; PPO clip with
    dual clip elsewhere. ``actor/pg_clipfrac`` is over the ``A <= 0`` tokens only."""
    s = inp.settings
    adv = inp.advantages
    log_ratio = clamped_log_ratio(inp.log_prob, inp.old_log_prob)
    ratio = torch.exp(log_ratio)
    l1, l2, clipped1, l3, neg = ppo_terms(adv, ratio, s.clip_low, s.clip_high, dual_clip_c(inp.settings))
    losses = weighted(torch.where(adv > 0, -adv, neg), inp)
    non_pos = inp.mask * (adv <= 0).float()
    return PolicyLossOutput(
        pg_loss=agg(losses, inp),
        pg_losses=losses,
        ratio=torch.where(adv > 0, torch.ones_like(ratio), ratio),
        metrics={
            "actor/pg_clipfrac": seg_masked_mean(torch.gt(l2, l1).float(), inp, non_pos),
            "actor/ppo_kl": seg_masked_mean(-log_ratio, inp),
            "actor/pg_clipfrac_lower": seg_masked_mean(torch.gt(clipped1, l3).float() * (adv < 0).float(), inp),
        },
        weights=agg_weights(inp),
        clipped=masked(torch.gt(l2, l1), non_pos),
    )


@POLICY_LOSSES.register("gspo", source="verl core_algos.compute_policy_loss_gspo; GSPO arXiv:2507.18071")
def gspo(inp: PolicyLossInput) -> PolicyLossOutput:
    """Sequence-level ratio ``s_i = exp(min(mean_t m (log pi - log pi_old), 10))`` (length
    normalised, arXiv:2507.18071 eq. 7) clipped like PPO, on every token of the row; aggregated
    ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says (verl hard-codes it), except in verl
    0.9.1, which aggregates by ``loss_agg_mode`` (``rldiag.verl_version``).
    ``actor/ppo_kl`` uses the unclamped token log-ratio; ``actor/pg_clipfrac_lower`` is 0."""
    s = inp.settings
    adv, mask = inp.advantages, inp.mask
    log_ratio = inp.log_prob - inp.old_log_prob
    rows = inp.rows
    seq_len = rows.sum(mask).clamp(min=1)
    seq_log = rows.sum(log_ratio * mask) / seq_len
    ratio = rows.expand(torch.exp(torch.clamp(seq_log, max=10.0)))
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - s.clip_low, 1 + s.clip_high)
    losses = weighted(torch.maximum(l1, l2), inp)
    mode = None if s.has("gspo_agg_mode") else "seq-mean-token-mean"
    return PolicyLossOutput(
        pg_loss=agg(losses, inp, mode=mode),
        pg_losses=losses,
        ratio=ratio,
        metrics={
            "actor/pg_clipfrac": seg_masked_mean(torch.gt(l2, l1).float(), inp),
            "actor/ppo_kl": seg_masked_mean(-log_ratio, inp),
            "actor/pg_clipfrac_lower": zeros(inp),
        },
        weights=agg_weights(inp, mode=mode),
        clipped=masked(torch.gt(l2, l1), mask),
    )


@POLICY_LOSSES.register("sapo", source="SAPO arXiv:2511.20347")
def sapo(inp: PolicyLossInput) -> PolicyLossOutput:
    """Soft gate instead of a hard clip: ``-A f(r)``, ``f(r) = sigmoid(tau (r - 1)) 4 / tau``,
    ``tau = tau_pos`` where ``A > 0`` else ``tau_neg`` (arXiv:2511.20347 eq. 5); aggregated
    ``seq-mean-token-mean`` (hard-coded by verl). Clip fractions are 0."""
    s = inp.settings
    adv = inp.advantages
    tau = torch.where(
        adv > 0,
        torch.as_tensor(float(s[f"{ACTOR}.tau_pos"]), dtype=adv.dtype, device=adv.device),
        torch.as_tensor(float(s[f"{ACTOR}.tau_neg"]), dtype=adv.dtype, device=adv.device),
    )
    log_ratio = clamped_log_ratio(inp.log_prob, inp.old_log_prob)
    ratio = torch.exp(log_ratio)
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    losses = weighted(-gates * adv, inp)
    return PolicyLossOutput(
        pg_loss=agg(losses, inp, mode="seq-mean-token-mean"),
        pg_losses=losses,
        ratio=ratio,
        metrics={"actor/pg_clipfrac": zeros(inp), "actor/ppo_kl": seg_masked_mean(-log_ratio, inp),
                 "actor/pg_clipfrac_lower": zeros(inp)},
        weights=agg_weights(inp, mode="seq-mean-token-mean"),
        clipped=torch.zeros_like(inp.mask, dtype=torch.float32),
    )


@POLICY_LOSSES.register("cispo", source="CISPO (MiniMax-M1) arXiv:2506.13585")
def cispo(inp: PolicyLossInput) -> PolicyLossOutput:
    """``-sg(clip(r, 1 - lo, 1 + hi)) A log pi`` (arXiv:2506.13585 eq. 4): the IS weight is
    clipped, every token keeps its gradient. ``actor/pg_clipfrac`` = share of tokens whose ratio
    was clipped; ``actor/pg_clipfrac_lower`` is 0."""
    s = inp.settings
    log_ratio = clamped_log_ratio(inp.log_prob, inp.old_log_prob)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - s.clip_low, 1 + s.clip_high)
    losses = weighted(-clipped * inp.advantages * inp.log_prob, inp)
    return PolicyLossOutput(
        pg_loss=agg(losses, inp),
        pg_losses=losses,
        ratio=ratio,
        metrics={
            "actor/pg_clipfrac": seg_masked_mean((ratio != clipped).float(), inp),
            "actor/ppo_kl": seg_masked_mean(-log_ratio, inp),
            "actor/pg_clipfrac_lower": zeros(inp),
        },
        weights=agg_weights(inp),
        clipped=masked(ratio != clipped, inp.mask),
    )


def _dppo(inp: PolicyLossInput, valid_pos: torch.Tensor, valid_neg: torch.Tensor, log_ratio: torch.Tensor) -> PolicyLossOutput:
    """DPPO's binary trust region: ``-A sg(min(r, c)) log pi`` on tokens inside the divergence
    bound (arXiv:2602.04879 s4), ``c`` = ``clip_ratio_c`` (TIS, s5.4)."""
    adv = inp.advantages
    clip_c = float(inp.settings[f"{ACTOR}.clip_ratio_c"])
    ratio = torch.exp(log_ratio)
    valid = torch.where(adv > 0, valid_pos, valid_neg).float()
    losses = weighted(-adv * torch.clamp(ratio, max=clip_c) * inp.log_prob * valid, inp)
    return PolicyLossOutput(
        pg_loss=agg(losses, inp),
        pg_losses=losses,
        ratio=ratio,
        metrics={
            "actor/pg_clipfrac": seg_masked_mean(1.0 - valid, inp),
            "actor/ppo_kl": seg_masked_mean(-log_ratio, inp),
            "actor/pg_clipfrac_lower": seg_masked_mean((ratio > clip_c).float() * valid, inp),
        },
        weights=agg_weights(inp),
        clipped=masked(1.0 - valid, inp.mask),
    )


@POLICY_LOSSES.register("dppo_tv", source="DPPO-Binary-TV arXiv:2602.04879")
def dppo_tv(inp: PolicyLossInput) -> PolicyLossOutput:
    """Valid where ``pi - pi_old <= clip_ratio_high`` (``A > 0``) or ``>= -clip_ratio_low``
    (``A <= 0``): the total-variation bound on probabilities, not on the ratio.
    ``actor/pg_clipfrac`` = share outside the bound; ``actor/pg_clipfrac_lower`` = share inside
    with ``r > clip_ratio_c``."""
    s = inp.settings
    diff = torch.exp(inp.log_prob) - torch.exp(inp.old_log_prob)
    log_ratio = clamped_log_ratio(inp.log_prob, inp.old_log_prob)
    return _dppo(inp, diff <= s.clip_high, diff >= -s.clip_low, log_ratio)


@POLICY_LOSSES.register("dppo_kl", source="DPPO-Binary-KL arXiv:2602.04879")
def dppo_kl(inp: PolicyLossInput) -> PolicyLossOutput:
    """Valid where the Bernoulli KL ``p_old log(p_old/p) + (1-p_old) log((1-p_old+1e-8)/(1-p+1e-8))``
    is within ``clip_ratio_high`` (``A > 0``; or the probability fell) / ``clip_ratio_low``
    (``A <= 0``; or it rose)."""
    s = inp.settings
    p, p_old = torch.exp(inp.log_prob), torch.exp(inp.old_log_prob)
    bkl = p_old * (inp.old_log_prob - inp.log_prob) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    valid_pos = (bkl <= s.clip_high) | (p <= p_old)
    valid_neg = (bkl <= s.clip_low) | (p >= p_old)
    return _dppo(inp, valid_pos, valid_neg, clamped_log_ratio(inp.log_prob, inp.old_log_prob))


@POLICY_LOSSES.register("geo_mean", source="GMPO arXiv:2507.20673")
def geo_mean(inp: PolicyLossInput) -> PolicyLossOutput:
    """Geometric-mean policy optimisation: per row, ``r_i = exp(mean_t m clip_sgn(log r))`` with
    the token log-ratio clipped to ``[-lo, hi]`` only in the direction that helps (sign of A),
    ``A_i`` = masked mean advantage, loss ``-A_i r_i`` (times the geometric mean of the row's IS
    weights). ``actor/pg_loss`` is the plain mean over the segment's rows (``loss_agg_mode`` is
    ignored, as in verl) divided by ``dp_size`` (verl sums it over micro-batches and averages over
    ranks). ``pg_losses`` puts the row loss on the row's masked tokens."""
    s = inp.settings
    adv, mask = inp.advantages, inp.mask
    log_ratio = inp.log_prob - inp.old_log_prob
    sgn = torch.sign(adv)
    clamped = torch.clamp(log_ratio, -s.clip_low, s.clip_high)
    chosen = sgn * torch.minimum(sgn * log_ratio, sgn * clamped)
    rows = inp.rows
    count = rows.sum(mask) + 1e-8
    row_ratio = torch.exp(rows.sum(chosen * mask) / count)
    row_adv = rows.sum(adv * mask) / count
    row_loss = -row_adv * row_ratio
    if inp.rollout_is_weights is not None:
        row_loss = row_loss * torch.exp(rows.sum(torch.log(inp.rollout_is_weights + 1e-10) * mask) / count)
    clipped = torch.ne(log_ratio, clamped)
    seg, n = inp.norm.seg_ids, inp.norm.n_seg
    # pg_loss = sum over the segment's rows of row_loss / (rows * dp_size), each row's loss spread
    # over its masked tokens: a token's weight is 1 / (T_i rows dp_size)
    per_row = 1.0 / (seg_count(seg, n).index_select(0, seg) * inp.dp_size)
    per_row = torch.where(count >= 1, per_row / count, torch.zeros_like(per_row))
    return PolicyLossOutput(
        pg_loss=seg_mean(row_loss, seg, n) / inp.dp_size,
        pg_losses=rows.expand(row_loss) * mask,
        ratio=rows.expand(row_ratio),
        metrics={
            "actor/pg_clipfrac": seg_masked_mean((clipped & (adv > 0)).float(), inp),
            "actor/ppo_kl": seg_masked_mean(-log_ratio, inp),
            "actor/pg_clipfrac_lower": seg_masked_mean((clipped & (adv < 0)).float(), inp),
        },
        weights=masked(rows.expand(per_row), mask),
        clipped=masked(clipped & (adv > 0), mask),
    )

