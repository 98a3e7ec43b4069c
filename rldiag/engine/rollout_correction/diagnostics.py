"""Off-policy diagnostics: KL, k3 KL, perplexities, log-PPL differences, chi-squared (computed
whether or not IS weights or rejection are on)."""

from __future__ import annotations

import torch

from rldiag.engine.layout import Rows
from rldiag.engine.rollout_correction.common import SAFETY_BOUND, Metrics
from rldiag.engine.segments import MEAN_EPS, seg_max, seg_mean, seg_min, seg_sum, step_mask_count, step_masked_mean

_EXP_LO = float(torch.exp(torch.tensor(-SAFETY_BOUND, device="cpu")))  # float32 exp(-20), exp(20)
_EXP_HI = float(torch.exp(torch.tensor(SAFETY_BOUND, device="cpu")))


def offpolicy_metrics(
    train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, rows: Rows, seg: torch.Tensor,
    n: int, log_ratio: torch.Tensor | None = None,
) -> Metrics:
    """KL(pi_rollout || pi_train) (k1 and k3), perplexities and their log differences (per-row
    means, then the mean over every row), chi-squared of token and sequence ratios ``(n,)``.
    ``log_ratio``: ``train - rollout`` when the caller has it."""
    m: Metrics = {}
    if log_ratio is None:
        log_ratio = train_log_prob - rollout_log_prob
    count = rows.mask_count(mask) + MEAN_EPS
    lp_train = rows.masked_sum(train_log_prob, mask) / count
    lp_roll = rows.masked_sum(rollout_log_prob, mask) / count
    m["training_ppl"] = seg_mean(torch.exp(-lp_train), seg, n)
    m["training_log_ppl"] = seg_mean(-lp_train, seg, n)
    # rollout - train is exactly -(train - rollout), and so are their sums
    row_sum = rows.masked_sum(log_ratio, mask)
    m["kl"] = seg_sum(-row_sum, seg, n) / (step_mask_count(mask, rows, seg, n) + MEAN_EPS)
    ratio = torch.exp(log_ratio)
    m["k3_kl"] = step_masked_mean(torch.sub(ratio, log_ratio).sub_(1.0), mask, rows, seg, n)
    m["rollout_ppl"] = seg_mean(torch.exp(-lp_roll), seg, n)
    m["rollout_log_ppl"] = seg_mean(-lp_roll, seg, n)
    diff = lp_roll - lp_train
    m["log_ppl_diff"] = seg_mean(diff, seg, n)
    m["log_ppl_abs_diff"] = seg_mean(diff.abs(), seg, n)
    m["log_ppl_diff_max"] = seg_max(diff, seg, n)
    m["log_ppl_diff_min"] = seg_min(diff, seg, n)
    m["ppl_ratio"] = seg_mean(torch.exp(diff), seg, n)
    # exp(clamp(x, -b, b)) as clamp(exp(x), exp(-b), exp(b)): exp is monotone, one exp serves both
    rho = ratio.clamp_(min=_EXP_LO, max=_EXP_HI)
    count = step_mask_count(mask, rows, seg, n) + MEAN_EPS
    m["chi2_token"] = seg_sum(rows.masked_square_sum(rho, mask), seg, n) / count - 1.0
    row_sum = torch.clamp(row_sum, -SAFETY_BOUND, SAFETY_BOUND)
    m["chi2_seq"] = seg_mean(torch.exp(2.0 * row_sum), seg, n) - 1.0
    return m
