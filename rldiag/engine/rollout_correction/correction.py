"""The whole correction: :func:`correct` (verl's ``compute_rollout_correction_and_rejection_mask``)
runs the IS weights, the rejection and the diagnostics on a packed batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rldiag.engine.layout import Rows
from rldiag.engine.rollout_correction.common import SAFETY_BOUND, Metrics
from rldiag.engine.rollout_correction.config import CorrectionConfig
from rldiag.engine.rollout_correction.diagnostics import offpolicy_metrics
from rldiag.engine.rollout_correction.rejection import RSContext, rejection_mask
from rldiag.engine.rollout_correction.weights import is_weights
from rldiag.engine.segments import step_mask_count

#: verl's message when a batch reaches rollout correction without a single actor token.
EMPTY_MESSAGE = "rollout correction: response_mask must contain at least one valid token (1) (verl raises here)"
#: when every IS weight of a batch is 0 (IcePop), verl's ESS is ``1.0 / 0.0`` in Python.
ZERO_WEIGHTS_MESSAGE = (
    "rollout correction: every IS weight of the batch is 0 (all outside the IcePop band), so "
    "rollout_is_eff_sample_size divides by zero (verl raises ZeroDivisionError here)"
)


@dataclass
class CorrectionResult:
    """What :func:`correct` produced for a packed batch."""

    weights: torch.Tensor | None  # (tokens,) IS weights, None when rollout_is is off
    mask: torch.Tensor  # (tokens,) response_mask after rejection
    metrics: Metrics  # "rollout_corr/<name>" -> (n,)
    empty: torch.Tensor  # (n,) bool: segments without a single masked token (verl raises)
    failed: dict[str, torch.Tensor] = field(default_factory=dict)  # message -> (n,) bool, verl raises


def correct(
    train_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    cfg: CorrectionConfig,
    rows: Rows,
    seg: torch.Tensor,
    n: int,
) -> CorrectionResult:
    """verl's ``compute_rollout_correction_and_rejection_mask`` on each segment of ``seg``:
    IS weights (if ``rollout_is``), rejection (if ``rollout_rs``), off-policy diagnostics always.
    Inputs ``(tokens,)`` in the layout ``rows``; ``seg`` ``(rows,)`` the segment of each row;
    metric values for segments in ``empty`` are not meaningful."""
    log_ratio = train_log_prob - rollout_log_prob
    metrics: Metrics = {}
    weights = None
    if cfg.rollout_is is not None:
        weights, im = is_weights(log_ratio, mask, cfg, rows, seg, n)
        metrics.update(im)
    new_mask = mask
    if cfg.rs:
        ctx = RSContext(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND), mask, train_log_prob, rollout_log_prob,
                        rows)
        new_mask, rm = rejection_mask(ctx, cfg.rs, seg, n)
        metrics.update(rm)
    metrics.update(offpolicy_metrics(train_log_prob, rollout_log_prob, mask, rows, seg, n, log_ratio))
    empty = step_mask_count(mask, rows, seg, n) == 0
    failed = {EMPTY_MESSAGE: empty}
    if weights is not None:
        failed[ZERO_WEIGHTS_MESSAGE] = torch.isinf(metrics["rollout_is_eff_sample_size"]) & ~empty
    return CorrectionResult(weights, new_mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}, empty, failed)
