"""Importance-sampling weights: :data:`IS_LEVELS` (keyed by ``rollout_is``) and :func:`is_weights`
(TIS / IcePop, batch normalisation, verl's ``rollout_is_*`` metrics)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from rldiag.engine.layout import Rows
from rldiag.engine.rollout_correction.common import SAFETY_BOUND, Metrics, clamped_std, row_mean, seq_std0
from rldiag.engine.segments import MEAN_EPS, seg_max, seg_mean, seg_min, seg_sum, step_masked_extrema, step_masked_mean
from rldiag.registry import Registry


class ISConfig(Protocol):
    """The IS part of a rollout-correction block :func:`is_weights` reads (the block's
    :class:`~rldiag.engine.rollout_correction.config.CorrectionConfig` is one; that module checks
    its level against :data:`IS_LEVELS` here, so this one names the shape rather than import it)."""

    @property
    def rollout_is(self) -> str | None: ...

    @property
    def is_upper(self) -> float: ...

    @property
    def is_lower(self) -> float | None: ...

    @property
    def batch_normalize(self) -> bool: ...

ISLevelFn = Callable[[torch.Tensor, torch.Tensor, Rows], tuple[torch.Tensor, torch.Tensor | None]]
IS_LEVELS: Registry[ISLevelFn] = Registry("rollout_is level")


@IS_LEVELS.register("token", source="verl rollout_corr_helper.compute_rollout_correction_weights (token level)")
def is_token(log_ratio: torch.Tensor, mask: torch.Tensor, rows: Rows) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Raw masked weights ``exp(clamp(log r, +-20)) * m`` ``(tokens,)``; no row statistic."""
    return torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)) * mask, None


@IS_LEVELS.register("sequence", source="verl rollout_corr_helper.compute_rollout_correction_weights (sequence level)")
def is_sequence(log_ratio: torch.Tensor, mask: torch.Tensor, rows: Rows) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Raw weights ``exp(clamp(sum_t m log r, +-20))`` on every masked token of the row, and the
    unclamped row sums ``(rows,)`` verl's metrics read."""
    row = rows.masked_sum(log_ratio, mask)
    w = rows.expand(torch.exp(torch.clamp(row, -SAFETY_BOUND, SAFETY_BOUND)))
    return w * mask, row


def is_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, cfg: ISConfig, rows: Rows, seg: torch.Tensor, n: int,
    seq_stats: bool = True,
) -> tuple[torch.Tensor, Metrics]:
    """IS weights ``(tokens,)`` (TIS / IcePop, optionally batch-normalised per segment) and
    verl's ``rollout_is_*`` metrics ``(n,)`` (computed before the batch normalisation).
    ``seq_stats=False``: without the ``rollout_is_seq_*`` metrics (the rows' mean weights), for
    a caller that reads none of them (the other metrics are the same values)."""
    level = cfg.rollout_is
    assert level is not None, "IS weights asked for without rollout_is"
    raw, row_log = IS_LEVELS.get(level)(log_ratio, mask, rows)
    upper, lower = cfg.is_upper, cfg.is_lower
    if lower is None:
        w = raw.clamp(max=upper)  # TIS
    else:
        w = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))  # IcePop
    lo_m = 1.0 / upper if lower is None else lower
    m: Metrics = {}
    if row_log is not None:  # sequence level: log-space row statistics over every row
        log_up = torch.log(torch.tensor(upper, dtype=torch.float32, device=raw.device))
        log_lo = torch.log(torch.tensor(lo_m, dtype=torch.float32, device=raw.device))
        m["rollout_is_max"] = torch.exp(torch.clamp(seg_max(row_log, seg, n), max=SAFETY_BOUND))
        m["rollout_is_min"] = torch.exp(seg_min(row_log, seg, n))
        m["rollout_is_mean"] = step_masked_mean(w, mask, rows, seg, n)
        m["rollout_is_ratio_fraction_high"] = seg_mean((row_log > log_up).float(), seg, n)
        m["rollout_is_ratio_fraction_low"] = seg_mean((row_log < log_lo).float(), seg, n)
    else:
        m["rollout_is_mean"] = step_masked_mean(w, mask, rows, seg, n)
        m["rollout_is_ratio_fraction_high"] = step_masked_mean((raw > upper).float(), mask, rows, seg, n)
        m["rollout_is_ratio_fraction_low"] = step_masked_mean((raw < lo_m).float(), mask, rows, seg, n)
        _, m["rollout_is_max"], m["rollout_is_min"] = step_masked_extrema(w, mask, rows, seg, n)
    m["rollout_is_std"] = clamped_std(w, mask, rows, seg, n, 0.0, upper)
    ess_w = w.clamp(min=0.0, max=upper)
    ess_norm = ess_w / (rows.expand(step_masked_mean(ess_w, mask, rows, seg, n)[seg]) + MEAN_EPS)
    m["rollout_is_eff_sample_size"] = 1.0 / step_masked_mean(ess_norm.square(), mask, rows, seg, n)
    seq_w = row_mean(w, mask, rows) if seq_stats or (cfg.batch_normalize and row_log is not None) else None
    if seq_w is not None and seq_stats:
        m["rollout_is_seq_mean"] = seg_mean(seq_w, seg, n)
        m["rollout_is_seq_std"] = seq_std0(seq_w, seg, n)
        m["rollout_is_seq_max"] = seg_max(seq_w, seg, n)
        m["rollout_is_seq_min"] = seg_min(seq_w, seg, n)
        m["rollout_is_seq_max_deviation"] = seg_max((seq_w - 1.0).abs(), seg, n)
        raw_seq = row_mean(raw, mask, rows)
        m["rollout_is_seq_fraction_high"] = seg_mean((raw_seq > upper).float(), seg, n)
        m["rollout_is_seq_fraction_low"] = seg_mean((raw_seq < lo_m).float(), seg, n)
    if lower is not None:
        oob = (raw < lower) | (raw > upper)
        m["rollout_is_oob_ratio"] = step_masked_mean(oob.float(), mask, rows, seg, n)
    if cfg.batch_normalize:
        if row_log is None:
            mean_w = step_masked_mean(w, mask, rows, seg, n)
        else:
            valid = (rows.sum(mask) > 0).to(w.dtype)
            assert seq_w is not None  # computed above for the batch normalisation
            mean_w = seg_sum(seq_w * valid, seg, n) / seg_sum(valid, seg, n).clamp_min(1e-8)
        apply = mean_w > 1e-8
        w = torch.where(rows.expand(apply[seg]), w / rows.expand(mean_w[seg]), w)
        m["rollout_is_batch_norm_factor"] = torch.where(apply, mean_w, torch.ones_like(mean_w))
    return w, m
