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
    "check_policy_loss_settings",
    "clamped_log_ratio",
    "policy_loss",
]


def policy_loss(name: str, inp: PolicyLossInput) -> PolicyLossOutput:
    return POLICY_LOSSES.get(name)(inp)


def check_policy_loss_settings(settings) -> None:
    """Fail before any work on a loss_mode whose configuration verl would reject."""
    from rldiag.errors import ConfigError

    name = settings["actor_rollout_ref.actor.policy_loss.loss_mode"]
    POLICY_LOSSES.get(name)
    if name in ("vanilla", "up") or (
        name == "bypass_mode" and settings["actor_rollout_ref.actor.policy_loss.rollout_correction.loss_type"] == "ppo_clip"
    ):
        c = float(settings["actor_rollout_ref.actor.clip_ratio_c"])
        if not c > 1.0:
            raise ConfigError(f"actor_rollout_ref.actor.clip_ratio_c must be > 1.0 for dual-clip PPO, got {c}")
    if name == "dro":
        beta = settings["actor_rollout_ref.actor.policy_loss.dro_beta"]
        if beta is None or not float(beta) > 0:
            raise ConfigError(f"loss_mode=dro needs actor_rollout_ref.actor.policy_loss.dro_beta > 0, got {beta!r}")
    for key in ("clip_cov_ratio", "kl_cov_ratio"):
        if name == key.split("_ratio")[0]:
            v = settings[f"actor_rollout_ref.actor.policy_loss.{key}"]
            if v is not None and not float(v) > 0:
                raise ConfigError(f"loss_mode={name} needs actor_rollout_ref.actor.policy_loss.{key} > 0, got {v!r}")
    if name == "bypass_mode":
        bypass_config(settings)
