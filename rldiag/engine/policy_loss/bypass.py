"""``loss_mode=bypass_mode``: verl's ``compute_policy_loss_bypass_mode``.

The loss treats its ``old_log_prob`` as pi_rollout (what the trainer puts there when
``algorithm.rollout_correction.bypass_mode`` is true; otherwise it is the recomputed pi_old and
the loss runs all the same). On each segment it runs the rollout correction of
``actor_rollout_ref.actor.policy_loss.rollout_correction`` with pi_train = the *current* policy,
then dispatches on ``loss_type`` (:data:`BYPASS_LOSS_TYPES`) with the rejection-rewritten mask:

- ``ppo_clip``: the PPO clipped loss (``vanilla``) against pi_rollout, no IS weights (the PPO
  ratio already is pi_theta / pi_rollout);
- ``reinforce``: ``-w A log pi`` with the IS weights ``w`` (verl ``compute_policy_loss_bypass_mode``, ``loss_type=reinforce``).

The correction's metrics come back as ``actor/rollout_corr/*`` (verl prefixes the actor's
metrics with ``actor/``), averaged over micro-batches like the other actor metrics. Rollout IS
weights of the trainer are not used by this loss (verl ignores them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rldiag.engine.policy_loss.base import (
    POLICY,
    POLICY_LOSSES,
    PolicyLossInput,
    PolicyLossOutput,
    dual_clip_c,
)
from rldiag.engine.policy_loss.clip import ppo_clip
from rldiag.engine.policy_loss.pg import reinforce
from rldiag.engine.rollout_correction import CorrectionConfig, correct
from rldiag.registry import Registry

PREFIX = f"{POLICY}.rollout_correction"

#: fn(inp, rollout_log_prob, mask after rejection, IS weights or None) -> output
BypassFn = Callable[[PolicyLossInput, torch.Tensor, torch.Tensor, "torch.Tensor | None"], PolicyLossOutput]
BYPASS_LOSS_TYPES: Registry[BypassFn] = Registry("bypass_mode loss_type")
BYPASS_LOSS_TYPES.register("ppo_clip", source="verl core_algos.compute_policy_loss_bypass_mode (loss_type=ppo_clip)")(
    lambda inp, rollout, mask, weights: ppo_clip(inp, rollout, mask, None)
)
BYPASS_LOSS_TYPES.register("reinforce", source="verl core_algos.compute_policy_loss_bypass_mode (loss_type=reinforce)")(reinforce)


def bypass_config(settings) -> tuple[BypassFn, CorrectionConfig]:
    """The loss-type function and the correction block of ``loss_mode=bypass_mode``."""
    return BYPASS_LOSS_TYPES.get(settings[f"{PREFIX}.loss_type"]), CorrectionConfig.from_settings(settings, PREFIX)


def check_bypass(settings) -> None:
    """The loss type and correction block must resolve; the PPO-clip loss type asserts the dual
    clip's ``clip_ratio_c`` above 1, as ``vanilla`` does."""
    bypass_config(settings)
    if settings[f"{PREFIX}.loss_type"] == "ppo_clip":
        dual_clip_c(settings)


@POLICY_LOSSES.register("bypass_mode", check=check_bypass,
                        source="verl core_algos.compute_policy_loss_bypass_mode, rollout_corr_helper")
def bypass_mode(inp: PolicyLossInput) -> PolicyLossOutput:
    """Rollout correction of the current policy against ``old_log_prob`` (= pi_rollout), then
    the ``loss_type`` loss on the surviving tokens."""
    loss_fn, cfg = bypass_config(inp.settings)
    seg, n = inp.norm.seg_ids, inp.norm.n_seg
    rollout = inp.old_log_prob
    res = correct(inp.log_prob, rollout, inp.mask, cfg, inp.rows, seg, n)
    out = loss_fn(inp, rollout, res.mask, res.weights)
    out.metrics.update({f"actor/{k}": v for k, v in res.metrics.items()})
    for message, bad in res.failed.items():
        out.failed[f"loss_mode=bypass_mode: {message}"] = bad
    return out
