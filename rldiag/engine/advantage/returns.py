"""The critic-based and reward-to-go estimators: GAE, REINFORCE++ (and its baseline), ReMax."""

from __future__ import annotations

import torch

from rldiag.engine.advantage.base import (
    ESTIMATORS,
    AdvInput,
    broadcast,
    gae_scan,
    group_mean,
    require_field,
    reverse_cumsum,
    reward_to_go_carrying,
    reward_to_go_resetting,
)
from rldiag.engine.whiten import step_whiten

# ---- critic-based -----------------------------------------------------------------------------


@ESTIMATORS.register("gae", needs=("values",), whitens="step",
                     source="verl core_algos.compute_gae_advantage_return; arXiv:1506.02438")
def gae(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE; returns = raw advantages + values; advantages whitened over each step's mask."""
    b, s = inp.batch, inp.settings
    values = require_field(inp, "values", "gae")
    raw = gae_scan(inp.rewards, values, inp.mask, float(s["algorithm.gamma"]), float(s["algorithm.lam"]), b.rows)
    returns = raw + values
    adv = step_whiten(raw, inp.mask, b.rows, b.step_ids, b.n_steps, inp.errors, "gae advantage whitening")
    return adv, returns


# ---- reward-to-go family ----------------------------------------------------------------------


@ESTIMATORS.register("reinforce_plus_plus", needs=(), whitens="step",
                     source="verl core_algos.compute_reinforce_plus_plus_outcome_advantage; arXiv:2501.03262")
def reinforce_plus_plus(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted reward-to-go over the mask, whitened over each step's mask and
    masked. At a mask-0 token (tool observation, rejected token) the running return is carried
    through and the return is 0 (verl >= 0.9.0, commit 8a1bf6d5b); verl 0.8.0 resets it there
    instead, keeping the token's own reward-to-go (``rldiag.verl_version``)."""
    b = inp.batch
    gamma = float(inp.settings["algorithm.gamma"])
    rtg = reward_to_go_carrying if inp.settings.has("reinforce_pp_carry") else reward_to_go_resetting
    returns = rtg(inp.rewards, inp.mask, gamma, b.rows)
    adv = step_whiten(returns, inp.mask, b.rows, b.step_ids, b.n_steps, inp.errors, "reinforce_plus_plus whitening")
    return adv * inp.mask, returns


@ESTIMATORS.register("reinforce_plus_plus_baseline", needs=(), whitens="step", grouped=True,
                     source="verl core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage; arXiv:2501.03262")
def reinforce_plus_plus_baseline(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: ``R - group mean`` (mean includes the row; 0 for a singleton group),
    broadcast over the mask, whitened over each step's mask and masked. returns == advantages."""
    b = inp.batch
    scores = b.rows.column_sum(inp.rewards)
    centred = broadcast(scores - group_mean(scores, b), inp.mask, b.rows)
    adv = step_whiten(centred, inp.mask, b.rows, b.step_ids, b.n_steps, inp.errors, "reinforce_plus_plus_baseline whitening")
    adv = adv * inp.mask
    return adv, adv


@ESTIMATORS.register("remax", needs=("reward_baselines",),
                     source="verl core_algos.compute_remax_outcome_advantage; ReMax arXiv:2310.10505")
def remax(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: returns = undiscounted reward-to-go of the masked rewards; advantages = returns minus
    the greedy rollout's reward (``reward_baselines``) on mask-1 tokens (mask-0 tokens keep their
    return, as in verl)."""
    rb = require_field(inp, "reward_baselines", "remax", "the greedy rollout's reward per row")
    returns = reverse_cumsum(inp.rewards * inp.mask, inp.rows)
    adv = returns - inp.rows.expand(rb.to(returns.dtype)) * inp.mask  # ReMax (arXiv:2310.10505), greedy baseline
    return adv, returns
