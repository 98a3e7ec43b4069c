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

Two more statistics put the gap in the units other frameworks log, so that their users can read
it: ``token_mult_prob_error``, the token mean of ``exp(|d|)`` (NeMo RL's metric of that name:
``nemo_rl/algorithms/loss_functions.py``, ``ClippedPGLossFn.__call__``, a masked mean of
``exp(|generation_logprobs - prev_logprobs|)`` over the valid tokens; 1 when the two agree), and
``extreme_share``, the share of tokens with ``|d| > ln 2``, whose probability ratio leaves
``[1/2, 2]`` (the ``F(tau)`` extreme-token fraction at ``tau = 2`` of the Router Replay paper,
arXiv 2510.11370, as AReaL logs it: ``rollout_train_extreme_frac_tau2``,
``areal/trainer/ppo/actor.py``, ``PPOActor._log_r3_effectiveness_stats``, inclusionAI/AReaL pull
request 1207).

:func:`mismatch_stats` computes them in one pass over each step's actor tokens (mask 1;
verl's agent loop stores 0.0 as the rollout log-prob of a tool token, so those are left out),
chunk by chunk on the host (:mod:`rldiag.engine.mismatch_scan`: numpy, float64 per chunk, never a
token-sized copy; the quantiles selected among the tokens above a threshold, no sort); deciding
which causes hold is :mod:`rldiag.analysis.mismatch`'s. Every input is flat
``(tokens,)`` (or ``(rows,)``) and every output ``(n_steps,)`` float64: NaN only for a step
without actor tokens; a statistic with nothing to measure otherwise has its neutral value (a
correlation or slope of a constant series 0, ``positive_share`` of equal streams 0.5, a mean over
no token 0 — the ``*_share`` statistics say how many tokens it had), so that the metrics of
ordinary runs hold no NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from rldiag.engine import mismatch_native as native
from rldiag.engine import mismatch_scan as scan
from rldiag.engine import mismatch_sums as sums
from rldiag.engine.layout import Rows
from rldiag.engine.mismatch_body import BODY, LAG, body_chunk
from rldiag.engine.mismatch_scan import CONFIDENT as CONFIDENT
from rldiag.engine.mismatch_scan import EXTREME as EXTREME
from rldiag.engine.mismatch_scan import UNCONFIDENT as UNCONFIDENT
from rldiag.engine.segments import seg_count, seg_sum

#: the share of a step's tokens whose summed k2 ``top_kl_share`` reports
TOP_SHARE = 0.01
#: ``gap_abs_p99``'s quantile
QUANTILE = 0.99
#: ``gap_abs_p95``'s quantile: the body of a step's gap (the ``body_*`` statistics) is its tokens
#: with ``|d|`` at most this quantile, so that a handful of outlier tokens (up to 5 %) is left out
BODY_QUANTILE = 0.95
#: a token is confident when the rollout gave it at least probability 1/2 (``CONFIDENT``, a
#: log-prob), unconfident below 1/20 (``UNCONFIDENT``): ``gap_confident`` / ``gap_unconfident``
#: average ``d`` over each; ``extreme_share`` counts the tokens with ``|d|`` above ``EXTREME``
#: (a probability ratio outside [1/2, 2]); all three are defined with the pass that counts them
#: the most a moment may lose to cancellation: a step's moments from plain product sums, and
#: the body's as the step's less its excluded tokens', are used while a series' ``n mean^2`` (the
#: body's: the step's variance or summed ``|d|``) stays within this factor of its variance (its
#: own); past it the step is rescanned centred, the body summed on its own
CANCEL = 2.0 ** 16

#: every statistic :func:`mismatch_stats` returns (without lag data the ``lag_*`` ones are absent)
STATS = (
    "tokens", "gap_mean", "gap_std", "gap_abs_mean", "gap_abs_p99", "gap_abs_p95", "gap_abs_max", "kl_k2", "top_kl_share",
    "positive_share", "slope", "gap_rollout_corr", "logprob_corr", "gap_confident", "gap_unconfident",
    "confident_share", "unconfident_share", "gap_position_corr", "gap_logprob_corr", "pair_abs_gap",
    "shift_next_abs_gap", "shift_prev_abs_gap", "token_mult_prob_error", "extreme_share",
    "body_gap_mean", "body_gap_std", "body_positive_share", "body_slope", "body_gap_rollout_corr", "half_share",
)
LAG_STATS = ("lag_mean", "lag_gap_corr", "lag_gap_slope", "lag_abs_gap_lag0", "lag_abs_gap_lagged", "lag0_share",
             "lag_body_std_lag0", "lag_body_std_lagged", "lag0_positive_share")


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


def _dev(v: torch.Tensor, seg: torch.Tensor, n: int, count: torch.Tensor) -> torch.Tensor:
    return v - _mean(v, seg, n, count).index_select(0, seg)


def _moments(a: torch.Tensor, b: torch.Tensor, seg: torch.Tensor, n: int,
             count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-segment ``(cov(a, b), var(a), var(b))`` (population), two-pass for accuracy."""
    da, db = _dev(a, seg, n, count), _dev(b, seg, n, count)
    return (seg_sum(da * db, seg, n) / count, seg_sum(da * da, seg, n) / count, seg_sum(db * db, seg, n) / count)


def _corr_of(cov: torch.Tensor, va: torch.Tensor, vb: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Pearson correlation from the moments; 0 where either series is constant."""
    return _ratio(cov, (va * vb).sqrt(), 0.0, count)


def _corr(a: torch.Tensor, b: torch.Tensor, seg: torch.Tensor, n: int, count: torch.Tensor) -> torch.Tensor:
    """Pearson correlation per segment; 0 where either series is constant."""
    return _corr_of(*_moments(a, b, seg, n, count), count)


def _div(num: float, den: float, when_zero: float) -> float:
    return num / den if den != 0 else when_zero


def _corr_f(cov: float, va: float, vb: float) -> float:
    """Pearson correlation from population moments; 0 where either series is constant."""
    return _div(cov, math.sqrt(va * vb), 0.0)


@dataclass
class _Tails:
    """A step's order statistics of ``|d|`` and its actor tokens at or above the threshold
    :func:`_tails` read back (``d``, ``y``: float64); how many have ``|d|`` above
    :data:`EXTREME`."""

    p99: float
    p95: float
    top_sum: float
    largest: float
    d: np.ndarray
    y: np.ndarray
    n_extreme: int


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _pick_again(inp: scan.Inputs, buf: scan.Buffers, ranges: list[tuple[int, int]], picked: scan.Picked,
                need: int) -> scan.Picked:
    """Where fewer than ``need`` tokens reached the step's threshold: the step's tokens read
    again, keeping those that reach a lower one (twice the share ``need`` is of the step's
    tokens in the step's sample; every token above 0 where that is no lower)."""
    sample = np.concatenate(picked.sample)
    size = sum(b - a for a, b in ranges)
    lower = scan.threshold(sample, min(1.0, 2.0 * need / size))
    again = scan.Picked(lower if 0 < lower < picked.threshold else 0.0)
    for a, m, me, _ in scan.chunks(ranges, buf.size):
        scan.pick(buf, scan.load(inp, buf, a, m, me), again)
    return again


def _tails(picked: scan.Picked, n: int) -> _Tails:
    """``gap_abs_p99`` and ``gap_abs_p95`` (linear interpolation between the two neighbouring
    order statistics, as ``torch.quantile``), the top 1 %'s summed ``d^2 / 2`` and the largest
    ``|d|``, from the step's picked tokens (:class:`rldiag.engine.mismatch_scan.Picked`): every
    token that reaches the threshold is picked, so they are the step's top ``|S|`` (with a
    threshold <= 0, every token above 0, the others exactly 0). The top ``k + 1`` are selected
    and sorted (the top 1 % and the 99th percentile's neighbours), the 95th's neighbours
    selected among the rest (``np.partition``): the order statistics are exact float64 values,
    and the top tokens' ``d^2 / 2`` are added smallest first. Where the library is built, its
    radix selection gives the same order statistics, and the top's sum in four lanes
    (:func:`rldiag.engine.mismatch_native.select`)."""
    ranks = []
    for q in (QUANTILE, BODY_QUANTILE):
        h = (n - 1) * q
        lo = math.floor(h)
        ranks.append((h, lo, min(lo + 1, n - 1)))
    k = math.ceil(n * TOP_SHARE)
    d, y = _joined(picked.d), _joined(picked.y)
    size = d.shape[0]
    below = n - size
    lowest = min(ranks[1][1], n - k)
    if picked.threshold > 0 and below > lowest:
        raise AssertionError(f"mismatch tails: {size} tokens picked for ranks from {lowest} of {n}")
    if native.built():  # the compiled radix selection
        want = sorted({r - below for _, lo, hi in ranks for r in (lo, hi) if r - below >= 0} | {size - 1} - {-1})
        vals, top_sum, n_extreme = native.select(d, want, min(k, size), EXTREME)
        value = dict(zip(want, vals.tolist(), strict=True))
        p99, p95 = ((value.get(lo - below, 0.0) + (h - lo) * (value.get(hi - below, 0.0) - value.get(lo - below, 0.0)))
                    for h, lo, hi in ranks)
        return _Tails(p99, p95, top_sum, value[size - 1] if size else 0.0, d, y, n_extreme)
    a = np.abs(d)
    # the top k + 1 selected and sorted (smallest first: the top 1 % and the 99th percentile's
    # neighbours, which are among them), then the 95th's neighbours selected below them
    t = min(size, k + 1)
    part = np.partition(a, size - t) if 0 < t < size else a
    top = np.sort(part[size - t:])
    lower = sorted({r - below for _, lo, hi in ranks for r in (lo, hi) if 0 <= r - below < size - t})
    rest = np.partition(part[: size - t], lower) if lower else part

    def rank(r: int) -> float:
        i = r - below
        if i < 0:
            return 0.0  # below the picked tokens: |d| = 0
        return float(top[i - (size - t)]) if i >= size - t else float(rest[i])

    p99, p95 = (rank(lo) + (h - lo) * (rank(hi) - rank(lo)) for h, lo, hi in ranks)
    top = top[max(t - k, 0):]
    top_sum = float(np.cumsum(0.5 * top * top)[-1]) if top.shape[0] else 0.0
    return _Tails(p99, p95, top_sum, float(top[-1]) if top.shape[0] else 0.0, d, y,
                  int(np.count_nonzero(a > EXTREME)))


def _excluded_body(whole: dict[str, float], tails: _Tails) -> dict[str, float] | None:
    """The body's moments (as :data:`rldiag.engine.mismatch_BODY`) as the step's less
    those of its tokens above ``gap_abs_p95`` (Chan et al.'s update reversed), or None where the
    subtraction would cancel more than :data:`CANCEL` of a variance or of the summed ``|d|``."""
    n = whole["n"]
    base = {"n": n, "s_d": whole["s_d"], "s_y": whole["s_y"], "s_a": whole["s_a"], "m_dd": whole["m_dd"],
            "m_dy": whole["m_dy"], "m_yy": whole["m_yy"]}
    if native.built():  # both passes over the picks compiled
        n_e, *vals = native.above(tails.d, tails.y, tails.p95).tolist()
        if n_e == 0:
            return base
        e = dict(zip(("s_d", "s_y", "s_a", "m_dd", "m_dy", "m_yy"), vals, strict=True))
    else:
        a = np.abs(tails.d)
        out = np.flatnonzero(a > tails.p95)  # indices, then takes: cheaper than boolean indexing
        n_e = out.shape[0]
        if n_e == 0:
            return base
        d, y, a = tails.d.take(out), tails.y.take(out), a.take(out)
        sd, sy = float(d.sum()), float(y.sum())
        cd, cy = d - sd / n_e, y - sy / n_e
        e = {"s_d": sd, "s_y": sy, "s_a": float(a.sum()), "m_dd": sums.bdot(cd, cd), "m_dy": sums.bdot(cd, cy),
             "m_yy": sums.bdot(cy, cy)}
    n_b = n - n_e
    body = {"n": n_b, **{k: base[k] - e[k] for k in ("s_d", "s_y", "s_a")}}
    dd = e["s_d"] / n_e - body["s_d"] / n_b
    dy = e["s_y"] / n_e - body["s_y"] / n_b
    w = n_b * n_e / n
    body["m_dd"] = base["m_dd"] - e["m_dd"] - w * dd * dd
    body["m_dy"] = base["m_dy"] - e["m_dy"] - w * dd * dy
    body["m_yy"] = base["m_yy"] - e["m_yy"] - w * dy * dy
    for k, total in (("m_dd", base["m_dd"]), ("m_yy", base["m_yy"]), ("s_a", base["s_a"])):
        if body[k] * CANCEL < total:
            return None
    return body


def _combine_body(rec: np.ndarray, lag: bool) -> dict[str, float]:
    """A step's body (and lag) quantities from its :func:`rldiag.engine.mismatch_body_chunk` records."""
    b = {k: i for i, k in enumerate(BODY + (LAG if lag else ()))}
    n, s, m = sums.combine(rec, b["n"], slice(b["s_d"], b["s_y"] + 1), ((0, 0), (0, 1), (1, 1)),
                           slice(b["m_dd"], b["m_yy"] + 1))
    out = {"n": n, "s_d": float(s[0]), "s_y": float(s[1]), "s_a": float(rec[:, b["s_a"]].sum()),
           "m_dd": float(m[0]), "m_dy": float(m[1]), "m_yy": float(m[2])}
    if lag:
        for part in ("on", "off"):
            pn, ps, pm = sums.combine(rec, b[f"{part}_n"], slice(b[f"{part}_s_d"], b[f"{part}_s_d"] + 1), ((0, 0),),
                                      slice(b[f"{part}_m_dd"], b[f"{part}_m_dd"] + 1))
            out.update({f"{part}_n": pn, f"{part}_s_d": float(ps[0]), f"{part}_m_dd": float(pm[0])})
        for k in ("on_s_a", "lag0_n", "lag0_s_a", "lagged_n", "lagged_s_a"):
            out[k] = float(rec[:, b[k]].sum())
    return out


def _whole(rec: np.ndarray, centred: bool) -> dict[str, float] | None:
    """A step's quantities (:data:`rldiag.engine.mismatch_scan.FIELDS`: the moments centred on
    the step's means) from its chunk records ``(chunks, fields)``; None where records of plain
    sums of products (not ``centred``) cancel more than :data:`CANCEL` of a variance away (the
    trainer's ``sum x x = sum d d + 2 sum d y + sum y y`` included)."""
    f = scan.F
    how = sums.combine if centred else sums.combine_raw
    n, s, m = how(rec, f["n"], slice(f["s_d"], f["s_x"] + 1), scan.PAIRS, slice(f["m_dd"], f["m_xy"] + 1))
    total = rec.sum(0)
    if not centred and n > 0:
        if sums.cancels(n, s.tolist(), m.tolist(), scan.PAIRS, CANCEL):
            return None
        if (total[f["m_dd"]] + total[f["m_yy"]]) > CANCEL * total[f["m_xx"]]:
            return None
    out = dict(zip(scan.FIELDS, total.tolist(), strict=True))
    out.update(zip(scan.FIELDS[f["s_d"]: f["m_xy"] + 1], s.tolist() + m.tolist(), strict=True))
    out["n"] = n
    return out


def _whole_stats(w: dict[str, float]) -> dict[str, float]:
    n = w["n"]
    var_d, var_x, var_y = w["m_dd"] / n, w["m_xx"] / n, w["m_yy"] / n
    cov_xy = w["m_xy"] / n
    var_a = w["m_aa"] / n
    return {
        "tokens": n, "gap_mean": w["s_d"] / n, "gap_std": math.sqrt(max(var_d, 0.0)), "gap_abs_mean": w["s_a"] / n,
        "kl_k2": 0.5 * w["d2"] / n,
        # sum of max(d, 0) = (sum |d| + sum d) / 2: exactly 0 (1) where every d <= 0 (>= 0)
        "positive_share": _div(0.5 * (w["s_a"] + w["s_d"]), w["s_a"], 0.5),
        "slope": _div(cov_xy, var_y, 1.0),  # x on y: T_roll / T_train; 1 for a constant rollout series
        "gap_rollout_corr": _corr_f(w["m_dy"] / n, var_d, var_y),
        "logprob_corr": _corr_f(cov_xy, var_x, var_y),
        "gap_confident": _div(w["d_conf"], w["n_conf"], 0.0),
        "gap_unconfident": _div(w["d_unconf"], w["n_unconf"], 0.0),
        "confident_share": w["n_conf"] / n, "unconfident_share": w["n_unconf"] / n,
        "gap_position_corr": _corr_f(w["m_ap"] / n, var_a, w["m_pp"] / n),
        "gap_logprob_corr": _corr_f(w["m_aya"] / n, var_a, w["m_yaya"] / n),
        "pair_abs_gap": _div(0.5 * w["pair_abs"], w["pairs"], 0.0),
        "shift_next_abs_gap": _div(w["shift_next"], w["pairs"], 0.0),
        "shift_prev_abs_gap": _div(w["shift_prev"], w["pairs"], 0.0),
        # NeMo RL's token_mult_prob_error and AReaL's extreme-token share, token means over the step
        "token_mult_prob_error": w["exp"] / n, "extreme_share": w["extreme"] / n,
        "half_share": w["half"] / n,
    }


def _body_stats(b: dict[str, float]) -> dict[str, float]:
    nb = b["n"]
    var_d, var_y, cov_dy = b["m_dd"] / nb, b["m_yy"] / nb, b["m_dy"] / nb
    # x = y + d: cov(x, y) = cov(d, y) + var(y)
    return {"body_gap_mean": b["s_d"] / nb, "body_gap_std": math.sqrt(max(var_d, 0.0)),
            "body_positive_share": _div(0.5 * (b["s_a"] + b["s_d"]), b["s_a"], 0.5),
            "body_slope": _div(cov_dy + var_y, var_y, 1.0), "body_gap_rollout_corr": _corr_f(cov_dy, var_d, var_y)}


def _lag_stats(b: dict[str, float], n: float) -> dict[str, float]:
    out = {}
    for name, part in (("lag_body_std_lag0", "on"), ("lag_body_std_lagged", "off")):
        out[name] = math.sqrt(max(b[f"{part}_m_dd"] / b[f"{part}_n"], 0.0)) if b[f"{part}_n"] else 0.0
    out["lag0_positive_share"] = _div(0.5 * (b["on_s_a"] + b["on_s_d"]), b["on_s_a"], 0.5)
    out["lag_abs_gap_lag0"] = _div(b["lag0_s_a"], b["lag0_n"], 0.0)
    out["lag_abs_gap_lagged"] = _div(b["lagged_s_a"], b["lagged_n"], 0.0)
    out["lag0_share"] = b["lag0_n"] / n
    return out


def _row_lag(row_abs: torch.Tensor, row_n: torch.Tensor, lag_rows: torch.Tensor, step_ids: torch.Tensor,
             n: int) -> dict[str, torch.Tensor]:
    """Over the rows with actor tokens, per step: the mean lag, and the correlation and
    least-squares slope of the row's mean ``|d|`` on its lag (0 when the lag is the same for every row)."""
    has = row_n > 0
    seg, lg, gp = step_ids[has], lag_rows.to(torch.float64)[has], (row_abs / row_n)[has]
    cnt = seg_count(seg, n, torch.float64)
    cov, vl, _ = _moments(lg, gp, seg, n, cnt)
    return {"lag_mean": _mean(lg, seg, n, cnt), "lag_gap_corr": _corr(lg, gp, seg, n, cnt),
            "lag_gap_slope": _ratio(cov, vl, 0.0, cnt)}


def mismatch_stats(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, rows: Rows,
                   step_ids: torch.Tensor, n_steps: int, lag: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Each step's fingerprint statistics (:data:`STATS`, and :data:`LAG_STATS` with ``lag``).

    Args:
        old: ``(tokens,)`` the trainer's log-probs (``old_log_probs``).
        rollout: ``(tokens,)`` the rollout engine's (``rollout_log_probs``).
        mask: ``(tokens,)`` 1 on actor tokens.
        rows: the token layout; ``step_ids``: ``(rows,)`` each row's step in ``[0, n_steps)``.
        lag: ``(rows,)`` each row's policy lag (``step - 1 - policy_version``), or None.

    One pass over each step's tokens (:mod:`rldiag.engine.mismatch_scan`, on the host) gives
    every statistic but the body's and the order statistics; those of ``|d|`` come from the few
    tokens above a threshold (:func:`_tails`); the body's moments are the step's less those
    tokens' (Chan et al.'s update reversed). A second pass sums the body on its own where that
    subtraction would cancel (:data:`CANCEL`) and, with ``lag``, always (the per-row and on- /
    off-policy sums).

    Returns ``name -> (n_steps,)`` float64, on the batch's device.
    """
    with np.errstate(divide="ignore", invalid="ignore"):  # a step without actor tokens: NaN, as torch gave
        return _stats(old, rollout, mask, rows, step_ids, n_steps, lag)


def _stats(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, rows: Rows, step_ids: torch.Tensor,
           n_steps: int, lag: torch.Tensor | None) -> dict[str, torch.Tensor]:
    inp = scan.Inputs.of(old, rollout, mask, rows)
    ranges = scan.step_ranges(rows, step_ids, n_steps)
    sizes = [sum(b - a for a, b in r) for r in ranges]
    device = old.device
    buf = scan.Buffers(max(1, min(scan.CHUNK, max(sizes, default=1))))
    compiled = native.Out(max(1, min(native.chunk_size(), max(sizes, default=1)))) if native.usable(inp) else None
    names = STATS + (LAG_STATS if lag is not None else ())
    values = {k: [math.nan] * n_steps for k in names}
    row_abs = row_n = lag_rows = None
    if lag is not None:
        lag_rows = scan.host(lag)
        row_abs = np.zeros(rows.n_rows, dtype=np.float64)
        row_n = np.zeros(rows.n_rows, dtype=np.float64)
    for s in range(n_steps):
        values["tokens"][s] = 0.0
        if not sizes[s]:
            continue
        whole = None
        for centred in (False, True):  # plain sums of products, centred where they cancel
            recs = []
            picked = None
            if compiled is not None:
                compiled.kept = 0
            fast = None if centred else compiled  # the compiled pass, in its longer chunks
            for a, m, me, _ in scan.chunks(ranges[s], buf.size if fast is None else fast.size):
                if fast is not None:  # the first chunk's threshold set by the kernel (NaN: not yet)
                    picked = picked or scan.Picked(math.nan)
                    recs.append(native.scan_chunk(inp, fast, a, m, me, picked, sampled=min(m, buf.size)))
                    continue
                ch = scan.load(inp, buf, a, m, me)
                picked = picked or scan.Picked(scan.first_threshold(buf, ch))
                recs.append(scan.scan_chunk(buf, ch, centred, picked))
            if fast is not None and picked is not None:
                fast.step_picks(picked)  # one array of the step's picks
            whole = _whole(np.stack(recs), centred)
            if whole is not None:
                break
        assert whole is not None and picked is not None
        n = whole["n"]
        if n == 0:
            continue
        need = int(n) - min(math.floor((n - 1) * BODY_QUANTILE), int(n) - math.ceil(n * TOP_SHARE))
        while picked.threshold > 0 and sum(v.shape[0] for v in picked.d) < need:
            picked = _pick_again(inp, buf, ranges[s], picked, need)
        tails = _tails(picked, int(n))
        if picked.holds_extreme:
            whole["extreme"] = float(tails.n_extreme)
        stats = _whole_stats(whole)
        stats.update({"gap_abs_p99": tails.p99, "gap_abs_p95": tails.p95, "gap_abs_max": tails.largest,
                      "top_kl_share": _div(tails.top_sum, 0.5 * whole["d2"], 0.0)})
        body = None if lag is not None else _excluded_body(whole, tails)
        if body is None:
            brec = [body_chunk(buf, scan.load(inp, buf, a, m, me), tails.p95, lag_rows, row_abs, row_n)
                    for a, m, me, _ in scan.chunks(ranges[s], buf.size)]
            body = _combine_body(np.stack(brec), lag is not None)
        stats.update(_body_stats(body))
        if lag is not None:
            stats.update(_lag_stats(body, n))
        for k, v in stats.items():
            values[k][s] = v
    # one tensor of every statistic (numpy's array of the lists: torch.tensor takes 60 us), its rows
    # handed out as views (a tensor each: 5 us a call)
    out = dict(zip(values, torch.from_numpy(np.array(list(values.values()), dtype=np.float64)).to(device).unbind(0),
                   strict=True))
    if lag is not None and row_abs is not None and row_n is not None:
        out.update(_row_lag(torch.from_numpy(row_abs).to(device), torch.from_numpy(row_n).to(device),
                            lag.to(device), step_ids, n_steps))
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
