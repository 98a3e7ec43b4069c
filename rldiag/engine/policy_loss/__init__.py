"""Policy losses, keyed by verl's ``actor_rollout_ref.actor.policy_loss.loss_mode`` strings.

One signature: ``fn(inp: PolicyLossInput) -> PolicyLossOutput`` (see :mod:`.base`). The modules
register their entries on import:

- :mod:`.clip`: ``vanilla``, ``up``, ``gspo``, ``sapo``, ``cispo``, ``dppo_tv``, ``dppo_kl``, ``geo_mean``
- :mod:`.pg`: ``gpg``, ``dro`` (and the REINFORCE form of ``bypass_mode``)
- :mod:`.cov`: ``clip_cov``, ``kl_cov``
- :mod:`.bypass`: ``bypass_mode``
"""

from __future__ import annotations

from rldiag.engine.policy_loss import bypass, clip, cov, pg  # noqa: F401  (registration)
from rldiag.engine.policy_loss.base import (
    LOG_RATIO_CLAMP,
    POLICY_LOSSES,
    PolicyLossFn,
    PolicyLossInput,
    PolicyLossOutput,
    clamped_log_ratio,
)
from rldiag.engine.policy_loss.bypass import BYPASS_LOSS_TYPES, bypass_config

__all__ = [
    "BYPASS_LOSS_TYPES",
    "LOG_RATIO_CLAMP",
    "POLICY_LOSSES",
    "PolicyLossFn",
    "PolicyLossInput",
    "PolicyLossOutput",
    "bypass_config",
    "clamped_log_ratio",
    "policy_loss",
]


def policy_loss(name: str, inp: PolicyLossInput) -> PolicyLossOutput:
    return POLICY_LOSSES.get(name)(inp)
