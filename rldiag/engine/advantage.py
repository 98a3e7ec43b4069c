"""Advantage estimators, keyed by verl's ``algorithm.adv_estimator`` strings.

Every estimator has one signature: ``fn(inp: AdvInput) -> (advantages, returns)``, both
``(rows, tokens)``. ``inp.mask`` is the post-correction ``response_mask``; ``inp.rewards`` the
token-level rewards after optional KL shaping (rewards at rejected tokens are not zeroed, as in
verl). Group statistics are segment reductions over ``batch.group_ids`` and whitening over
``batch.step_ids``, so packed steps never mix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rldiag.config.settings import Settings
from rldiag.engine.batch import Batch
from rldiag.engine.errors import StepErrors
from rldiag.engine.segments import seg_std
from rldiag.engine.whiten import step_whiten
from rldiag.registry import Registry

GRPO_EPS = 1e-6


@dataclass
class AdvInput:
    batch: Batch
    rewards: torch.Tensor  # (rows, tokens)
    mask: torch.Tensor  # (rows, tokens) post-correction response_mask
    settings: Settings
    errors: StepErrors


AdvFn = Callable[[AdvInput], tuple[torch.Tensor, torch.Tensor]]
ESTIMATORS: Registry[AdvFn] = Registry("advantage estimator")


def _gae_scan(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """verl's mask-skipping GAE recursion, one vectorised step per token position.

    At a mask-0 position (tool observation, rejected token, padding) neither the next value nor
    the running advantage is updated, so credit flows across it (seed 002 section 6.4).
    Returns raw advantages ``(rows, tokens)``.
    """
    r, v, m = rewards.T.contiguous(), values.T.contiguous(), mask.T.contiguous()
    out = torch.empty_like(r)
    rows = r.shape[1]
    nextvalues = torch.zeros(rows, dtype=r.dtype, device=r.device)
    lastgaelam = torch.zeros(rows, dtype=r.dtype, device=r.device)
    gl = gamma * lam
    for t in range(r.shape[0] - 1, -1, -1):
        delta = r[t] + gamma * nextvalues - v[t]  # Schulman et al. 2016 (arXiv:1506.02438), TD error
        candidate = delta + gl * lastgaelam
        nextvalues = v[t] * m[t] + (1 - m[t]) * nextvalues
        lastgaelam = candidate * m[t] + (1 - m[t]) * lastgaelam
        out[t] = lastgaelam
    return out.T


@ESTIMATORS.register("gae", needs=("values",), source="seed 002 s6; arXiv:1506.02438")
def gae(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE; returns = raw advantages + values; advantages whitened over each step's mask."""
    b, s = inp.batch, inp.settings
    raw = _gae_scan(inp.rewards, b.values, inp.mask, float(s["algorithm.gamma"]), float(s["algorithm.lam"]))
    returns = raw + b.values
    adv = step_whiten(raw, inp.mask, b.step_ids, b.n_steps, inp.errors, "gae advantage whitening")
    return adv, returns


def _group_stats(scores: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: (group mean, group sample std, group size) with verl's singleton rule
    (mean 0, std 1 for a group of one)."""
    mean, std, cnt = seg_std(scores, batch.group_ids, batch.n_groups)
    single = cnt <= 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    g = batch.group_ids
    return mean[g], std[g], cnt[g]


@ESTIMATORS.register("grpo", needs=(), source="seed 002 s7; arXiv:2402.03300; Dr. GRPO arXiv:2503.20783")
def grpo(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Outcome GRPO: row score = sum of token rewards; (score - mean) / (std + 1e-6) within the
    uid group, or score - mean with ``norm_adv_by_std_in_grpo=false`` (Dr. GRPO); broadcast over
    the mask. returns == advantages."""
    scores = inp.rewards.sum(-1)
    mean, std, _ = _group_stats(scores, inp.batch)
    if inp.settings["algorithm.norm_adv_by_std_in_grpo"]:
        scalar = (scores - mean) / (std + GRPO_EPS)
    else:
        scalar = scores - mean
    adv = scalar.unsqueeze(-1) * inp.mask
    return adv, adv


@ESTIMATORS.register("rloo", needs=(), source="seed 002 s8; arXiv:2402.14740")
def rloo(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out baseline: ``n/(n-1) * (score - group mean)``; a singleton group keeps its
    raw score (verl's ``rloo``; ``rloo_vectorized`` zeroes it instead)."""
    scores = inp.rewards.sum(-1)
    mean, _, cnt = _group_stats(scores, inp.batch)
    factor = cnt / (cnt - 1).clamp_min(1)
    scalar = torch.where(cnt > 1, scores * factor - mean * factor, scores)
    adv = scalar.unsqueeze(-1) * inp.mask
    return adv, adv


def estimate(name: str, inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    return ESTIMATORS.get(name)(inp)
