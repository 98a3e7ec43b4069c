"""Per-step health signals of the update and of the outputs, for the doctor's rules
(:mod:`rldiag.engine.stages.health` writes them). Pure tensor functions: no loop per row, the
cost follows the tokens (a top-k selection of each step's actor tokens for the top share, no sort).

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

import torch

from rldiag.engine.segments import seg_count, seg_std, seg_sum

__all__ = ["component_means", "empty_fraction", "group_std_mean", "top_weight_share", "weight_share"]


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` per step, NaN where ``den`` is 0 (no weight: the share is undefined)."""
    nan = torch.full_like(den, float("nan"))
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), nan)


def top_weight_share(g: torch.Tensor, tok_step: torch.Tensor, actor: torch.Tensor, n_steps: int,
                     frac: float = 0.01) -> torch.Tensor:
    """``(n_steps,)`` float32: per step, the share of the summed ``g`` over its actor tokens that
    its ``ceil(frac x actor tokens)`` largest carry (at least one token; NaN where the step's
    weight is 0).

    ``g`` ``(tokens,)`` each token's weight (>= 0), ``tok_step`` ``(tokens,)`` its step,
    ``actor`` ``(tokens,)`` bool, the tokens that count. Ties among equal weights do not change
    the share. A selection, not a sort: per step, ``torch.topk`` of its ``k`` largest weights,
    summed largest first (float64); the denominator is the step's float64 sum in the tokens'
    order (``seg_sum``). The tokens of a packed batch are in step order; otherwise one stable
    sort by step (integers) puts them so. The tokens off ``actor`` count as 0 in the sum (adding
    +0.0 changes no float sum) and as -1 in the selection (below every weight), so nothing is
    compacted."""
    w = torch.where(actor, g, 0.0).to(torch.float64)
    s = tok_step
    if s.numel() > 1 and not bool((s[1:] >= s[:-1]).all()):
        order = torch.argsort(s, stable=True)
        w, s, actor = w.index_select(0, order), s.index_select(0, order), actor.index_select(0, order)
    count = seg_sum(actor.to(torch.long), s, n_steps)  # actor tokens per step
    # ceil of frac x count (a float product 0.01 x 300 may round past the integer: take it off)
    k = torch.ceil(count.to(torch.float64) * frac - 1e-9).clamp_min(1).to(torch.long)
    ranked = torch.where(actor, w, -1.0)
    top = torch.zeros(n_steps, dtype=torch.float64, device=w.device)
    sizes = torch.bincount(s, minlength=n_steps)[:n_steps].tolist()
    for i, (part, kk, c) in enumerate(zip(ranked.split(sizes), k.tolist(), count.tolist())):
        if c:  # the k largest, largest first, added one after another
            top[i] = torch.topk(part, min(kk, c)).values.cumsum(0)[-1]
    return _ratio(top, seg_sum(w, s, n_steps)).to(torch.float32)


def weight_share(g: torch.Tensor, on: torch.Tensor, tok_step: torch.Tensor, n_steps: int) -> torch.Tensor:
    """``(n_steps,)`` float32: per step ``sum(g x on) / sum(g)`` (NaN where ``sum(g)`` is 0).
    ``g`` ``(tokens,)`` weights, ``on`` ``(tokens,)`` an indicator in [0, 1] (a clip
    probability counts by its value)."""
    g64 = g.to(torch.float64)
    return _ratio(seg_sum(g64 * on.to(torch.float64), tok_step, n_steps), seg_sum(g64, tok_step, n_steps)).to(torch.float32)


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
