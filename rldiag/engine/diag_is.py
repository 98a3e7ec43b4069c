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
import math
from dataclasses import dataclass

import numpy as np
import torch

from rldiag.engine import diag_is_native, host, kernels
from rldiag.engine.layout import Rows
from rldiag.engine.rollout_correction import SAFETY_BOUND
from rldiag.engine.segments import MEAN_EPS, seg_sum, step_mask_count

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
    highs, lows = [0] * n, [0] * n  # each step's counts (exact integers), one tensor each after
    # on the host, each step's product by the mask, counts, truncation and extrema in one compiled
    # read (exact: the same values; rldiag.engine.diag_is_native), where the steps cover the tokens
    compiled = diag_is_native.usable(w, mask) and bounds[0] == 0 and bounds[-1] == w.numel()
    # the bounds in the weights' dtype, the comparison torch makes with a number (0-dim tensors;
    # where compiled, float32 numbers: numpy rounds a float to float32 as torch does)
    up, lo = ((np.float32(threshold), np.float32(1.0 / threshold)) if compiled else
              (torch.tensor(v, dtype=w.dtype, device=w.device) for v in (threshold, 1.0 / threshold)))
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
                highs[s], lows[s] = got.above, got.below - (b - a)
            else:
                highs[s] = host.count_above(w[a:b], up)
                lows[s] = host.count_below(w[a:b], lo) - (b - a)
    high = torch.tensor(highs, dtype=torch.float32, device=w.device)
    # the actor tokens below lo: those below lo less the tokens off the mask
    low = torch.tensor(lows, dtype=torch.float32, device=w.device).add_(count)
    if not compiled:
        w.clamp_(max=threshold)
    row_sum = rows.sum(w)
    if not host.all_finite(row_sum):
        return None
    tok: Metrics = {}
    total = seg_sum(row_sum, step_ids, n)
    mean = total / den
    tok["rollout_is_mean"] = mean
    tok["rollout_is_ratio_fraction_high"] = high / den
    tok["rollout_is_ratio_fraction_low"] = low / den
    big = torch.full((), threshold, dtype=w.dtype, device=w.device)
    maxes: list[float] = [math.nan] * n  # each step's extrema, one tensor each after
    mins: list[float] = [math.nan] * n
    # the deviations from the step's mean, and the normalised weights
    dev = torch.empty_like(w)
    norm = torch.empty_like(w) if compiled else dev
    # the step means and mean + 1e-8 (as torch adds a number to a float32 tensor: in float32)
    means, dens, counts = mean.tolist(), (mean + MEAN_EPS).tolist(), count.tolist()
    for s in range(n):
        a, b = bounds[s], bounds[s + 1]
        if a == b:
            continue
        if counts[s] > 0 and s in extrema:
            maxes[s], mins[s] = extrema[s].max, extrema[s].min
        elif counts[s] > 0:  # a masked weight is > 0 (exp of at least -20), so above every off-mask 0
            maxes[s] = float(w[a:b].amax())
            mins[s] = float(host.min_where(w[a:b], mask[a:b], big))
        if compiled:  # (w - mean)^2 m and (w / (mean + 1e-8))^2 in one read, the same float32 operations
            diag_is_native.spread(w[a:b], mask[a:b], means[s], dens[s], dev[a:b], norm[a:b])
        else:
            torch.sub(w[a:b], mean[s], out=dev[a:b])
    tok["rollout_is_max"], tok["rollout_is_min"] = torch.tensor([maxes, mins], dtype=w.dtype, device=w.device).unbind(0)
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
    ``row_count`` ``(rows,)`` of rows in step order: each row's ratio ``(rows,)`` and the metrics
    ``(n,)``. The rows' arithmetic is on the host: one compiled call where the library was built
    (:func:`rldiag.engine.diag_is_native.sequence`), else its numpy twin :func:`_sequence_table`
    (the same bits; rows-sized arrays, where torch's dispatch costs 5-10 us an operation; a copy
    from another device). The float32 exponentials stay torch's, as verl's."""
    ratio = torch.exp(torch.clamp(row_log, -SAFETY_BOUND, SAFETY_BOUND))
    log_up, log_lo = _log_bounds(threshold)
    v = host.values
    args = (v(ratio), v(row_log), v(row_count), v(step_ids), v(count), threshold, log_up, log_lo)
    table = diag_is_native.sequence(*args, MEAN_EPS) if diag_is_native.built() else _sequence_table(*args)
    t = torch.from_numpy(table).to(row_log.device)
    ext = t[5:7]  # each step's largest and least summed log-ratio, to their ratios (NaN where no row)
    ext[0].clamp_(max=SAFETY_BOUND)
    ext.exp_()
    names = (name.removesuffix("_log") for name in diag_is_native.SEQUENCE_ROWS)  # max_log's row is now max's
    m: Metrics = {f"rollout_is_{name}": row for name, row in zip(names, t.unbind(0), strict=True)}
    return ratio, m


def _sequence_table(ratio: np.ndarray, log32: np.ndarray, row_count: np.ndarray, sid: np.ndarray, count: np.ndarray,
                    threshold: float, log_up: np.float32, log_lo: np.float32) -> np.ndarray:
    """:func:`rldiag.engine.diag_is_native.sequence`'s table ``(7, n)`` float32 by numpy (its twin):
    the mean, std and effective sample size of the weights ``min(ratio, threshold)`` over each step's
    actor tokens in float64 (a row's weight on its ``row_count`` tokens; the per-step sums in the
    rows' order, as ``bincount``'s), the shares of rows above and below the bounds, and each step's
    largest and least summed log-ratio (NaN where it has no row)."""
    n = count.shape[0]
    w = np.minimum(ratio, np.float32(threshold)).astype(np.float64)
    c = row_count.astype(np.float64)
    den = count.astype(np.float64) + MEAN_EPS
    mean = np.bincount(sid, weights=c * w, minlength=n)[:n] / den
    row_mean = mean[sid]
    var = np.bincount(sid, weights=(w - row_mean) ** 2 * c, minlength=n)[:n] / den
    norm2 = np.bincount(sid, weights=(w / (row_mean + MEAN_EPS)) ** 2 * c, minlength=n)[:n] / den
    std = np.where(count > 1, np.sqrt(np.maximum(var, 0.0)), 0.0)
    rows_of = np.bincount(sid, minlength=n)[:n].astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):  # a step without rows: NaN
        high = np.bincount(sid, weights=log32 > log_up, minlength=n)[:n].astype(np.float32) / rows_of
        low = np.bincount(sid, weights=log32 < log_lo, minlength=n)[:n].astype(np.float32) / rows_of
        ess = 1.0 / norm2
    # each step's largest and least summed log-ratio (rows in step order: a slice each)
    first = np.searchsorted(sid, np.arange(n + 1))
    some = first[1:] > first[:-1]
    ext = np.full((2, n), np.nan, dtype=np.float32)
    if log32.size:
        ext[0, some] = np.maximum.reduceat(log32, first[:-1][some])
        ext[1, some] = np.minimum.reduceat(log32, first[:-1][some])
    return np.concatenate([np.stack([mean, std, ess]).astype(np.float32), np.stack([high, low]), ext])


@functools.cache
def _log_bounds(threshold: float) -> tuple[np.float32, np.float32]:
    """log(threshold) and log(1 / threshold) as torch's float32 logs, as verl's sequence level
    compares the rows' summed log-ratios with them (computed once per threshold)."""
    up, lo = (torch.log(torch.tensor(v, dtype=torch.float32, device="cpu")).item() for v in (threshold, 1.0 / threshold))
    return np.float32(up), np.float32(lo)
