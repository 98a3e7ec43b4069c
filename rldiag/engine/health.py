"""Per-step health signals of the update and of the outputs, for the doctor's rules
(:mod:`rldiag.engine.stages.health` writes them). Pure tensor functions: no loop per row, the
cost follows the tokens (a top-k selection of each step's actor tokens for the top share, no sort;
float64 sums piece by piece, no float64 copy of the tokens).

- :func:`gradient_weight_shares`: both gradient-weight shares below in one pass over a step's
  tokens in step order (the stage's form; :func:`top_weight_share` and :func:`weight_share` take
  tokens in any order).
- :func:`top_weight_share`: share of a step's gradient weight
  (:mod:`rldiag.engine.gradient_weight`) carried by its top ``frac`` of actor tokens by weight.
- :func:`weight_share`: share of a step's weight on the tokens an indicator selects (the PPO
  clip's: the gradient weight the clip zeroes).
- :func:`empty_fraction`: share of a step's rows without an actor token (or of length 0).
- :func:`group_std_mean`: mean over a step's groups of 2+ rows of the within-group std of a
  per-row value (the score).
- :func:`component_means`: the step means of per-row reward components and the top one's
  share of their summed magnitudes.
"""

from __future__ import annotations

import math

import torch

from rldiag.engine import grad_weight_native
from rldiag.engine.gradient_weight import gradient_weight, unclipped_part
from rldiag.engine.host import count_equal, indices_above, positive_float
from rldiag.engine.segments import seg_count, seg_std, seg_sum

__all__ = ["PIECE_TOKENS", "component_means", "empty_fraction", "gradient_weight_shares", "group_std_mean",
           "in_step_order", "step_bounds", "top_sum", "top_weight_share", "weight_share"]


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` per step, NaN where ``den`` is 0 (no weight: the share is undefined)."""
    nan = torch.full_like(den, float("nan"))
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), nan)


#: tokens per piece of a step whose float64 sums are taken at once (a float64 copy of one piece,
#: never of the step's tokens)
PIECE_TOKENS = 1 << 18
#: the sample of a step's weights that bounds its top k from below: every ``SAMPLE_STRIDE``-th token
SAMPLE_STRIDE = 16


def step_bounds(tok_step: torch.Tensor, n_steps: int) -> list[int]:
    """``n_steps + 1`` token offsets of each step's tokens, for tokens in step order
    (``tok_step`` ``(tokens,)`` non-decreasing)."""
    counts = torch.bincount(tok_step, minlength=n_steps)[:n_steps]
    return [0] + torch.cumsum(counts, 0).tolist()


def in_step_order(tok_step: torch.Tensor) -> torch.Tensor | None:
    """The stable permutation ``(tokens,)`` that puts tokens in step order; None when they are
    already (a packed batch's tokens are)."""
    if tok_step.numel() < 2 or bool((tok_step[1:] >= tok_step[:-1]).all()):
        return None
    return torch.argsort(tok_step, stable=True)


def top_sum(x: torch.Tensor, k: int) -> torch.Tensor:
    """float64 scalar: the ``k`` largest values of ``x`` ``(n,)`` float32 (``1 <= k <= n``),
    added largest first, one after another.

    A selection, no sort of ``x``: a threshold ``t`` from a strided sample (its ``1.25 k /
    SAMPLE_STRIDE + 16``-th largest value); where at least ``k`` values are above ``t``, the ``k``
    largest are ``torch.topk`` of those; where fewer (``m``) are above it but at least ``k`` at or
    above it, the ``k``-th largest is ``t`` itself: the ``m`` values above it in descending order,
    then ``t`` ``k - m`` times (ties at the threshold, as equal gradient weights of whole rows make
    them, are never gathered). Either way the same values in the same order as ``torch.topk`` of
    every value (its fallback otherwise), so the same sum to the bit. A NaN is never selected by
    the threshold: the callers read the sum only where the step's total is finite."""
    n = x.numel()
    vals = None
    if k * 4 * SAMPLE_STRIDE < n:
        sample = x[::SAMPLE_STRIDE].contiguous()
        t = torch.topk(sample, min(sample.numel(), (5 * k) // (4 * SAMPLE_STRIDE) + 16), sorted=False).values.min()
        above = indices_above(x, t)  # numpy's comparison and scan on the host (rldiag.engine.host)
        m = int(above.numel())
        if m >= k:
            vals = torch.topk(x.index_select(0, above), k).values
        elif m + count_equal(x, t) >= k:
            top = torch.sort(x.index_select(0, above), descending=True).values
            vals = torch.cat([top, t.expand(k - m)])
    if vals is None:
        vals = torch.topk(x, k).values
    return vals.to(torch.float64).cumsum(0)[-1]


def gradient_weight_shares(adv: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, bounds: list[int],
                           frac: float = 0.01, clipped: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per step ``(n_steps,)`` float32, from one pass over each step's tokens in pieces of
    :data:`PIECE_TOKENS` (each piece's gradient weights ``g = |A| w``,
    :func:`rldiag.engine.gradient_weight.gradient_weight`, made and used while in cache):

    - the top share: of the summed ``g x (1 - clipped)`` over the step's actor tokens, the share
      its ``ceil(frac x actor tokens)`` largest carry (at least one token; NaN where the step's
      weight is 0; :func:`top_sum`);
    - the clipped share (None without ``clipped``): ``sum(g x clipped x actor) / sum(g)``, the
      share of the step's unclipped weight the clip zeroes (NaN where ``sum(g)`` is 0).

    ``adv``, ``weights`` ``(tokens,)`` the advantages and the aggregation weights, ``mask``
    ``(tokens,)`` the actor tokens where ``> 0``, ``clipped`` ``(tokens,)`` the clip indicator (a
    clip probability counts by its value), the tokens in step order with ``bounds`` (``n_steps +
    1``) the offsets of each step's (:func:`step_bounds`). The float64 sums are taken piece by
    piece (``torch.sum`` of each piece, the pieces added in order), so no float64 copy of the
    tokens is made; they differ from a sequential sum in the tokens' order by rounding only
    (docs/performance.md). The tokens off the mask count as 0 in the sums and as -1 in the
    selection (below every weight), so nothing is compacted. On the host, each step's ranking and
    sums come from one compiled read instead (:mod:`rldiag.engine.grad_weight_native`: the same
    float32 values, float64 sums in another order)."""
    n = len(bounds) - 1
    f64 = torch.float64
    zeros = torch.zeros(n, dtype=f64, device=adv.device)
    top, total, num, den = zeros.clone(), zeros.clone(), zeros.clone(), zeros.clone()
    zero = torch.zeros((), dtype=torch.float32, device=adv.device)
    minus = torch.full((), -1.0, dtype=torch.float32, device=adv.device)
    compiled = grad_weight_native.usable(adv, weights, mask, clipped)
    for s in range(n):
        a, b = bounds[s], bounds[s + 1]
        if a == b:
            continue
        if compiled:  # one compiled read of the step (rldiag.engine.grad_weight_native)
            one = grad_weight_native.step_pass(adv[a:b], weights[a:b], mask[a:b],
                                               None if clipped is None else clipped[a:b])
            total[s], num[s], den[s] = one.total, one.num, one.den
            if one.actor:
                top[s] = top_sum(one.ranked, min(max(1, math.ceil(one.actor * frac - 1e-9)), one.actor))
            continue
        ranked = torch.empty(b - a, dtype=torch.float32, device=adv.device)  # the unclipped weight, -1 off actor
        count = 0
        for lo in range(a, b, PIECE_TOKENS):
            hi = min(lo + PIECE_TOKENS, b)
            gp, on = gradient_weight(adv[lo:hi], weights[lo:hi]), positive_float(mask[lo:hi])
            count += int(on.sum())  # exact: 0/1 values, fewer than 2^24 a piece
            if clipped is not None:
                cp = clipped[lo:hi].to(torch.float32)
                g64 = gp.to(f64)
                den[s] += g64.sum()
                num[s] += g64.mul_(cp * on).sum()  # cp x on widened to float64 as it is multiplied
                gp = unclipped_part(gp, cp)
            # off the actor tokens 0 in the sum, -1 in the ranking: products with the 0/1 mask (a
            # `where` on a bool mask costs several times more on the CPU), the same values where
            # every weight is finite; a non-finite one takes the `where`s
            kept = torch.mul(gp, on, out=ranked[lo - a:hi - a])
            part = kept.sum(dtype=f64)
            if bool(torch.isfinite(part)):
                total[s] += part
                kept.add_(on.sub_(1.0))
            else:
                ap = mask[lo:hi] > 0
                total[s] += torch.where(ap, gp, zero).sum(dtype=f64)
                torch.where(ap, gp, minus, out=ranked[lo - a:hi - a])
        if count:
            # ceil of frac x count (a float product 0.01 x 300 may round past the integer: take it off)
            k = max(1, math.ceil(count * frac - 1e-9))
            top[s] = top_sum(ranked, min(k, count))
    top_share = _ratio(top, total).to(torch.float32)
    return top_share, None if clipped is None else _ratio(num, den).to(torch.float32)


def top_weight_share(g: torch.Tensor, tok_step: torch.Tensor, actor: torch.Tensor, n_steps: int,
                     frac: float = 0.01) -> torch.Tensor:
    """``(n_steps,)`` float32: per step, the share of the summed ``g`` over its actor tokens that
    its ``ceil(frac x actor tokens)`` largest carry (:func:`gradient_weight_shares`), for tokens
    in any order (``tok_step`` ``(tokens,)`` each token's step; one stable sort by step where
    they are not in step order). Ties among equal weights do not change the share."""
    order = in_step_order(tok_step)
    if order is not None:
        g, tok_step, actor = g.index_select(0, order), tok_step.index_select(0, order), actor.index_select(0, order)
    ones = torch.ones_like(g, dtype=torch.float32)  # g = |g| x 1, the same values
    return gradient_weight_shares(g, ones, actor, step_bounds(tok_step, n_steps), frac)[0]


def weight_share(g: torch.Tensor, on: torch.Tensor, tok_step: torch.Tensor, n_steps: int) -> torch.Tensor:
    """``(n_steps,)`` float32: per step ``sum(g x on) / sum(g)`` (NaN where ``sum(g)`` is 0).
    ``g`` ``(tokens,)`` weights, ``on`` ``(tokens,)`` an indicator in [0, 1] (a clip
    probability counts by its value); float64 sums piece by piece, as
    :func:`gradient_weight_shares`' clipped share."""
    order = in_step_order(tok_step)
    if order is not None:
        g, on, tok_step = g.index_select(0, order), on.index_select(0, order), tok_step.index_select(0, order)
    ones = torch.ones_like(g, dtype=torch.float32)  # every token counts; g = |g| x 1, the same values
    share = gradient_weight_shares(g, ones, ones, step_bounds(tok_step, n_steps), 0.01, on)[1]
    assert share is not None  # computed with an indicator
    return share


def empty_fraction(actor_tokens: torch.Tensor, lengths: torch.Tensor, step_ids: torch.Tensor, n_steps: int) -> torch.Tensor:
    """``(n_steps,)`` float32: share of the step's rows with no actor token or of length 0.
    ``actor_tokens``, ``lengths``, ``step_ids`` ``(rows,)``."""
    empty = ((actor_tokens <= 0) | (lengths <= 0)).to(torch.float32)
    return seg_sum(empty, step_ids, n_steps) / seg_count(step_ids, n_steps)


def group_std_mean(values: torch.Tensor, group_ids: torch.Tensor, n_groups: int, group_step: torch.Tensor,
                   n_steps: int) -> torch.Tensor:
    """``(n_steps,)`` float32: the mean over the step's groups of 2+ rows of the Bessel-corrected
    std of ``values`` ``(rows,)`` within the group (``torch.std``, as verl's GRPO normaliser in
    ``compute_grpo_outcome_advantage``); NaN for a step without such a group. ``group_step``
    ``(n_groups,)`` each group's step."""
    _, std, cnt = seg_std(values.to(torch.float64), group_ids, n_groups)
    multi = cnt > 1
    std = torch.where(multi, std, torch.zeros_like(std))
    return _ratio(seg_sum(std, group_step, n_steps), seg_sum(multi.to(torch.float64), group_step, n_steps)).to(torch.float32)


def component_means(components: dict[str, torch.Tensor], step_ids: torch.Tensor,
                    n_steps: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each component's step mean ``(n_steps,)`` (``components``: name -> ``(rows,)``) and the
    top component's share ``max_k |m_k| / sum_k |m_k|`` ``(n_steps,)`` (NaN where every mean is
    0; 1 with a single component)."""
    cnt = seg_count(step_ids, n_steps, torch.float64)
    means = {k: seg_sum(v.to(torch.float64), step_ids, n_steps) / cnt for k, v in components.items()}
    if not means:
        return {}, torch.full((n_steps,), float("nan"), dtype=torch.float32, device=step_ids.device)
    mag = torch.stack([m.abs() for m in means.values()])
    share = _ratio(mag.max(0).values, mag.sum(0))
    return {k: m.to(torch.float32) for k, m in means.items()}, share.to(torch.float32)
