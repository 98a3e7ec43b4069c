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
#: ``gap_abs_p95``'s quantile: the body of a step's gap (the ``body_*`` statistics) is its tokens
#: with ``|d|`` at most this quantile, so that a handful of outlier tokens (up to 5 %) is left out
BODY_QUANTILE = 0.95
#: a token is confident when the rollout gave it at least this probability, unconfident below
#: ``UNCONFIDENT``: ``gap_confident`` / ``gap_unconfident`` average ``d`` over each
CONFIDENT = math.log(0.5)
UNCONFIDENT = math.log(0.05)
#: ``extreme_share`` counts the tokens with ``|d|`` above this (a probability ratio outside [1/2, 2])
EXTREME = math.log(2.0)

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


class _Steps:
    """Per-step reductions over flat values ``(n,)`` keyed by ``step`` ``(n,)`` in ``[0, n_steps)``.

    Sums are taken in the values' order, one after another, as :func:`seg_sum` (``index_add_``)
    takes them, so they are the same values. Where the steps are contiguous and in order (a
    packed batch's tokens) and on the CPU, each step's sum is the last of a running sum
    (``cumsum``) over its slice, written over one scratch array that every sum reuses: about 2.5
    times faster than ``index_add_``, and no array of the batch's size allocated (and
    page-faulted in) per sum (bench/bench_mismatch.py)."""

    def __init__(self, step: torch.Tensor, n: int, sizes: list[int] | None = None,
                 scratch: torch.Tensor | None = None):
        self.step, self.n = step, n
        self.count = seg_count(step, n, torch.float64)
        if sizes is None and step.device.type == "cpu" and (step.numel() < 2 or bool((step[1:] >= step[:-1]).all())):
            sizes = self.count.to(torch.long).tolist()
        self.sizes = sizes  # each step's tokens where they are contiguous and in order, else None
        self._scratch = scratch

    def scratch(self, numel: int) -> torch.Tensor:
        """A float64 array of ``numel`` values, shared by every sum of these steps: what is
        written to it lasts until the next sum."""
        if self._scratch is None or self._scratch.numel() < numel:
            self._scratch = torch.empty(numel, dtype=torch.float64, device=self.step.device)
        return self._scratch[:numel]

    def drop_last(self) -> _Steps:
        """The same steps without the last value (``step[:-1]``), sharing the scratch array."""
        sizes = None
        if self.sizes is not None:
            sizes = list(self.sizes)
            filled = [i for i, k in enumerate(sizes) if k]
            if filled:
                sizes[filled[-1]] -= 1
        return _Steps(self.step[:-1], self.n, sizes, self.scratch(max(self.step.numel() - 1, 0)))

    def sum(self, v: torch.Tensor, in_scratch: bool = False) -> torch.Tensor:
        """Each step's sum of ``v``; ``in_scratch``: ``v`` is (a prefix of) :meth:`scratch`,
        which the running sum overwrites."""
        if self.sizes is None:
            return seg_sum(v, self.step, self.n)
        if not in_scratch and v.dtype != torch.float64:
            v, in_scratch = self.scratch(v.numel()).copy_(v), True
        # in the scratch array: the running sum in place; else written there (no copy first)
        out = v if in_scratch else self.scratch(v.numel())

        def last(p: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
            return torch.cumsum(p, 0, out=o)[-1:].clone() if p.numel() else p.new_zeros(1)

        if self.n == 1:
            return last(v, out)
        return torch.cat([last(p, o) for p, o in zip(v.split(self.sizes), out.split(self.sizes))])

    def product_sum(self, a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
        """Each step's sum of ``a * b``."""
        return self.sum(torch.mul(a, b, out=self.scratch(a.numel())), in_scratch=True)

    def mean(self, v: torch.Tensor, in_scratch: bool = False) -> torch.Tensor:
        return self.sum(v, in_scratch) / self.count

    def per_value(self, m: torch.Tensor) -> torch.Tensor:
        """A per-step ``m`` ``(n_steps,)`` for each value: broadcast where there is one step,
        else gathered (``index_select``: ``m[step]`` is an advanced-indexing gather several times
        slower on the CPU, with the same values)."""
        return m if self.n == 1 else m.index_select(0, self.step)

    def dev(self, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``v`` less its step's mean, written to ``out`` (which may be ``v``)."""
        return self.less(v, self.mean(v), out)

    def less(self, v: torch.Tensor, m: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``v`` less its step's value of ``m`` ``(n_steps,)``, written to ``out`` (which may be ``v``)."""
        if self.n == 1:
            return torch.sub(v, m, out=out)
        if self.sizes is None:
            return torch.sub(v, torch.index_select(m, 0, self.step), out=out)
        # contiguous steps: each slice less its step's mean (the same values, no gathered copy)
        for p, o, mi in zip(v.split(self.sizes), out.split(self.sizes), m):
            torch.sub(p, mi, out=o)
        return out

    def max(self, v: torch.Tensor) -> torch.Tensor:
        if self.sizes is None:
            return seg_max(v, self.step, self.n)
        nan = v.new_full((), float("nan"))
        return torch.stack([p.max() if p.numel() else nan for p in v.split(self.sizes)])


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


def _tails(absd: torch.Tensor, k2_sum: torch.Tensor, steps: _Steps) -> dict[str, torch.Tensor]:
    """``gap_abs_p99`` and ``gap_abs_p95`` (linear interpolation, as ``torch.quantile``) and
    ``top_kl_share`` by a selection, no sort: per step, ``torch.topk`` of its largest ``|d|`` down
    to the lower quantile's lower neighbour (about 5 % of its tokens, and at least the top 1 %
    ``top_kl_share`` sums). The order statistics are exact; the top tokens' ``d^2 / 2`` are added
    smallest first. ``k2_sum`` ``(n_steps,)``: each step's summed ``d^2 / 2`` in the tokens'
    order (``kl_k2``'s), the share's denominator."""
    n, count = steps.n, steps.count
    counts = count.to(torch.long)
    sizes = steps.sizes
    if sizes is None:
        absd = absd.index_select(0, torch.argsort(steps.step, stable=True))
        sizes = counts.tolist()
    nan = torch.full((n,), float("nan"), dtype=torch.float64, device=absd.device)
    # each quantile at (count - 1) * q between its two neighbours (ascending ranks lo and hi)
    ranks = []
    for q in (QUANTILE, BODY_QUANTILE):
        h = (count - 1).clamp_min(0) * q
        lo = h.floor().to(torch.long)
        ranks.append((h, lo, torch.minimum(lo + 1, (counts - 1).clamp_min(0)), nan.clone(), nan.clone()))
    top = torch.ceil(count * TOP_SHARE).to(torch.long)
    top_sum = torch.zeros(n, dtype=torch.float64, device=absd.device)
    lowest = ranks[1][1].tolist()
    for i, (part, c, low, k) in enumerate(zip(absd.split(sizes), counts.tolist(), lowest, top.tolist())):
        if not c:
            continue
        largest = torch.topk(part, max(k, c - low)).values  # descending: ascending rank r is at c - 1 - r
        for _, lo, hi, v_lo, v_hi in ranks:
            v_lo[i], v_hi[i] = largest[c - 1 - int(lo[i])], largest[c - 1 - int(hi[i])]
        if k:
            asc = largest[:k].flip(0)
            top_sum[i] = torch.mul(asc, 0.5).mul_(asc).cumsum_(0)[-1]
    p99, p95 = (torch.where(counts > 0, v_lo + (h - lo) * (v_hi - v_lo), nan) for h, lo, _, v_lo, v_hi in ranks)
    return {"gap_abs_p99": p99, "gap_abs_p95": p95, "top_kl_share": _ratio(top_sum, k2_sum, 0.0, count)}


def _shift(t: ActorTokens, steps: _Steps, absd: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rollout series against the trainer's shifted by one position: pairs of actor tokens
    next to each other in a row; ``next``: ``|y_t - x_{t+1}|``, ``prev``: ``|y_{t+1} - x_t|``,
    ``pair``: the unshifted ``|d_t|`` over the same pairs."""
    # each pair by its first token, as a weight 1 or 0: the sums over all tokens equal those over
    # the pairs alone (every term is >= 0, so adding 0 changes nothing), without gathering the pairs
    adj = ((t.row[1:] == t.row[:-1]) & (t.pos[1:] == t.pos[:-1] + 1)).to(torch.float64)
    first = steps.drop_last()
    cnt = first.sum(adj)
    k = adj.numel()
    pair = first.sum(torch.add(absd[:-1], absd[1:], out=first.scratch(k)).mul_(0.5).mul_(adj), in_scratch=True)
    nxt = first.sum(torch.sub(t.y[:-1], t.x[1:], out=first.scratch(k)).abs_().mul_(adj), in_scratch=True)
    prv = first.sum(torch.sub(t.y[1:], t.x[:-1], out=first.scratch(k)).abs_().mul_(adj), in_scratch=True)
    count = steps.count
    return {"pair_abs_gap": _ratio(pair, cnt, 0.0, count), "shift_next_abs_gap": _ratio(nxt, cnt, 0.0, count),
            "shift_prev_abs_gap": _ratio(prv, cnt, 0.0, count)}


def body_mask(absd: torch.Tensor, step: torch.Tensor, p95: torch.Tensor) -> torch.Tensor:
    """``(n,)`` bool: the tokens of the body of each step's gap, ``|d|`` at most the step's
    ``gap_abs_p95`` ``(n_steps,)``: the top 5 % (a handful of outlier tokens) left out."""
    return absd <= p95.index_select(0, step)


def _centred(v: torch.Tensor, w: torch.Tensor, steps: _Steps, cnt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``v`` ``(n,)`` less its step's mean over the tokens of weight 1 (``w`` ``(n,)``, 0 or 1;
    ``cnt`` their count per step), 0 on the others; and those means ``(n_steps,)``. Weights, not a
    gathered copy: the sums are the same (adding 0 changes none) and no boolean gather is paid."""
    mean = steps.product_sum(v, w) / cnt
    return steps.less(v, mean, out=torch.empty_like(v)).mul_(w), mean


def _body(t: ActorTokens, body: torch.Tensor, steps: _Steps) -> dict[str, torch.Tensor]:
    """The gap's statistics over the body's tokens (:func:`body_mask`), so that a handful of
    outlier tokens cannot hide the body's own fingerprint: ``body_gap_mean``, ``body_gap_std``,
    ``body_positive_share``, ``body_slope`` and ``body_gap_rollout_corr`` as their whole-step
    namesakes (neutral values where the step has no body token)."""
    w = body.to(torch.float64)
    cnt = steps.sum(w)
    dev_d, mean = _centred(t.d, w, steps, cnt)
    dev_y, _ = _centred(t.y, w, steps, cnt)

    def m2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return steps.product_sum(a, b) / cnt

    var_d, var_y, cov_dy = m2(dev_d, dev_d), m2(dev_y, dev_y), m2(dev_d, dev_y)
    pos = _ratio(steps.product_sum(t.d.clamp_min(0), w), steps.product_sum(t.d.abs(), w), 0.5, cnt)
    # x = y + d: cov(x, y) = cov(d, y) + var(y), one centred series fewer
    return {"body_gap_mean": mean, "body_gap_std": var_d.sqrt(), "body_positive_share": pos,
            "body_slope": _ratio(cov_dy + var_y, var_y, 1.0, cnt),
            "body_gap_rollout_corr": _corr_of(cov_dy, var_d, var_y, cnt)}


def half_share(t: ActorTokens, n: int) -> torch.Tensor:
    """``(n_steps,)`` the share of a step's tokens whose rollout log-prob is non-zero and a 16-bit
    float (exactly a bfloat16 or a normal float16 value), read from the float32 bits: an engine
    whose log-softmax ran in half precision reports nothing else, one computing in float32
    almost never does (a float32 value has 16 and 13 low mantissa bits to spare)."""
    bits = t.y.to(torch.float32).view(torch.int32)
    size = t.y.abs()
    # bfloat16: the low 16 bits of the float32 are 0; float16 (normal range): the low 13 are
    bf16 = (bits & 0xFFFF) == 0
    fp16 = ((bits & 0x1FFF) == 0) & (size >= 2.0 ** -14) & (size <= 65504.0)
    count = seg_count(t.step, n, torch.float64)
    return seg_sum(((bf16 | fp16) & (size != 0)).to(torch.float64), t.step, n) / count


def _lag(t: ActorTokens, lag_rows: torch.Tensor, n_rows: int, n: int, body: torch.Tensor,
         steps: _Steps) -> dict[str, torch.Tensor]:
    """The gap against each row's policy lag ``(rows,)``: over rows with actor tokens, the
    correlation and least-squares slope of the row's mean ``|d|`` on its lag (0 when the lag is
    the same for every row), the mean lag, the mean ``|d|`` over the tokens of on-policy (lag 0)
    and of lagged rows (0 without such rows), and the share of tokens in on-policy rows; the std
    of ``d`` over the body's tokens (``body`` ``(n,)``, :func:`body_mask`) of on-policy and of
    lagged rows (0 without such tokens), and ``positive_share`` over the body's tokens of on-policy
    rows (0.5 without any): a lag adds spread to the lagged rows whatever the other causes do to all rows."""
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
    spread = {}
    for name, part in (("lag_body_std_lag0", on), ("lag_body_std_lagged", 1 - on)):
        w = part * body
        w_cnt = steps.sum(w)
        dev, _ = _centred(t.d, w, steps, w_cnt)
        var = steps.product_sum(dev, dev) / w_cnt
        spread[name] = torch.where(w_cnt > 0, var.sqrt(), _ratio(var, w_cnt, 0.0, count))  # NaN: no token at all
    on_body = on * body
    on_pos = _ratio(steps.product_sum(t.d.clamp_min(0), on_body), steps.product_sum(absd, on_body), 0.5, count)
    return {**spread, "lag0_positive_share": on_pos,
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
    steps = _Steps(t.step, n_steps)
    count = steps.count
    d, absd = t.d, t.d.abs()
    # each series' deviations from its step's mean taken once, in three arrays reused throughout,
    # and shared by the moments below (each statistic is the same expression as on its own, so
    # the same values); every product and running sum goes to the steps' scratch array
    dev, dev_x, dev_y = torch.empty_like(d), torch.empty_like(d), torch.empty_like(d)
    mean = steps.mean(d)
    steps.dev(d, out=dev)
    abs_sum = steps.sum(absd)
    abs_mean = abs_sum / count

    def m2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return steps.product_sum(a, b) / count

    var_d = m2(dev, dev)
    k2_sum = steps.sum(torch.mul(d, 0.5, out=steps.scratch(d.numel())).mul_(d), in_scratch=True)
    out = {
        "tokens": count,
        "gap_mean": mean,
        "gap_std": var_d.sqrt(),
        "gap_abs_mean": abs_mean,
        "gap_abs_max": steps.max(absd),
        "kl_k2": k2_sum / count,
        "positive_share": _ratio(steps.sum(torch.clamp_min(d, 0, out=steps.scratch(d.numel())), in_scratch=True),
                                 abs_sum, 0.5, count),
    }
    out.update(_tails(absd, k2_sum, steps))
    steps.dev(t.x, out=dev_x)
    steps.dev(t.y, out=dev_y)
    cov_xy, var_x, var_y = m2(dev_x, dev_y), m2(dev_x, dev_x), m2(dev_y, dev_y)
    out["slope"] = _ratio(cov_xy, var_y, 1.0, count)  # x on y: T_roll / T_train; 1 for a constant rollout series
    out["gap_rollout_corr"] = _corr_of(m2(dev, dev_y), var_d, var_y, count)
    out["logprob_corr"] = _corr_of(cov_xy, var_x, var_y, count)
    conf = dev.copy_(t.y >= CONFIDENT)  # 1.0 / 0.0, over dev (done with)
    n_conf = steps.sum(conf)
    out["gap_confident"] = _ratio(steps.product_sum(d, conf), n_conf, 0.0, count)
    unconf = dev.copy_(t.y < UNCONFIDENT)
    n_unconf = steps.sum(unconf)
    out["gap_unconfident"] = _ratio(steps.product_sum(d, unconf), n_unconf, 0.0, count)
    out["confident_share"], out["unconfident_share"] = n_conf / count, n_unconf / count
    dev_abs = steps.dev(absd, out=dev_x)
    var_abs = m2(dev_abs, dev_abs)
    other = steps.dev(dev_y.copy_(t.pos), out=dev_y)
    out["gap_position_corr"] = _corr_of(m2(dev_abs, other), var_abs, m2(other, other), count)
    other = steps.dev(torch.abs(t.y, out=dev_y), out=dev_y)
    out["gap_logprob_corr"] = _corr_of(m2(dev_abs, other), var_abs, m2(other, other), count)
    del dev, dev_x, dev_y, dev_abs, other, conf, unconf
    out.update(_shift(t, steps, absd))
    body = body_mask(absd, t.step, out["gap_abs_p95"])
    out.update(_body(t, body, steps))
    out["half_share"] = half_share(t, n_steps)
    if lag is not None:
        out.update(_lag(t, lag, rows.n_rows, n_steps, body, steps))
    # NeMo RL's token_mult_prob_error and AReaL's extreme-token share, token means over the step
    out["token_mult_prob_error"] = steps.sum(torch.exp(absd, out=steps.scratch(d.numel())), in_scratch=True) / count
    out["extreme_share"] = steps.sum(steps.scratch(d.numel()).copy_(absd > EXTREME), in_scratch=True) / count
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
