"""Rejection sampling: :data:`RS_OPTIONS` (keyed by each ``rollout_rs`` option), the
divergence statistics they read (:class:`RSContext`) and :func:`rejection_mask` (the rewritten
mask and verl's ``rollout_rs_*`` metrics)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from rldiag.engine.layout import Rows
from rldiag.engine.rollout_correction.common import Metrics, clamped_std, row_mean, seq_std0
from rldiag.engine.segments import seg_count, seg_max, seg_mean, seg_min, seg_sum, step_masked_extrema, step_masked_mean
from rldiag.registry import Registry


@dataclass
class RSContext:
    """Per-token divergence statistics shared by the rejection options ``(tokens,)``, and the
    row layout ``rows`` of the tokens."""

    log_ratio: torch.Tensor  # clamped to +-20
    mask: torch.Tensor
    train_log_prob: torch.Tensor
    rollout_log_prob: torch.Tensor
    rows: Rows

    @property
    def k1(self) -> torch.Tensor:
        return -self.log_ratio

    @property
    def k2(self) -> torch.Tensor:
        return 0.5 * self.log_ratio.square()

    @property
    def k3(self) -> torch.Tensor:
        return torch.exp(self.log_ratio) - 1.0 - self.log_ratio


#: fn(ctx) -> (per-token statistic, None) for token-level options, (None, per-row statistic) for
#: sequence-level ones; ``(tokens,)`` / ``(rows,)``.
RSFn = Callable[[RSContext], tuple[torch.Tensor | None, torch.Tensor | None]]
RS_OPTIONS: Registry[RSFn] = Registry("rollout_rs option")


def _row_max(v: torch.Tensor, mask: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Max over the row's masked tokens ``(rows,)``; 0 for a row without tokens (verl)."""
    best = rows.amax(v.masked_fill(~mask.bool(), float("-inf")))
    return torch.where(best == float("-inf"), torch.zeros_like(best), best)


_ROW_REDUCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, Rows], torch.Tensor]] = {
    "sum": lambda v, mask, rows: rows.masked_sum(v, mask),
    "mean": row_mean,
    "max": _row_max,
}


def _rs_option(estimator: str, level: str) -> RSFn:
    """The rejection statistic ``estimator`` (k1/k2/k3 of the clamped log-ratio) per token
    (``level`` "token") or reduced over the row's masked tokens ("sum", "mean", "max")."""

    def option(ctx: RSContext) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        stat = getattr(ctx, estimator)
        if level == "token":
            return stat, None
        return None, _ROW_REDUCTIONS[level](stat, ctx.mask, ctx.rows)

    option.__name__ = f"rs_{level}_{estimator}"
    return option


for _est in ("k1", "k2", "k3"):
    RS_OPTIONS.register(f"token_{_est}", source="verl rollout_corr_helper")(_rs_option(_est, "token"))
    for _level in ("sum", "mean", "max"):
        if not (_level == "max" and _est == "k1"):  # verl has no seq_max_k1
            RS_OPTIONS.register(f"seq_{_level}_{_est}", source="verl rollout_corr_helper")(_rs_option(_est, _level))


def _binary_kl(log_p: torch.Tensor, log_q: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Bernoulli KL(P||Q) of ``p = exp(log_p)`` and ``q``, clamped into ``[eps, 1 - eps]``."""
    p = torch.clamp(torch.exp(log_p.float()), eps, 1.0 - eps)
    q = torch.clamp(torch.exp(log_q.float()), eps, 1.0 - eps)
    return (p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))).to(log_p.dtype)


@RS_OPTIONS.register("binary_kl", source="verl rollout_corr_helper (KPop)")
def rs_binary_kl(ctx: RSContext) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``max(KL_bern(train||rollout), KL_bern(rollout||train))`` per token."""
    fwd = _binary_kl(ctx.train_log_prob, ctx.rollout_log_prob)
    rev = _binary_kl(ctx.rollout_log_prob, ctx.train_log_prob)
    return torch.maximum(fwd, rev), None


def rejection_mask(
    ctx: RSContext, options: Mapping[str, tuple[float | None, float]], seg: torch.Tensor, n: int
) -> tuple[torch.Tensor, Metrics]:
    """The mask with rejected tokens set to 0 ``(tokens,)`` and verl's ``rollout_rs_*``
    metrics ``(n,)``, each option judged on the original mask."""
    mask, rows = ctx.mask, ctx.rows
    mask_b = mask.bool()
    valid_row = rows.sum(mask) > 0
    vseg = seg[valid_row]
    n_valid = seg_count(vseg, n)
    combined = torch.ones_like(mask)
    m: Metrics = {}
    for opt, (lower, upper) in options.items():
        tok_stat, row_stat = RS_OPTIONS.get(opt)(ctx)
        is_k1 = opt.endswith("k1")
        assert upper is not None and (lower is not None or not is_k1), "thresholds resolved by CorrectionConfig"
        hi = math.log(upper) if is_k1 else upper
        lo = math.log(lower) if is_k1 and lower is not None else 0.0
        if row_stat is not None:
            stat = rows.expand(row_stat)
            keep_row = (row_stat >= lo) & (row_stat <= hi) if is_k1 else row_stat <= hi
            keep = rows.expand(keep_row)
        else:
            assert tok_stat is not None, "an RS option gives a token or a row statistic"
            stat = tok_stat
            keep = (stat >= lo) & (stat <= hi) if is_k1 else stat <= hi
        p = f"rollout_rs_{opt}"
        m[f"{p}_mean"] = step_masked_mean(stat, mask, rows, seg, n)
        seq_values = row_stat if row_stat is not None else row_mean(stat, mask, rows)
        sv = seq_values[valid_row]
        if row_stat is not None:
            m[f"{p}_max"] = seg_max(sv, vseg, n)
            m[f"{p}_min"] = seg_min(sv, vseg, n)
            m[f"{p}_fraction_high"] = seg_mean((sv > hi).float(), vseg, n)
            m[f"{p}_fraction_low"] = seg_mean((sv < lo).float(), vseg, n) if is_k1 else torch.zeros(n, device=mask.device)
        else:
            _, m[f"{p}_max"], m[f"{p}_min"] = step_masked_extrema(stat, mask, rows, seg, n)
            m[f"{p}_fraction_high"] = step_masked_mean((stat > hi).float(), mask, rows, seg, n)
            low = step_masked_mean((stat < lo).float(), mask, rows, seg, n)
            m[f"{p}_fraction_low"] = low if is_k1 else torch.zeros_like(low)
        m[f"{p}_std"] = clamped_std(stat, mask, rows, seg, n, lo, hi)
        m[f"{p}_seq_mean"] = seg_mean(sv, vseg, n)
        m[f"{p}_seq_std"] = seq_std0(sv, vseg, n)
        m[f"{p}_seq_max"] = seg_max(sv, vseg, n)
        m[f"{p}_seq_min"] = seg_min(sv, vseg, n)
        m[f"{p}_seq_max_deviation"] = seg_max(sv.abs(), vseg, n)
        m[f"{p}_seq_fraction_high"] = seg_mean((sv > hi).float(), vseg, n)
        if is_k1:
            m[f"{p}_seq_fraction_low"] = seg_mean((sv < lo).float(), vseg, n)
        keep_f = keep.to(mask.dtype)
        combined = combined * keep_f
        m[f"{p}_masked_fraction"] = step_masked_mean(1 - keep_f, mask, rows, seg, n)
        row_kept = ~rows.any((~keep) & mask_b)
        dropped = seg_sum((~row_kept[valid_row]).float(), vseg, n)
        m[f"{p}_seq_masked_fraction"] = torch.where(n_valid > 0, dropped / n_valid.clamp_min(1), torch.zeros_like(dropped))
    m["rollout_rs_masked_fraction"] = step_masked_mean(1 - combined, mask, rows, seg, n)
    row_hit = rows.any((~((combined > 0.5) & mask_b)) & mask_b)
    m["rollout_rs_seq_masked_fraction"] = seg_mean(row_hit.float(), seg, n)
    return (mask * combined).to(mask.dtype), m
