"""The what-if page's settings: the overrides a choice of widget values amounts to (only keys that
differ from the run's own settings), and what a choice means for the run.

The keys the page edits, the run's own value of each and their choices come from the API
(:func:`rldiag.api.whatif_options`: the settings schema's rows marked ``whatif``, the engine's
registries and their metadata); the names below are where the page places each key, and a test
keeps them equal to the schema's rows.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

from rldiag.config.settings import scenario_slug

#: the settings the page places, by where they go (verl's keys; the schema's rows marked ``whatif``)
ESTIMATOR = "algorithm.adv_estimator"
NORM_STD = "algorithm.norm_adv_by_std_in_grpo"
AGG = "actor_rollout_ref.actor.loss_agg_mode"
LOSS = "actor_rollout_ref.actor.policy_loss.loss_mode"
CLIP_LOW = "actor_rollout_ref.actor.clip_ratio_low"
CLIP_HIGH = "actor_rollout_ref.actor.clip_ratio_high"
CLIP_C = "actor_rollout_ref.actor.clip_ratio_c"
KL_IN_REWARD = "algorithm.use_kl_in_reward"
KL_PENALTY = "algorithm.kl_penalty"
KL_COEF = "algorithm.kl_ctrl.kl_coef"
KL_CTRL = "algorithm.kl_ctrl.type"
KL_LOSS = "actor_rollout_ref.actor.use_kl_loss"
KL_LOSS_TYPE = "actor_rollout_ref.actor.kl_loss_type"
KL_LOSS_COEF = "actor_rollout_ref.actor.kl_loss_coef"
RC = "algorithm.rollout_correction"
IS_LEVEL = f"{RC}.rollout_is"
IS_THRESHOLD = f"{RC}.rollout_is_threshold"
IS_NORMALIZE = f"{RC}.rollout_is_batch_normalize"
RS = f"{RC}.rollout_rs"
RS_THRESHOLD = f"{RC}.rollout_rs_threshold"
BYPASS = f"{RC}.bypass_mode"

PLACED = (ESTIMATOR, NORM_STD, AGG, LOSS, CLIP_LOW, CLIP_HIGH, CLIP_C, KL_IN_REWARD, KL_PENALTY, KL_CTRL, KL_COEF,
          KL_LOSS, KL_LOSS_TYPE, KL_LOSS_COEF, IS_LEVEL, IS_THRESHOLD, IS_NORMALIZE, RS, RS_THRESHOLD, BYPASS)


def rs_value(options: list[str]) -> str | None:
    """The multiselect of rejection options as verl's comma list (None: no rejection)."""
    return ",".join(options) if options else None


def rs_options(value: Any) -> list[str]:
    return [o.strip() for o in str(value).split(",") if o.strip()] if value else []


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
        except (TypeError, ValueError):
            return False
    return a == b


def overrides(base: Mapping[str, Any], chosen: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of ``chosen`` whose value differs from ``base`` (the run's own settings)."""
    return {k: v for k, v in chosen.items() if not _same(v, base.get(k))}


def scenario_name(ovr: Mapping[str, Any]) -> str:
    """The scenario a set of overrides is saved under (``baseline`` for none)."""
    return scenario_slug(dict(ovr))


def rescore_name(reward: str, settings_name: str | None = None) -> str:
    """The scenario a reward what-if is saved under: ``reward=<NAME>`` as ``rldiag rescore`` names
    it (``NAME`` the function's), then ``__`` and the settings' scenario name when they differ."""
    fn = reward.rpartition(":")[2] or reward
    return f"reward={fn}" + (f"__{settings_name}" if settings_name else "")


#: metrics the page opens with
WHATIF_METRICS = ("critic/advantages/mean", "actor/pg_loss", "actor/pg_clipfrac", "rldiag/advantages/positive_fraction")


def parse_value(text: str) -> Any:
    """A widget's text read as the command line reads ``--set KEY=VALUE`` (YAML scalar:
    ``2.0`` a number, ``0.5_2.0`` a string, empty or ``null`` None)."""
    from rldiag.config.settings import parse_override

    return parse_override(f"value={text.strip()}")[1]


def estimator_fit(estimator: str, group_sizes: list[int], step: int, grouped: Collection[str]) -> str | None:
    """A warning when ``estimator`` does not fit the run's groups (None: it fits).

    ``group_sizes``: rows per uid group at ``step``; ``grouped``: the estimators that compare a
    response with the others of its prompt (:attr:`rldiag.api.WhatifOptions.grouped`). A group
    estimator on groups of one response has no other response to compare with: its advantages
    are zero, or the raw score."""
    if estimator not in grouped or not group_sizes:
        return None
    singles = sum(1 for n in group_sizes if n == 1)
    if singles == len(group_sizes):
        return (f"`{estimator}` compares each response with the other responses to its prompt (same `uid`), but at "
                f"step {step} every prompt has a single response ({len(group_sizes)} groups of 1): there is "
                f"nothing to compare with, so its advantages are zero or the raw score. It needs "
                f"`actor_rollout_ref.rollout.n` > 1; an estimator without groups (gae, reinforce_plus_plus, remax) "
                f"fits this run.")
    if singles:
        return (f"`{estimator}` compares responses within a prompt's group; at step {step}, {singles} of "
                f"{len(group_sizes)} groups have a single response and get no relative signal.")
    return None
