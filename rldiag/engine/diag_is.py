"""The diagnostic TIS statistics of :mod:`rldiag.engine.stages.diag_is` in one shared pass: verl's
``rollout_is_*`` metrics of token-level and sequence-level truncated IS (``rollout_is=token`` /
``sequence``, TIS at ``threshold``, no batch normalisation; verl
``rollout_corr_helper.compute_rollout_correction_weights`` and ``compute_is_metrics``) without the
two full passes of :func:`rldiag.engine.rollout_correction.is_weights`.

Token level, the same values to the bit as ``is_weights``' (the same float32 operations on each
token, the same row sums): the weights ``w = min(exp(clamp(d, +-20)) m, threshold)`` are made once
in place; their step sum serves the mean, the standard deviation's and the effective sample
size's centre (``is_weights`` sums them three times); the deviations from each step's mean and the
normalised weights are taken step slice by step slice (a scalar per step, no gathered per-token
mean); the two ratio fractions count tokens (exact integers: any order gives the same count), the
extrema take the step slice's max and min (exact in any order).

Sequence level, in closed form per row: a row's weight is one value ``w_r = min(exp(clamp(sum_t
m d, +-20)), threshold)`` on each of its ``c_r`` actor tokens, so its token sums are ``c_r w_r``
and ``c_r (w_r - mean)^2``, taken in float64 over the rows (no token pass beyond the rows' summed
log-ratios). ``is_weights`` sums the same constants token by token in float32 pieces, so the mean,
std and effective sample size differ from it in their last float32 bits (docs/performance.md,
"The other diagnostic stages"); the extrema and fractions, row statistics already, are the same.

Inputs: ``log_ratio`` ``(tokens,)`` float32 ``old - rollout``, ``mask`` ``(tokens,)`` 0/1 float32
(the original mask), the layout ``rows``, each row's step ``step_ids`` ``(rows,)`` and the steps'
token ``bounds`` (:func:`rldiag.engine.segments.step_token_bounds`). :func:`tis_statistics` returns
None where a weight is not finite (a NaN log-ratio, on or off the mask), for the caller to take
``is_weights``' general path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from rldiag.engine import diag_is_native, host, kernels
from rldiag.engine.layout import Rows
from rldiag.engine.rollout_correction import SAFETY_BOUND
from rldiag.engine.segments import MEAN_EPS, seg_count, seg_max, seg_min, seg_sum, step_mask_count

Metrics = dict[str, torch.Tensor]

__all__ = ["TISStatistics", "tis_statistics"]


@dataclass
class TISStatistics:
    """What :func:`tis_statistics` finds.

    Attributes:
        token_weights: ``(tokens,)`` float32 the token-level weights (0 off the mask).
        token: the token level's ``rollout_is_<stat>`` ``(n_steps,)``.
        seq_ratio: ``(rows,)`` float32 each row's untruncated sequence ratio.
        seq: the sequence level's ``rollout_is_<stat>`` ``(n_steps,)``.
    """

    token_weights: torch.Tensor
    token: Metrics
    seq_ratio: torch.Tensor
    seq: Metrics


def tis_statistics(log_ratio: torch.Tensor, mask: torch.Tensor, rows: Rows, step_ids: torch.Tensor, n: int,
                   bounds: list[int], threshold: float) -> TISStatistics | None:
    """The token and sequence levels' weights and ``rollout_is_{mean,max,min,std,eff_sample_size,
    ratio_fraction_high,ratio_fraction_low}`` per step (see the module); None where a token
    weight is not finite."""
    count = step_mask_count(mask, rows, step_ids, n)  # (n,) float32, remembered per mask
    den = count + MEAN_EPS
    w = torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND).exp_()
    # the bounds as 0-dim tensors of the weights' dtype: the comparison torch makes with a number
    up, lo = (torch.tensor(v, dtype=w.dtype, device=w.device) for v in (threshold, 1.0 / threshold))
    high = torch.zeros(n, dtype=torch.float32, device=w.device)
    low = torch.zeros_like(high)
    # on the host, each step's product by the mask, counts, truncation and extrema in one compiled
    # read (exact: the same values; rldiag.engine.diag_is_native), where the steps cover the tokens
    compiled = diag_is_native.usable(w, mask) and bounds[0] == 0 and bounds[-1] == w.numel()
    if not compiled:
        w.mul_(mask)  # raw weights, 0 off the mask
    # the log-ratios' products with the mask, for the rows' masked sums, in the same read
    products = torch.empty_like(w) if compiled and log_ratio.dtype == w.dtype and log_ratio.is_contiguous() else None
    extrema: dict[int, diag_is_native.StepCounts] = {}
    for s in range(n):
        a, b = bounds[s], bounds[s + 1]
        if a < b:  # off the mask the raw weight is 0: below lo, never above the threshold
            if compiled:
                extrema[s] = got = diag_is_native.step_counts(
                    w[a:b], mask[a:b], float(up), float(lo), threshold,
                    None if products is None else log_ratio[a:b], None if products is None else products[a:b])
                high[s], low[s] = got.above, got.below - (b - a)
            else:
                high[s] = host.count_above(w[a:b], up)
                low[s] = host.count_below(w[a:b], lo) - (b - a)
    low += count  # the actor tokens below lo: those below lo less the tokens off the mask
    if not compiled:
        w.clamp_(max=threshold)
    row_sum = rows.sum(w)
    if not bool(torch.isfinite(row_sum).all()):
        return None
    tok: Metrics = {}
    total = seg_sum(row_sum, step_ids, n)
    mean = total / den
    tok["rollout_is_mean"] = mean
    tok["rollout_is_ratio_fraction_high"] = high / den
    tok["rollout_is_ratio_fraction_low"] = low / den
    big = torch.full((), threshold, dtype=w.dtype, device=w.device)
    w_max = torch.full((n,), float("nan"), dtype=w.dtype, device=w.device)
    w_min = w_max.clone()
    # the deviations from the step's mean, and the normalised weights
    dev = torch.empty_like(w)
    norm = torch.empty_like(w) if compiled else dev
    # the step means and mean + 1e-8 (as torch adds a number to a float32 tensor: in float32)
    means, dens = mean.tolist(), (mean + MEAN_EPS).tolist()
    for s in range(n):
        a, b = bounds[s], bounds[s + 1]
        if a == b:
            continue
        if count[s] > 0 and s in extrema:
            w_max[s], w_min[s] = extrema[s].max, extrema[s].min
        elif count[s] > 0:  # a masked weight is > 0 (exp of at least -20), so above every off-mask 0
            w_max[s] = w[a:b].amax()
            w_min[s] = host.min_where(w[a:b], mask[a:b], big)
        if compiled:  # (w - mean)^2 m and (w / (mean + 1e-8))^2 in one read, the same float32 operations
            diag_is_native.spread(w[a:b], mask[a:b], means[s], dens[s], dev[a:b], norm[a:b])
        else:
            torch.sub(w[a:b], mean[s], out=dev[a:b])
    tok["rollout_is_max"], tok["rollout_is_min"] = w_max, w_min
    var = seg_sum(rows.sum(dev if compiled else dev.square_().mul_(mask)), step_ids, n) / den
    del dev
    std = torch.sqrt(torch.clamp(var, min=0.0))
    tok["rollout_is_std"] = torch.where(count > 1, std, torch.zeros_like(std))
    if not compiled:
        for s in range(n):
            a, b = bounds[s], bounds[s + 1]
            torch.div(w[a:b], mean[s:s + 1] + MEAN_EPS, out=norm[a:b])
        norm.square_()
    # the normalised weights are 0 off the mask (0 / mean), so their squares need no mask
    tok["rollout_is_eff_sample_size"] = 1.0 / (seg_sum(rows.sum(norm), step_ids, n) / den)
    del norm
    row_log = (rows.masked_sum(log_ratio, mask) if products is None
               else kernels.masked_row_sums_of(products, log_ratio, mask, rows))
    del products
    ratio, seq = _sequence(row_log, rows.mask_count(mask), step_ids, n, count, threshold)
    return TISStatistics(w, tok, ratio, seq)


def _sequence(row_log: torch.Tensor, row_count: torch.Tensor, step_ids: torch.Tensor, n: int, count: torch.Tensor,
              threshold: float) -> tuple[torch.Tensor, Metrics]:
    """The sequence level from the rows' summed log-ratios ``(rows,)`` and actor tokens
    ``row_count`` ``(rows,)``: each row's ratio ``(rows,)`` and the metrics ``(n,)``. A few
    operations over the rows (a 512-row step's are microseconds each): the sums that share a
    segment pass are stacked into one."""
    ratio = torch.exp(torch.clamp(row_log, -SAFETY_BOUND, SAFETY_BOUND))
    f64 = torch.float64
    w = ratio.clamp(max=threshold).to(f64)
    c = row_count.to(f64)
    den = count.to(f64) + MEAN_EPS
    mean = seg_sum(c * w, step_ids, n) / den
    row_mean = mean.index_select(0, step_ids)
    spread = torch.stack(((w - row_mean).square(), (w / (row_mean + MEAN_EPS)).square()), 1).mul_(c.unsqueeze(1))
    var, norm2 = (_seg_sums(spread, step_ids, n) / den.unsqueeze(1)).unbind(1)
    std = torch.sqrt(torch.clamp(var, min=0.0))
    log_up, log_lo = _log_bounds(threshold, row_log.device)
    beyond = _seg_sums(torch.stack((row_log > log_up, row_log < log_lo), 1).to(torch.float32), step_ids, n)
    beyond /= seg_count(step_ids, n).unsqueeze(1)  # NaN for a step without rows
    m: Metrics = {
        "rollout_is_max": torch.exp(torch.clamp(seg_max(row_log, step_ids, n), max=SAFETY_BOUND)),
        "rollout_is_min": torch.exp(seg_min(row_log, step_ids, n)),
        "rollout_is_mean": mean.to(torch.float32),
        "rollout_is_ratio_fraction_high": beyond[:, 0],
        "rollout_is_ratio_fraction_low": beyond[:, 1],
        "rollout_is_std": torch.where(count > 1, std, torch.zeros_like(std)).to(torch.float32),
        "rollout_is_eff_sample_size": (1.0 / norm2).to(torch.float32),
    }
    return ratio, m


def _seg_sums(x: torch.Tensor, seg: torch.Tensor, num: int) -> torch.Tensor:
    """Each column of ``x`` ``(rows, k)`` summed per segment ``(num, k)`` (empty segments: 0)."""
    return torch.zeros(num, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, seg, x)


@functools.cache
def _log_bounds(threshold: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """log(threshold) and log(1 / threshold) as float32 0-dim tensors, as verl's sequence level
    compares the rows' summed log-ratios with them (computed once per threshold and device)."""
    return (torch.log(torch.tensor(threshold, dtype=torch.float32, device=device)),
            torch.log(torch.tensor(1.0 / threshold, dtype=torch.float32, device=device)))
