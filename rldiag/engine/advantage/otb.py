"""Optimal token baseline estimators (verl's ``optimal_token_baseline`` and
``tir_optimal_token_baseline`` in ``verl/trainer/ppo/core_algos.py``).

Per prompt group and per timestep, the baseline is ``B_t = sum_i G_it W_it / (sum_i W_it + 1e-8)``
with ``G`` the undiscounted reward-to-go of the masked rewards and ``W_t = sum_{j<=t} m_j w_j`` the
cumulative path-variance proxy ``w_j = 1 - 2 pi_j + sum_pi_squared_j`` (``pi_j = exp(old_log_prob)``),
scaled by the squared rollout IS weight when rollout correction produced one. A group of one has
baseline 0. verl's ``handle_zero_tail`` (always on through the dispatcher): when one row is strictly
the longest of its group (length = its mask-1 count), its baseline is 0 from position
``second longest length`` on.

``optimal_token_baseline`` indexes timesteps by raw token position (tool tokens included);
``tir_optimal_token_baseline`` (multi-turn) first packs each row's mask-1 tokens to the left, so
the k-th action token of every row shares a baseline, and leaves rows without action tokens out of
their group. Both need ``old_log_probs`` and ``sum_pi_squared`` (verl:
``actor.calculate_sum_pi_squared=True``).
"""

from __future__ import annotations

import torch

from rldiag.engine.advantage.base import (
    ESTIMATORS,
    AdvInput,
    require_extra,
    require_field,
    reverse_cumsum,
)
from rldiag.engine.batch import Batch
from rldiag.engine.scan import cumsum_segmented
from rldiag.engine.segments import seg_count, seg_max, seg_sum

#: verl's ``epsilon`` default of the optimal-token-baseline estimators.
OTB_EPS = 1e-8
_SPP_HINT = "the per-token sum of squared vocabulary probabilities; verl: actor.calculate_sum_pi_squared=True"


def _otb_inputs(inp: AdvInput, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, W)``, both ``(tokens,)``: reward-to-go and cumulative path-variance proxy."""
    old = require_field(inp, "old_log_probs", name, "pi_old of the sampled tokens")
    spp = require_extra(inp, "sum_pi_squared", name, _SPP_HINT)
    m = inp.mask
    returns = reverse_cumsum(inp.rewards * m, inp.rows)
    w = 1 - 2 * torch.exp(old) + spp  # ||s_t||^2 = 1 - 2 pi_t + sum pi^2, score-function norm proxy
    if inp.rollout_is_weights is not None:
        w = w * (inp.rollout_is_weights**2)  # truncated-IS correction of the MSE-optimal baseline
    return returns, cumsum_segmented(w * m, inp.rows)


def _zero_tail_rows(length: torch.Tensor, member: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's handle_zero_tail. ``length`` ``(rows,)`` float, ``member`` ``(rows,)`` bool (rows that
    count in their group). Returns ``(rows,)`` bool: rows that are strictly the longest member of a
    group of at least two members, and ``(rows,)`` the group's second longest length."""
    g, n = batch.group_ids, batch.n_groups
    neg = torch.full_like(length, float("-inf"))
    lm = torch.where(member, length, neg)
    gmax = seg_max(lm, g, n)
    is_max = member & (length == gmax[g])
    n_max = seg_sum(is_max.to(length.dtype), g, n)
    second = seg_max(torch.where(is_max, neg, lm), g, n)
    members = seg_sum(member.to(length.dtype), g, n)
    cut = is_max & (members[g] > 1) & (n_max[g] == 1) & (gmax[g] > second[g])
    return cut, second[g]


@ESTIMATORS.register(
    "optimal_token_baseline",
    needs=("old_log_probs", "sum_pi_squared"),
    grouped=True, source="verl core_algos, optimal_token_baseline",
)
def optimal_token_baseline(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position baseline over each uid group (raw token positions). returns = reward-to-go;
    advantages = (returns - baseline) * mask."""
    b, m, rows = inp.batch, inp.mask, inp.rows
    returns, wcum = _otb_inputs(inp, "optimal_token_baseline")
    g, n = b.group_ids, b.n_groups
    pos = rows.positions()
    slot, n_slots = _group_slots(rows.lengths, pos, rows.row_ids, g, n)
    num = torch.zeros(n_slots, dtype=returns.dtype, device=m.device).index_add_(0, slot, returns * wcum * m)
    den = torch.zeros(n_slots, dtype=returns.dtype, device=m.device).index_add_(0, slot, wcum * m) + OTB_EPS
    base = (num / den)[slot]  # (tokens,): B_t = E[G_t W_t] / E[W_t] of the row's group at position t
    cnt = rows.expand(seg_count(g, n, returns.dtype)[g])
    base = torch.where(cnt > 1, base, torch.zeros_like(base))
    length = rows.sum(m)
    cut, second = _zero_tail_rows(length, torch.ones_like(length, dtype=torch.bool), b)
    tail = rows.expand(cut) & (pos >= rows.expand(second))
    base = torch.where(tail, torch.zeros_like(base), base)
    return (returns - base) * m, returns


def _group_slots(extent: torch.Tensor, index: torch.Tensor, row_ids: torch.Tensor, g: torch.Tensor,
                 n: int) -> tuple[torch.Tensor, int]:
    """One slot per (group, timestep) pair: a group's timesteps ``[0, max extent of its rows)``
    laid out one group after the other, so the table is as large as the groups' longest rows,
    never ``groups x longest row of the step``. ``extent`` ``(rows,)``, ``index`` and ``row_ids``
    per token (``index`` the token's timestep); returns the ``(tokens,)`` slots and their number."""
    span = torch.zeros(n, dtype=torch.long, device=g.device)
    span.scatter_reduce_(0, g, extent.to(torch.long), reduce="amax", include_self=True)
    start = torch.cumsum(span, 0) - span
    return start[g][row_ids] + index, int(span.sum())


@ESTIMATORS.register(
    "tir_optimal_token_baseline",
    needs=("old_log_probs", "sum_pi_squared"),
    grouped=True, source="verl core_algos, tir_optimal_token_baseline (multi-turn)",
)
def tir_optimal_token_baseline(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-turn variant: timesteps are action-token ranks (tool tokens skipped); rows without
    action tokens are left out of their group. returns = reward-to-go (all positions)."""
    b, m, rows = inp.batch, inp.mask, inp.rows
    returns, wcum = _otb_inputs(inp, "tir_optimal_token_baseline")
    g, n = b.group_ids, b.n_groups
    act = m > 0
    length = rows.count(act)
    rank = cumsum_segmented(act.to(torch.float32), rows).to(torch.long) - 1  # index among the row's action tokens
    idx = torch.nonzero(act).flatten()
    slot, n_slots = _group_slots(length, rank[idx], rows.row_ids[idx], g, n)
    num = torch.zeros(n_slots, dtype=returns.dtype, device=m.device).index_add_(0, slot, (returns * wcum)[idx])
    den = torch.zeros(n_slots, dtype=returns.dtype, device=m.device).index_add_(0, slot, wcum[idx])
    b_star = num / (den + OTB_EPS)
    member = length > 0
    members = rows.expand(seg_sum(member.to(returns.dtype), g, n)[g])
    base_tok = torch.zeros_like(returns)
    base_tok[idx] = b_star[slot]
    base_tok = torch.where(members > 1, base_tok, torch.zeros_like(base_tok))
    cut, second = _zero_tail_rows(length.to(returns.dtype), member, b)
    tail = rows.expand(cut) & (rank >= rows.expand(second)) & act
    base_tok = torch.where(tail, torch.zeros_like(base_tok), base_tok)
    adv = torch.where(act, returns - base_tok, torch.zeros_like(returns)) * m
    return adv, returns
