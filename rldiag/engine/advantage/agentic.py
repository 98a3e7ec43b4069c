"""Agentic (multi-step trajectory) estimators of the Claw-R1 / Agent-R1 lineage of agent trainers built on verl.

A row is one agent step: one generated response of a trajectory. ``traj_uid`` names the
trajectory and ``step_index`` (0, 1, ...) orders its steps; ``uid`` is still the prompt group.
These keys are rldiag's names (verl itself has no such estimators):

- ``step_gae``: a response is one action. Step reward = sum of the row's masked token rewards,
  step value = the row's first value (the state before the response). GAE over each trajectory's
  steps (a missing step index counts as a step with reward 0 and value 0, as in the reference
  table layout), step-level whitening ``(A - mean) / (std + 1e-8)`` over the rows of each training
  step (sample std), broadcast over the mask; returns ``(A + V) * mask`` before whitening.
- ``token_gae_cross_step``: token-level mask-skipping GAE over the concatenation of a
  trajectory's rows in step order: mask-0 tokens (tool output, rejected tokens) neither update nor
  reset the recursion, so credit flows from a later step back to earlier ones; missing step
  indices are skipped. returns ``(A + V) * mask``; advantages whitened over each step's mask (verl's
  masked_whiten, not re-masked).
- ``traj_grpo``: trajectory score = sum over its rows of the masked token rewards; GRPO over the
  trajectories of each prompt group (a trajectory belongs to the group of its first row);
  the trajectory's scalar is shared by all its rows, broadcast over the mask.

These estimators have no verl reference: they are held to the float64 computation of their
formulas. Their sums over a row's tokens, their trajectory totals, their step-level GAE table
and every mean and variance are accumulated in float64 (:mod:`rldiag.engine.precise`: one value
per row, trajectory or step in float64, never one per token) and rounded to float32 once, so a
step of any size is within float32 tolerance of the exact values, and an exactly tied step or
group whitens to exactly 0 (a float32 mean one ulp off turns ``std + 1e-8`` whitening of a tie
into an O(1) value).
"""

from __future__ import annotations

import torch

from rldiag.engine.advantage.base import (
    ESTIMATORS,
    AdvInput,
    flag_rows,
    grpo_scalar,
    require_extra,
    require_field,
)
from rldiag.engine.precise import row_sums64
from rldiag.engine.scan import gae_segmented
from rldiag.engine.segments import seg_count, seg_mean, seg_sum
from rldiag.engine.whiten import step_whiten

#: epsilon of the step-level whitening (added to the std, outside the square root).
STEP_WHITEN_EPS = 1e-8
_TRAJ_HINT = "the trajectory id of each agent-step row"
_STEP_HINT = "the 0-based position of the row in its trajectory"


def _trajectories(inp: AdvInput, name: str, with_steps: bool) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """Compact trajectory ids ``(rows,)``, their number, and (with_steps) the step indices
    ``(rows,)`` int64 (rows with invalid indices flagged, their index clamped to 0)."""
    b = inp.batch
    traj = require_extra(inp, "traj_uid", name, _TRAJ_HINT).to(torch.long)
    _, tid = torch.unique(traj, return_inverse=True)
    n_traj = int(tid.max()) + 1 if tid.numel() else 0
    if not with_steps:
        return tid, n_traj, None
    step = require_extra(inp, "step_index", name, _STEP_HINT).to(torch.long)
    flag_rows(inp.errors, step < 0, b, f"{name}: step_index must be >= 0")
    step = step.clamp_min(0)
    n_idx = int(step.max()) + 1 if step.numel() else 1
    _, inv, cnt = torch.unique(tid * n_idx + step, return_inverse=True, return_counts=True)
    flag_rows(
        inp.errors, cnt[inv] > 1, b,
        f"{name}: two rows share one (traj_uid, step_index); each agent step must be one row",
    )
    return tid, n_traj, step


@ESTIMATORS.register(
    "step_gae", needs=("values", "traj_uid", "step_index"), whitens="step",
    source="Claw-R1 step-level GAE (one response = one action); arXiv:1506.02438",
)
def step_gae(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-level GAE over trajectories; see the module docstring."""
    b, s, m = inp.batch, inp.settings, inp.mask
    values = require_field(inp, "values", "step_gae")
    gamma, lam = float(s["algorithm.gamma"]), float(s["algorithm.lam"])
    tid, n_traj, step = _trajectories(inp, "step_gae", with_steps=True)
    assert step is not None
    layout = b.rows
    f64 = torch.float64
    reward = row_sums64(inp.rewards * m, layout)  # step reward: the response is one action
    # V(S_t): the value before the first response token (0 for an empty row)
    v0 = torch.zeros_like(reward)
    live = layout.lengths > 0
    v0[live] = values[layout.offsets[:-1][live]].to(f64)
    # the (trajectory, step index) table of Claw-R1's layout, in float64 (one value per agent step)
    n_idx = int(step.max()) + 1 if step.numel() else 1
    r_map = torch.zeros((n_traj, n_idx), dtype=f64, device=m.device)
    v_map = torch.zeros((n_traj, n_idx), dtype=f64, device=m.device)
    r_map[tid, step] = reward
    v_map[tid, step] = v0
    a_map = torch.empty_like(r_map)
    last = torch.zeros(n_traj, dtype=f64, device=m.device)
    for t in range(n_idx - 1, -1, -1):
        nxt = v_map[:, t + 1] if t < n_idx - 1 else 0.0
        delta = r_map[:, t] + gamma * nxt - v_map[:, t]  # Schulman et al. 2016 (arXiv:1506.02438) on steps
        last = delta + gamma * lam * last
        a_map[:, t] = last
    adv = a_map[tid, step]
    returns = (adv + v0).to(m.dtype)
    rows = seg_count(b.step_ids, b.n_steps, f64)
    inp.errors.flag(
        rows < 2, "step_gae: step-level whitening needs at least 2 rows (the sample std of one value is NaN)"
    )
    dev = adv - seg_mean(adv, b.step_ids, b.n_steps)[b.step_ids]
    std = (seg_sum(dev * dev, b.step_ids, b.n_steps) / (rows - 1).clamp_min(1)).sqrt()
    white = (dev / (std[b.step_ids] + STEP_WHITEN_EPS)).to(m.dtype)
    return layout.expand(white) * m, layout.expand(returns) * m


@ESTIMATORS.register(
    "token_gae_cross_step",
    needs=("values", "traj_uid", "step_index"),
    whitens="step",
    source="Claw-R1 token-level cross-step GAE; arXiv:1506.02438",
)
def token_gae_cross_step(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE across a trajectory's steps; see the module docstring."""
    b, s, m = inp.batch, inp.settings, inp.mask
    values = require_field(inp, "values", "token_gae_cross_step")
    tid, n_traj, step = _trajectories(inp, "token_gae_cross_step", with_steps=True)
    assert step is not None
    rows = b.rows
    n_idx = int(step.max()) + 1 if step.numel() else 1
    # the action tokens of each trajectory, its rows in step order, one trajectory after another
    order = torch.argsort(tid * n_idx + step, stable=True)
    traj_rows, tok = rows.take(order)
    act = m[tok] > 0
    idx = tok[act]  # positions in the batch of the concatenated action tokens
    t_of = tid[order][traj_rows.row_ids][act]  # their trajectory
    last = torch.ones_like(t_of, dtype=torch.bool)
    if t_of.numel() > 1:
        last[:-1] = t_of[1:] != t_of[:-1]  # the last action token of its trajectory
    gamma, lam = float(s["algorithm.gamma"]), float(s["algorithm.lam"])
    ones = torch.ones(idx.numel(), dtype=inp.rewards.dtype, device=m.device)
    raw_c = gae_segmented(inp.rewards[idx], values[idx], ones, last, gamma, lam)
    raw = torch.zeros_like(inp.rewards)
    raw[idx] = raw_c
    returns = (raw + values) * m
    adv = step_whiten(raw, m, rows, b.step_ids, b.n_steps, inp.errors, "token_gae_cross_step advantage whitening",
                      stats64=True)
    return adv, returns


@ESTIMATORS.register("traj_grpo", needs=("traj_uid",), whitens="group", source="Claw-R1 trajectory-level GRPO; arXiv:2402.03300")
def traj_grpo(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Trajectory-level GRPO; see the module docstring. Honours ``norm_adv_by_std_in_grpo``."""
    b, m = inp.batch, inp.mask
    tid, n_traj, _ = _trajectories(inp, "traj_grpo", with_steps=False)
    step_scores = row_sums64(inp.rewards * m, b.rows)
    total = seg_sum(step_scores, tid, n_traj)  # outcome of the whole trajectory, float64
    rows = torch.arange(tid.numel(), device=m.device)
    first = torch.full((n_traj,), tid.numel(), dtype=torch.long, device=m.device)
    first.scatter_reduce_(0, tid, rows, reduce="amin", include_self=True)
    norm = bool(inp.settings["algorithm.norm_adv_by_std_in_grpo"])
    scalar = grpo_scalar(total, b.group_ids[first], b.n_groups, norm).to(m.dtype)  # statistics in float64
    adv = b.rows.expand(scalar[tid]) * m
    return adv, adv
