"""Float64 references of Claw-R1's three multi-step estimators, from their published formulas
(AgentR1/Claw-R1 at 4e1dec6, ``claw_r1/core_algos.py``: ``compute_gae_advantage_return``,
``compute_token_gae_advantage_return``, ``compute_grpo_outcome_advantage`` over trajectories).

Every quantity is computed in float64 from the float32 inputs (numpy), one step at a time: the
exact values that a float32 implementation is held to within float32 tolerance. Inputs are padded
``(rows, W)`` arrays of one training step and per-row lists; outputs ``(rows, W)`` float64.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

#: the epsilons of the formulas: step whitening ``std + 1e-8``; verl's masked mean ``count + 1e-8``
#: and masked whitening ``rsqrt(var + 1e-8)``; GRPO ``std + 1e-6``
STEP_EPS, MASKED_EPS, GRPO_EPS = 1e-8, 1e-8, 1e-6


def _f64(*xs):
    return [np.asarray(x, dtype=np.float64) for x in xs]


def _ids(keys) -> tuple[np.ndarray, int]:
    index = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    return np.array([index[k] for k in keys], dtype=np.int64), len(index)


def step_gae(rewards, mask, values, traj, step_idx, gamma: float, lam: float):
    """A response is one action: its reward is ``sum_t r_t m_t``, its value ``V[:, 0]``. GAE over
    each trajectory's steps (a missing index is reward 0, value 0): ``delta_t = r_t + gamma
    V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}``; returns ``A + V``; advantages
    ``(A - mean) / (std + 1e-8)`` over the step's rows (sample std); both times the mask."""
    r, m, v = _f64(rewards, mask, values)
    reward, v0 = (r * m).sum(1), v[:, 0]
    tid, n_traj = _ids(traj)
    step = np.asarray(step_idx, dtype=np.int64)
    width = int(step.max()) + 1
    r_tab, v_tab = np.zeros((n_traj, width)), np.zeros((n_traj, width))
    r_tab[tid, step], v_tab[tid, step] = reward, v0
    a_tab = np.zeros_like(r_tab)
    nxt_a, nxt_v = np.zeros(n_traj), np.zeros(n_traj)
    for t in range(width - 1, -1, -1):
        nxt_a = r_tab[:, t] + gamma * nxt_v - v_tab[:, t] + gamma * lam * nxt_a
        nxt_v = v_tab[:, t]
        a_tab[:, t] = nxt_a
    adv = a_tab[tid, step]
    white = (adv - adv.mean()) / (adv.std(ddof=1) + STEP_EPS)
    return white[:, None] * m, (adv + v0)[:, None] * m


def masked_whiten(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    """verl's ``masked_whiten`` in float64: mean and Bessel-corrected variance over the mask,
    ``(x - mean) / sqrt(var + 1e-8)`` at every position."""
    n = m.sum()
    mean = (x * m).sum() / (n + MASKED_EPS)
    var = ((x - mean) ** 2 * m).sum() / (n + MASKED_EPS) * n / (n - 1)
    return (x - mean) / np.sqrt(var + MASKED_EPS)


def token_gae_cross_step(rewards, mask, values, traj, step_idx, gamma: float, lam: float):
    """GAE over a trajectory's action tokens (mask 1) taken in step order, one row after another:
    ``delta = r_t + gamma V_next - V_t``, ``A_t = delta + gamma lam A_next``, where ``V_next``
    and ``A_next`` are those of the next action token of the trajectory (0 after the last);
    non-action tokens get 0 before the whitening; returns ``(A + V) m``; advantages verl's masked
    whitening of ``A`` over the step (not re-masked)."""
    r, m, v = _f64(rewards, mask, values)
    adv = np.zeros_like(r)
    by_traj: dict = defaultdict(list)
    for i, t in enumerate(traj):
        by_traj[t].append(i)
    for rows in by_traj.values():
        tokens = [(i, j) for i in sorted(rows, key=lambda k: step_idx[k]) for j in np.flatnonzero(m[i] > 0)]
        a_next = v_next = 0.0
        for i, j in reversed(tokens):
            a_next = r[i, j] + gamma * v_next - v[i, j] + gamma * lam * a_next
            v_next = v[i, j]
            adv[i, j] = a_next
    return masked_whiten(adv, m), (adv + v) * m


def traj_grpo(rewards, mask, uids, traj, norm: bool = True):
    """A trajectory's score is the sum over its rows of ``sum_t r_t m_t``; it belongs to the group
    (``uid``) of its first row; GRPO over the trajectories of each group: ``(S - mean) / (std +
    1e-6)`` (sample std; a group of one: mean 0, std 1), or ``S - mean``; every row of the
    trajectory gets its value times the mask; returns = advantages."""
    r, m = _f64(rewards, mask)
    step_score = (r * m).sum(1)
    total: dict = defaultdict(float)
    group: dict = {}
    for i, t in enumerate(traj):
        total[t] += step_score[i]
        group.setdefault(t, uids[i])
    members: dict = defaultdict(list)
    for t, g in group.items():
        members[g].append(total[t])
    stats = {g: (0.0, 1.0) if len(s) == 1 else (float(np.mean(s)), float(np.std(s, ddof=1))) for g, s in members.items()}
    scalar = {}
    for t, s in total.items():
        mean, std = stats[group[t]]
        scalar[t] = (s - mean) / (std + GRPO_EPS) if norm else s - mean
    adv = np.array([scalar[t] for t in traj])[:, None] * m
    return adv, adv
