"""Advantage estimators, keyed by verl's ``algorithm.adv_estimator`` strings.

Every estimator has one signature: ``fn(inp: AdvInput) -> (advantages, returns)``, both flat
``(tokens,)`` in the batch's packed layout (``inp.rows``). ``inp.mask`` is the post-correction
``response_mask``; ``inp.rewards`` the token-level rewards after optional KL shaping (rewards at
rejected tokens are not zeroed, as in verl). Group statistics are segment reductions over
``batch.group_ids`` and whitening over ``batch.step_ids``, so packed steps never mix. Where verl
raises on an input the step is flagged in ``inp.errors`` and the other steps go on.

The package: :mod:`.base` (the input, the registry, shared helpers), :mod:`.outcome` (the
GRPO family, GDPO, RLOO, OPO, GPG), :mod:`.returns` (GAE, REINFORCE++, ReMax), :mod:`.otb` (the
optimal-token-baseline pair) and :mod:`.agentic` (multi-step trajectory variants). Importing the
package registers them all.
Registration metadata: :class:`EstimatorMeta` (the columns an estimator needs and reads, its
rule on its settings, its source).
"""

from __future__ import annotations

from rldiag.engine.advantage import agentic, otb, outcome, returns  # noqa: F401  (registration)
from rldiag.engine.advantage.base import (
    ESTIMATORS,
    GPG_F_NORM,
    GRPO_EPS,
    AdvFn,
    AdvInput,
    EstimatorMeta,
    estimate,
    gae_scan,
)
from rldiag.engine.advantage.outcome import GDPO_KEYS, GDPO_WEIGHTS, gdpo_components

__all__ = [
    "ESTIMATORS", "GDPO_KEYS", "GDPO_WEIGHTS", "GPG_F_NORM", "GRPO_EPS", "AdvFn", "AdvInput", "EstimatorMeta",
    "estimate", "gae_scan", "gdpo_components",
]
