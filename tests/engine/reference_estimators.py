"""Straightforward reference implementations of verl's (and Claw-R1's agentic) advantage estimators,
one training step at a time, the way the trainer code does it: Python loops over groups, rows,
trajectories and token positions, group statistics with ``torch.mean`` / ``torch.std`` of the
stacked group, float32 tensors. Written from the formulas of verl's core_algos.py, the papers and
verl's documented behaviour, to check the vectorised engine against.

Every function takes the step's padded ``(rows, W)`` float32 tensors and per-row Python lists and
returns ``(advantages, returns)``; where the trainer raises, these raise ``ValueError``.
"""

from __future__ import annotations

from collections import defaultdict

import torch

EPS = 1e-6


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    n = mask.sum()
    if float(n) == 0:
        raise ValueError("At least one element in the mask has to be 1.")
    if float(n) == 1:
        raise ValueError("The sum of the mask is one, which can cause a division by zero.")
    mean = (values * mask).sum() / (n + 1e-8)
    var = (((values - mean) ** 2) * mask).sum() / (n + 1e-8)
    var = var * (n / (n - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def _groups(keys) -> dict:
    out = defaultdict(list)
    for i, k in enumerate(keys):
        out[k].append(i)
    return out


def _mean_std(xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    if len(xs) == 1:
        return torch.tensor(0.0), torch.tensor(1.0)
    t = torch.stack(xs)
    return t.mean(), t.std()


# ---- outcome estimators ------------------------------------------------------------------------


def grpo(rewards, mask, uids, norm=True):
    scores = rewards.sum(-1)
    stats = {u: _mean_std([scores[i] for i in idx]) for u, idx in _groups(uids).items()}
    out = torch.zeros_like(scores)
    for i, u in enumerate(uids):
        mean, std = stats[u]
        out[i] = (scores[i] - mean) / (std + EPS) if norm else scores[i] - mean
    adv = out.unsqueeze(-1) * mask
    return adv, adv


def grpo_folded(rewards, mask, uids, sessions, out_idx, norm=True):
    """V1 multi-output folding: only each (uid, session)'s final output enters GRPO."""
    final: dict = {}
    for i, (u, s) in enumerate(zip(uids, sessions)):
        key = (u, s)
        if key not in final or final[key][0] < out_idx[i]:
            final[key] = (out_idx[i], i)
    keys = list(final)
    frows = [final[k][1] for k in keys]
    fadv, _ = grpo(rewards[frows], mask[frows], [uids[r] for r in frows], norm)
    first = mask[frows].argmax(dim=1)
    fscore = fadv[torch.arange(len(frows)), first]
    local = {k: j for j, k in enumerate(keys)}
    per_row = torch.stack([fscore[local[(u, s)]] for u, s in zip(uids, sessions)])
    adv = per_row.unsqueeze(-1) * mask
    return adv, adv


def grpo_vectorized(rewards, mask, uids):
    scores = rewards.sum(-1)
    out = torch.zeros_like(scores)
    for _, idx in _groups(uids).items():
        x = scores[idx]
        n = len(idx)
        if n == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean = x.sum() / n
            std = torch.sqrt(((x - mean) ** 2).sum() / (n - 1))
        for i in idx:
            out[i] = (scores[i] - mean) / (std + EPS)
    adv = out.unsqueeze(-1) * mask
    return adv, adv


def grpo_passk(rewards, mask, uids, norm=True):
    scores = rewards.sum(-1)
    out = torch.zeros_like(scores)
    for u, idx in _groups(uids).items():
        x = scores[idx]
        if x.numel() < 2:
            raise ValueError(f"Pass@k requires at least 2 samples per group. Got {x.numel()} for group {u}.")
        top, top_idx = torch.topk(x, 2)
        a = top[0] - top[1]
        if norm:
            a = a / (x.std() + EPS)
        out[idx[int(top_idx[0])]] = a
    adv = out.unsqueeze(-1) * mask
    return adv, adv


def gdpo(rewards, mask, uids, comps: list[torch.Tensor], weights, lengths):
    """Each component is placed at the row's last position (position -1 for an empty row, as
    verl's ``attention_mask.sum - 1`` gives), run through exact GRPO, weighted, whitened."""
    rows, width = mask.shape
    total = None
    for k, comp in enumerate(comps):
        placed = torch.zeros(rows, width)
        for i in range(rows):
            placed[i, int(lengths[i]) - 1] = comp[i]
        a, _ = grpo(placed, mask, uids, True)
        total = weights[k] * a if total is None else total + weights[k] * a
    adv = masked_whiten(total, mask) * mask
    return adv, adv


def rloo(rewards, mask, uids):
    scores = rewards.sum(-1)
    out = scores.clone()
    for _, idx in _groups(uids).items():
        if len(idx) > 1:
            mean = torch.stack([scores[i] for i in idx]).mean()
            n = len(idx)
            for i in idx:
                out[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
    adv = out.unsqueeze(-1) * mask
    return adv, adv


def rloo_vectorized(rewards, mask, uids):
    scores = rewards.sum(-1)
    out = torch.zeros_like(scores)
    for _, idx in _groups(uids).items():
        n = len(idx)
        if n > 1:
            total = scores[idx].sum()
            for i in idx:
                out[i] = (n * scores[i] - total) / (n - 1)
    adv = out.unsqueeze(-1) * mask
    return adv, adv


def opo(rewards, mask, uids):
    scores = rewards.sum(-1)
    length = mask.sum(-1)
    out = torch.zeros_like(scores)
    for _, idx in _groups(uids).items():
        if len(idx) == 1:
            bsl = torch.tensor(0.0)
        else:
            s, ln = torch.stack([scores[i] for i in idx]), torch.stack([length[i] for i in idx])
            bsl = (ln * s).sum() / ln.sum()
        for i in idx:
            out[i] = scores[i] - bsl
    adv = out.unsqueeze(-1) * mask
    return adv, adv


def gpg(rewards, mask, uids):
    scores = rewards.sum(-1)
    bsz = scores.shape[0]
    alpha = bsz / torch.count_nonzero(scores).clamp(min=1)
    stats = {u: _mean_std([scores[i] for i in idx]) for u, idx in _groups(uids).items()}
    out = torch.zeros_like(scores)
    for i, u in enumerate(uids):
        out[i] = alpha * (scores[i] - stats[u][0]) / 1.0
    adv = out.unsqueeze(-1) * mask
    return adv, adv


# ---- reward-to-go estimators ------------------------------------------------------------------


def reinforce_plus_plus(rewards, mask, gamma, carry=True):
    """``carry``: verl >= 0.9.0 (the running return passes mask-0 tokens, return 0 there); else
    verl 0.8.0's reset after a mask-0 token."""
    rows, width = rewards.shape
    returns = torch.zeros_like(rewards)
    for i in range(rows):
        running = torch.tensor(0.0)
        for t in reversed(range(width)):
            if carry:
                if mask[i, t] != 0:
                    running = rewards[i, t] + gamma * running
                    returns[i, t] = running
                continue
            running = rewards[i, t] + gamma * running
            returns[i, t] = running
            if mask[i, t] == 0:
                running = torch.tensor(0.0)
    return masked_whiten(returns, mask) * mask, returns


def reinforce_plus_plus_baseline(rewards, mask, uids):
    scores = rewards.sum(-1)
    means = {u: (torch.tensor(0.0) if len(idx) == 1 else torch.stack([scores[i] for i in idx]).mean())
             for u, idx in _groups(uids).items()}
    centred = torch.stack([scores[i] - means[u] for i, u in enumerate(uids)])
    tiled = centred.unsqueeze(-1).tile([1, rewards.shape[1]]) * mask
    adv = masked_whiten(tiled, mask) * mask
    return adv, adv


def remax(rewards, mask, baselines):
    rows, width = rewards.shape
    returns = torch.zeros_like(rewards)
    for i in range(rows):
        acc = torch.tensor(0.0)
        for t in reversed(range(width)):
            acc = acc + rewards[i, t] * mask[i, t]
            returns[i, t] = acc
    return returns - baselines.unsqueeze(-1) * mask, returns


# ---- optimal token baseline -------------------------------------------------------------------


def _otb_common(rewards, mask, old_lp, spp):
    rows, width = rewards.shape
    returns = torch.zeros_like(rewards)
    wcum = torch.zeros_like(rewards)
    for i in range(rows):
        acc = torch.tensor(0.0)
        for t in reversed(range(width)):
            acc = acc + rewards[i, t] * mask[i, t]
            returns[i, t] = acc
        run = torch.tensor(0.0)
        for t in range(width):
            run = run + (1 - 2 * torch.exp(old_lp[i, t]) + spp[i, t]) * mask[i, t]
            wcum[i, t] = run
    return returns, wcum


def _tail_cut(lengths: list[int]) -> tuple[int | None, int]:
    """(position in the list of the strictly longest entry or None, second longest length)."""
    srt = sorted(lengths)
    mx, second = srt[-1], srt[-2]
    where = [j for j, ln in enumerate(lengths) if ln == mx]
    return (where[0] if len(where) == 1 and mx > second else None), second


def optimal_token_baseline(rewards, mask, uids, old_lp, spp):
    returns, wcum = _otb_common(rewards, mask, old_lp, spp)
    rows, width = rewards.shape
    base = torch.zeros_like(returns)
    for _, idx in _groups(uids).items():
        if len(idx) == 1:
            continue
        for t in range(width):
            num = sum(returns[i, t] * wcum[i, t] * mask[i, t] for i in idx)
            den = sum(wcum[i, t] * mask[i, t] for i in idx) + 1e-8
            for i in idx:
                base[i, t] = num / den
        lens = [int(mask[i].sum()) for i in idx]
        j, second = _tail_cut(lens)
        if j is not None:
            base[idx[j], second:] = 0.0
    return (returns - base) * mask, returns


def tir_optimal_token_baseline(rewards, mask, uids, old_lp, spp):
    returns, wcum = _otb_common(rewards, mask, old_lp, spp)
    rows, _ = rewards.shape
    seq_r = [[returns[i, t] for t in range(mask.shape[1]) if mask[i, t] > 0] for i in range(rows)]
    seq_w = [[wcum[i, t] for t in range(mask.shape[1]) if mask[i, t] > 0] for i in range(rows)]
    groups = _groups([u if seq_r[i] else None for i, u in enumerate(uids)])
    groups.pop(None, None)
    base = [[torch.tensor(0.0)] * len(seq_r[i]) for i in range(rows)]
    for _, idx in groups.items():
        if len(idx) == 1:
            continue
        kmax = max(len(seq_r[i]) for i in idx)
        for k in range(kmax):
            num = sum((seq_r[i][k] * seq_w[i][k] for i in idx if k < len(seq_r[i])), torch.tensor(0.0))
            den = sum((seq_w[i][k] for i in idx if k < len(seq_w[i])), torch.tensor(0.0))
            b = num / (den + 1e-8)
            for i in idx:
                if k < len(seq_r[i]):
                    base[i][k] = b
        lens = [len(seq_r[i]) for i in idx]
        j, second = _tail_cut(lens)
        if j is not None:
            row = idx[j]
            for k in range(second, len(base[row])):
                base[row][k] = torch.tensor(0.0)
    adv = torch.zeros_like(returns)
    for i in range(rows):
        k = 0
        for t in range(mask.shape[1]):
            if mask[i, t] > 0:
                adv[i, t] = seq_r[i][k] - base[i][k]
                k += 1
    return adv * mask, returns


# ---- agentic estimators (Claw-R1) ------------------------------------------------------------


def step_gae(rewards, mask, values, traj, step_idx, gamma, lam):
    rows = rewards.shape[0]
    reward = (rewards * mask).sum(dim=1)
    v0 = values[:, 0]
    n_steps = max(step_idx) + 1
    table_r: dict = defaultdict(lambda: [torch.tensor(0.0)] * n_steps)
    table_v: dict = defaultdict(lambda: [torch.tensor(0.0)] * n_steps)
    for i in range(rows):
        table_r[traj[i]] = list(table_r[traj[i]])
        table_v[traj[i]] = list(table_v[traj[i]])
        table_r[traj[i]][step_idx[i]] = reward[i]
        table_v[traj[i]][step_idx[i]] = v0[i]
    adv_of: dict = {}
    for tr in table_r:
        last = torch.tensor(0.0)
        for t in reversed(range(n_steps)):
            nxt = table_v[tr][t + 1] if t < n_steps - 1 else torch.tensor(0.0)
            delta = table_r[tr][t] + gamma * nxt - table_v[tr][t]
            last = delta + gamma * lam * last
            adv_of[(tr, t)] = last
    adv = torch.stack([adv_of[(traj[i], step_idx[i])] for i in range(rows)])
    ret = adv + v0
    white = (adv - adv.mean()) / (adv.std() + 1e-8)
    return white.unsqueeze(1) * mask, ret.unsqueeze(1) * mask


def token_gae_cross_step(rewards, mask, values, traj, step_idx, gamma, lam):
    rows, width = rewards.shape
    adv = torch.zeros_like(rewards)
    ret = torch.zeros_like(rewards)
    by_traj = _groups(traj)
    for _, idx in by_traj.items():
        nextv, last = torch.tensor(0.0), torch.tensor(0.0)
        for i in sorted(idx, key=lambda r: step_idx[r], reverse=True):
            for t in reversed(range(width)):
                if mask[i, t] > 0:
                    delta = rewards[i, t] + gamma * nextv - values[i, t]
                    last = delta + gamma * lam * last
                    nextv = values[i, t]
                    adv[i, t] = last
                    ret[i, t] = last + values[i, t]
    return masked_whiten(adv, mask), ret


def traj_grpo(rewards, mask, uids, traj, norm=True):
    step_scores = (rewards * mask).sum(-1)
    total: dict = {}
    group_of: dict = {}
    for i, tr in enumerate(traj):
        if tr in total:
            total[tr] = total[tr] + step_scores[i]
        else:
            total[tr] = step_scores[i]
            group_of[tr] = uids[i]
    by_group = defaultdict(list)
    for tr, s in total.items():
        by_group[group_of[tr]].append(s)
    stats = {g: _mean_std(xs) for g, xs in by_group.items()}
    adv_of = {}
    for tr, s in total.items():
        mean, std = stats[group_of[tr]]
        adv_of[tr] = (s - mean) / (std + EPS) if norm else s - mean
    per_row = torch.stack([adv_of[tr] for tr in traj])
    adv = per_row.unsqueeze(-1) * mask
    return adv, adv
