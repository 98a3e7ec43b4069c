"""Fingerprints of a rollout-vs-trainer log-prob mismatch, per step.

The inference engine's log-probs (``rollout_log_probs``, ``y``) and the trainer's
(``old_log_probs``, ``x``) of the same sampled tokens differ for a handful of usual reasons, and
each leaves its own mark on the gap ``d = x - y = log(pi_old / pi_rollout)``:

- sampling truncation (top-p / top-k log-probs renormalised over the kept set): ``d = log(kept
  mass) <= 0`` on every token (``positive_share`` near 0);
- a temperature applied on one side only: ``x`` is close to a multiple of ``y`` (``slope``, the
  least-squares slope of ``x`` on ``y``, away from 1), ``d`` strongly correlated with ``y``, of
  opposite signs on confident and unconfident tokens (``gap_confident``, ``gap_unconfident``);
- numeric precision (bf16 inference, other kernels): small, symmetric, uncorrelated with ``y``;
- misalignment (an off-by-one): ``y`` agrees with ``x`` shifted by one position far better than
  with ``x`` (``shift_{next,prev}_abs_gap`` against ``pair_abs_gap``);
- policy lag (asynchronous rollouts): the gap grows with each row's lag ``step - 1 -
  policy_version`` (``lag_gap_corr``, ``lag_abs_gap_*``);
- outlier tokens: a handful of tokens hold most of the summed KL (``top_kl_share``: the share of
  ``sum(d^2 / 2)``, the k2 estimator, held by the top 1 % of tokens).

:func:`mismatch_stats` computes them in one pass over a packed batch's actor tokens (mask 1;
verl's agent loop stores 0.0 as the rollout log-prob of a tool token, so those are left out);
deciding which causes hold is :mod:`rldiag.analysis.mismatch`'s. Every input is flat
``(tokens,)`` (or ``(rows,)``) and every output ``(n_steps,)`` float64: NaN only for a step
without actor tokens; a statistic with nothing to measure otherwise has its neutral value (a
correlation or slope of a constant series 0, ``positive_share`` of equal streams 0.5, a mean over
no token 0 — the ``*_share`` statistics say how many tokens it had), so that the metrics of
ordinary runs hold no NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rldiag.engine.layout import Rows
from rldiag.engine.segments import seg_count, seg_max, seg_sum

#: the share of a step's tokens whose summed k2 ``top_kl_share`` reports
TOP_SHARE = 0.01
#: ``gap_abs_p99``'s quantile
QUANTILE = 0.99
#: a token is confident when the rollout gave it at least this probability, unconfident below
#: ``UNCONFIDENT``: ``gap_confident`` / ``gap_unconfident`` average ``d`` over each
CONFIDENT = math.log(0.5)
UNCONFIDENT = math.log(0.05)

#: every statistic :func:`mismatch_stats` returns (without lag data the ``lag_*`` ones are absent)
STATS = (
    "tokens", "gap_mean", "gap_std", "gap_abs_mean", "gap_abs_p99", "gap_abs_max", "kl_k2", "top_kl_share",
    "positive_share", "slope", "gap_rollout_corr", "logprob_corr", "gap_confident", "gap_unconfident",
    "confident_share", "unconfident_share", "gap_position_corr", "gap_logprob_corr", "pair_abs_gap",
    "shift_next_abs_gap", "shift_prev_abs_gap",
)
LAG_STATS = ("lag_mean", "lag_gap_corr", "lag_gap_slope", "lag_abs_gap_lag0", "lag_abs_gap_lagged", "lag0_share")


@dataclass(frozen=True)
class ActorTokens:
    """The actor tokens of a packed batch, compacted: ``x`` (trainer) and ``y`` (rollout)
    log-probs, ``d = x - y``, each token's step, row and position; all ``(n,)``."""

    x: torch.Tensor  # float64
    y: torch.Tensor  # float64
    d: torch.Tensor  # float64
    step: torch.Tensor  # int64 in [0, n_steps)
    row: torch.Tensor  # int64, the batch's row
    pos: torch.Tensor  # int64, the position in the row
    index: torch.Tensor  # int64, the token's index in the batch's flat tensors


def actor_tokens(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, rows: Rows,
                 step_ids: torch.Tensor) -> ActorTokens:
    """The tokens with mask 1 and finite log-probs on both sides, in the batch's order.
    ``old``, ``rollout``, ``mask``: ``(tokens,)``; ``step_ids``: ``(rows,)``."""
    keep = (mask > 0) & torch.isfinite(old) & torch.isfinite(rollout)
    index = keep.nonzero().squeeze(1)
    x = old.index_select(0, index).to(torch.float64)
    y = rollout.index_select(0, index).to(torch.float64)
    row = rows.row_ids.index_select(0, index)
    pos = index - rows.offsets.index_select(0, row)
    return ActorTokens(x, y, x - y, step_ids.index_select(0, row), row, pos, index)


def _mean(v: torch.Tensor, seg: torch.Tensor, n: int, count: torch.Tensor) -> torch.Tensor:
    return seg_sum(v, seg, n) / count


def _ratio(num: torch.Tensor, den: torch.Tensor, when_zero: float, count: torch.Tensor) -> torch.Tensor:
    """``num / den``, ``when_zero`` where ``den`` is 0, NaN where the step has no token (``count`` 0)."""
    out = torch.where(den != 0, num / torch.where(den != 0, den, torch.ones_like(den)), torch.full_like(den, when_zero))
    return torch.where(count > 0, out, torch.full_like(out, float("nan")))


def _moments(a: torch.Tensor, b: torch.Tensor, seg: torch.Tensor, n: int,
             count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-segment ``(cov(a, b), var(a), var(b))`` (population), two-pass for accuracy."""
    da = a - _mean(a, seg, n, count)[seg]
    db = b - _mean(b, seg, n, count)[seg]
    return (seg_sum(da * db, seg, n) / count, seg_sum(da * da, seg, n) / count, seg_sum(db * db, seg, n) / count)


def _corr(a: torch.Tensor, b: torch.Tensor, seg: torch.Tensor, n: int, count: torch.Tensor) -> torch.Tensor:
    """Pearson correlation per segment; 0 where either series is constant."""
    cov, va, vb = _moments(a, b, seg, n, count)
    return _ratio(cov, (va * vb).sqrt(), 0.0, count)


def _sorted_tails(t: ActorTokens, n: int, count: torch.Tensor) -> dict[str, torch.Tensor]:
    """``gap_abs_p99`` (linear interpolation, as ``torch.quantile``) and ``top_kl_share`` from
    one sort of ``|d|`` grouped by step."""
    absd = t.d.abs()
    order = torch.argsort(absd, stable=True)
    if n > 1:
        order = order.index_select(0, torch.argsort(t.step.index_select(0, order), stable=True))
    sorted_abs = absd.index_select(0, order)
    k2 = 0.5 * sorted_abs * sorted_abs
    counts = count.to(torch.long)
    start = torch.cumsum(counts, 0) - counts
    has = counts > 0
    nan = torch.full((n,), float("nan"), dtype=torch.float64, device=absd.device)
    # the quantile at (count - 1) * q between its two neighbours
    h = (count - 1).clamp_min(0) * QUANTILE
    lo = h.floor().to(torch.long)
    hi = torch.minimum(lo + 1, (counts - 1).clamp_min(0))
    last = max(sorted_abs.numel() - 1, 0)
    if sorted_abs.numel():
        v_lo = sorted_abs[(start + lo).clamp(0, last)]
        v_hi = sorted_abs[(start + hi).clamp(0, last)]
        p99 = torch.where(has, v_lo + (h - lo) * (v_hi - v_lo), nan)
    else:
        p99 = nan
    # the top tokens' and all tokens' k2 summed per step (not as differences of one running sum
    # over the pack, so that a step's value is the same whatever steps it is packed with)
    top = torch.ceil(count * TOP_SHARE).to(torch.long)
    step_sorted = t.step.index_select(0, order)
    rank = torch.arange(sorted_abs.numel(), device=absd.device) - start.index_select(0, step_sorted)
    in_top = (rank >= (counts - top).index_select(0, step_sorted)).to(torch.float64)
    total = seg_sum(k2, step_sorted, n)
    return {"gap_abs_p99": p99, "top_kl_share": _ratio(seg_sum(k2 * in_top, step_sorted, n), total, 0.0, count)}


def _shift(t: ActorTokens, n: int) -> dict[str, torch.Tensor]:
    """The rollout series against the trainer's shifted by one position: pairs of actor tokens
    next to each other in a row; ``next``: ``|y_t - x_{t+1}|``, ``prev``: ``|y_{t+1} - x_t|``,
    ``pair``: the unshifted ``|d_t|`` over the same pairs."""
    adj = (t.row[1:] == t.row[:-1]) & (t.pos[1:] == t.pos[:-1] + 1)
    seg = t.step[:-1][adj]
    cnt = seg_count(seg, n, torch.float64)
    pair = (t.d[:-1][adj].abs() + t.d[1:][adj].abs()) * 0.5
    nxt = (t.y[:-1][adj] - t.x[1:][adj]).abs()
    prv = (t.y[1:][adj] - t.x[:-1][adj]).abs()
    count = seg_count(t.step, n, torch.float64)
    return {"pair_abs_gap": _ratio(seg_sum(pair, seg, n), cnt, 0.0, count),
            "shift_next_abs_gap": _ratio(seg_sum(nxt, seg, n), cnt, 0.0, count),
            "shift_prev_abs_gap": _ratio(seg_sum(prv, seg, n), cnt, 0.0, count)}


def _lag(t: ActorTokens, lag_rows: torch.Tensor, n_rows: int, n: int) -> dict[str, torch.Tensor]:
    """The gap against each row's policy lag ``(rows,)``: over rows with actor tokens, the
    correlation and least-squares slope of the row's mean ``|d|`` on its lag (0 when the lag is
    the same for every row), the mean lag, the mean ``|d|`` over the tokens of on-policy (lag 0)
    and of lagged rows (0 without such rows), and the share of tokens in on-policy rows."""
    absd = t.d.abs()
    row_tokens = seg_count(t.row, n_rows, torch.float64)
    row_gap = seg_sum(absd, t.row, n_rows) / row_tokens
    has = row_tokens > 0
    lag = lag_rows.to(torch.float64)
    row_step = torch.zeros(n_rows, dtype=torch.long, device=lag.device)
    row_step.index_copy_(0, t.row, t.step)
    seg, lg, gp = row_step[has], lag[has], row_gap[has]
    cnt = seg_count(seg, n, torch.float64)
    cov, vl, _ = _moments(lg, gp, seg, n, cnt)
    tok_lag = lag.index_select(0, t.row)
    on = (tok_lag == 0).to(torch.float64)
    count = seg_count(t.step, n, torch.float64)
    on_cnt, off_cnt = seg_sum(on, t.step, n), seg_sum(1 - on, t.step, n)
    return {
        "lag_mean": _mean(lg, seg, n, cnt),
        "lag_gap_corr": _corr(lg, gp, seg, n, cnt),
        "lag_gap_slope": _ratio(cov, vl, 0.0, cnt),
        "lag_abs_gap_lag0": _ratio(seg_sum(absd * on, t.step, n), on_cnt, 0.0, count),
        "lag_abs_gap_lagged": _ratio(seg_sum(absd * (1 - on), t.step, n), off_cnt, 0.0, count),
        "lag0_share": on_cnt / count,
    }


def mismatch_stats(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, rows: Rows,
                   step_ids: torch.Tensor, n_steps: int, lag: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Each step's fingerprint statistics (:data:`STATS`, and :data:`LAG_STATS` with ``lag``).

    Args:
        old: ``(tokens,)`` the trainer's log-probs (``old_log_probs``).
        rollout: ``(tokens,)`` the rollout engine's (``rollout_log_probs``).
        mask: ``(tokens,)`` 1 on actor tokens.
        rows: the token layout; ``step_ids``: ``(rows,)`` each row's step in ``[0, n_steps)``.
        lag: ``(rows,)`` each row's policy lag (``step - 1 - policy_version``), or None.

    Returns ``name -> (n_steps,)`` float64.
    """
    t = actor_tokens(old, rollout, mask, rows, step_ids)
    n = n_steps
    count = seg_count(t.step, n, torch.float64)
    d, absd = t.d, t.d.abs()
    mean = _mean(d, t.step, n, count)
    dev = d - mean[t.step]
    abs_sum = seg_sum(absd, t.step, n)
    out = {
        "tokens": count,
        "gap_mean": mean,
        "gap_std": (seg_sum(dev * dev, t.step, n) / count).sqrt(),
        "gap_abs_mean": abs_sum / count,
        "gap_abs_max": seg_max(absd, t.step, n),
        "kl_k2": _mean(0.5 * d * d, t.step, n, count),
        "positive_share": _ratio(seg_sum(d.clamp_min(0), t.step, n), abs_sum, 0.5, count),
    }
    out.update(_sorted_tails(t, n, count))
    cov, _, vy = _moments(t.x, t.y, t.step, n, count)
    out["slope"] = _ratio(cov, vy, 1.0, count)  # x on y: T_roll / T_train; 1 for a constant rollout series
    out["gap_rollout_corr"] = _corr(d, t.y, t.step, n, count)
    out["logprob_corr"] = _corr(t.x, t.y, t.step, n, count)
    conf, unconf = (t.y >= CONFIDENT).to(torch.float64), (t.y < UNCONFIDENT).to(torch.float64)
    n_conf, n_unconf = seg_sum(conf, t.step, n), seg_sum(unconf, t.step, n)
    out["gap_confident"] = _ratio(seg_sum(d * conf, t.step, n), n_conf, 0.0, count)
    out["gap_unconfident"] = _ratio(seg_sum(d * unconf, t.step, n), n_unconf, 0.0, count)
    out["confident_share"], out["unconfident_share"] = n_conf / count, n_unconf / count
    out["gap_position_corr"] = _corr(absd, t.pos.to(torch.float64), t.step, n, count)
    out["gap_logprob_corr"] = _corr(absd, t.y.abs(), t.step, n, count)
    out.update(_shift(t, n))
    if lag is not None:
        out.update(_lag(t, lag, rows.n_rows, n))
    return out


@dataclass(frozen=True)
class GapTokens:
    """The tokens with the largest gaps: ``(k,)`` each, largest ``d^2 / 2`` first."""

    index: torch.Tensor  # int64, the token's index in the batch's flat tensors
    row: torch.Tensor  # int64
    pos: torch.Tensor  # int64
    step: torch.Tensor  # int64 in [0, n_steps)
    old: torch.Tensor  # float64
    rollout: torch.Tensor  # float64
    kl: torch.Tensor  # float64, d^2 / 2
    share: torch.Tensor  # float64, kl over the summed kl of the tokens' step


def top_gap_tokens(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, rows: Rows,
                   step_ids: torch.Tensor, n_steps: int, k: int) -> GapTokens:
    """The ``k`` actor tokens holding the most of the k2 KL (``d^2 / 2``) over the batch."""
    t = actor_tokens(old, rollout, mask, rows, step_ids)
    kl = 0.5 * t.d * t.d
    total = seg_sum(kl, t.step, n_steps)
    top = torch.topk(kl, min(k, kl.numel())).indices
    step = t.step[top]
    return GapTokens(t.index[top], t.row[top], t.pos[top], step, t.x[top], t.y[top], kl[top],
                     kl[top] / total[step].clamp_min(torch.finfo(torch.float64).tiny))
