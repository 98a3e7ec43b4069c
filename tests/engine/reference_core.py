"""Straightforward reference implementations (Python loops over rows and time, one step),
written from the formulas of verl/trainer/ppo/core_algos.py and the papers, to check the vectorised
engine against."""

from __future__ import annotations

import math
from collections import defaultdict

import torch


def masked_whiten_ref(values, mask):
    flat = [v for row, mrow in zip(values, mask) for v, m in zip(row, mrow) if m]
    n = len(flat)
    mean = sum(flat) / (n + 1e-8)
    var = sum((v - mean) ** 2 for v in flat) / (n + 1e-8) * n / (n - 1)
    inv = 1.0 / math.sqrt(var + 1e-8)
    return [[(v - mean) * inv for v in row] for row in values]


def gae_ref(rewards, values, mask, gamma, lam):
    adv_all, ret_all = [], []
    for r, v, m in zip(rewards, values, mask):
        T = len(r)
        adv = [0.0] * T
        nextv, last = 0.0, 0.0
        for t in reversed(range(T)):
            delta = r[t] + gamma * nextv - v[t]
            cand = delta + gamma * lam * last
            if m[t]:
                nextv, last = v[t], cand
            adv[t] = last
        adv_all.append(adv)
        ret_all.append([a + b for a, b in zip(adv, v)])
    return masked_whiten_ref(adv_all, mask), ret_all


def grpo_ref(rewards, mask, uids, norm_by_std=True, eps=1e-6):
    scores = [sum(r) for r in rewards]
    groups = defaultdict(list)
    for s, u in zip(scores, uids):
        groups[u].append(s)
    out = []
    for s, u, m in zip(scores, uids, mask):
        g = groups[u]
        if len(g) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(g) / len(g)
            std = math.sqrt(sum((x - mean) ** 2 for x in g) / (len(g) - 1))
        a = (s - mean) / (std + eps) if norm_by_std else s - mean
        out.append([a * mm for mm in m])
    return out


def rloo_ref(rewards, mask, uids):
    scores = [sum(r) for r in rewards]
    groups = defaultdict(list)
    for s, u in zip(scores, uids):
        groups[u].append(s)
    out = []
    for s, u, m in zip(scores, uids, mask):
        g = groups[u]
        if len(g) > 1:
            others = (sum(g) - s) / (len(g) - 1)  # the leave-one-out baseline itself
            a = s - others
        else:
            a = s
        out.append([a * mm for mm in m])
    return out


def vanilla_token_losses_ref(old, new, adv, clip_low, clip_high, clip_c):
    out, clipped, lower = [], [], []
    for o_row, n_row, a_row in zip(old, new, adv):
        lrow, crow, lwrow = [], [], []
        for o, n, a in zip(o_row, n_row, a_row):
            lr = max(-20.0, min(20.0, n - o))
            ratio = math.exp(lr)
            l1 = -a * ratio
            l2 = -a * max(1 - clip_low, min(1 + clip_high, ratio))
            c1 = max(l1, l2)
            l3 = -a * clip_c
            loss = min(l3, c1) if a < 0 else c1
            lrow.append(loss)
            crow.append(1.0 if l2 > l1 else 0.0)
            lwrow.append(1.0 if (c1 > l3 and a < 0) else 0.0)
        out.append(lrow)
        clipped.append(crow)
        lower.append(lwrow)
    return out, clipped, lower


# ---- verl's one-position-at-a-time recursions on padded (rows, T) tensors: the references of
# the engine's segmented scans (rldiag.engine.scan)


def reverse_linear_scan_loop(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The same recurrence, one vectorised step per position (the reference; verl's form)."""
    out = torch.empty_like(b)
    x = torch.zeros_like(b[..., 0])
    for t in range(b.shape[-1] - 1, -1, -1):
        x = a[..., t] * x + b[..., t]
        out[..., t] = x
    return out


def gae_loop(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """verl's GAE recursion one position at a time, vectorised over rows (the reference form)."""
    r, v, m = rewards.T.contiguous(), values.T.contiguous(), mask.T.contiguous()
    out = torch.empty_like(r)
    nextvalues = torch.zeros(r.shape[1], dtype=r.dtype, device=r.device)
    lastgaelam = torch.zeros(r.shape[1], dtype=r.dtype, device=r.device)
    for t in range(r.shape[0] - 1, -1, -1):
        delta = r[t] + gamma * nextvalues - v[t]
        candidate = delta + gamma * lam * lastgaelam
        nextvalues = v[t] * m[t] + (1 - m[t]) * nextvalues
        lastgaelam = candidate * m[t] + (1 - m[t]) * lastgaelam
        out[t] = lastgaelam
    return out.T


def reward_to_go_loop(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++'s resetting reward-to-go one position at a time on padded ``(rows, T)``."""
    r, m = rewards.T.contiguous(), mask.T.contiguous()
    out = torch.empty_like(r)
    running = torch.zeros(r.shape[1], dtype=r.dtype, device=r.device)
    for t in range(r.shape[0] - 1, -1, -1):
        running = r[t] + gamma * running
        out[t] = running
        running = running * m[t]
    return out.T


def reward_to_go_carry_loop(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++'s carrying reward-to-go (verl >= 0.9.0) one position at a time on padded
    ``(rows, T)``: a mask-0 token passes the running return on unchanged and returns 0."""
    r, m = rewards.T.contiguous(), mask.T.to(rewards.dtype).contiguous()
    out = torch.empty_like(r)
    running = torch.zeros(r.shape[1], dtype=r.dtype, device=r.device)
    for t in range(r.shape[0] - 1, -1, -1):
        step = r[t] + gamma * running
        out[t] = step * m[t]
        running = torch.where(m[t] > 0, step, running)
    return out.T
