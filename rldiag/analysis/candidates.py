"""Candidate settings for ``rldiag verify``: when a field does not match the log, which single
setting change would have made it match?

The list is small and depends on which fields mismatch: an advantage mismatch tries the other
estimators, ``norm_adv_by_std_in_grpo`` and gamma/lam; a loss mismatch tries the aggregation
modes; a clip-fraction mismatch the clip ratios and verl's micro-batch averaging (when the
settings ``rldiag.micro_batch_size`` / ``rldiag.dp_size`` exist); a reward mismatch the KL-in-
reward settings; any mismatch the other verl releases (``rldiag.verl_version``). Each candidate
is one override on top of the run's settings; keys that the settings do not define (an
emulation not available) are skipped.
"""

from __future__ import annotations

from typing import Any

from rldiag.config.settings import DEFAULTS, Settings
from rldiag.config.verl_versions import RELEASES, version_of
from rldiag.engine.advantage import ESTIMATORS
from rldiag.engine.aggregation import AGG_MODES
from rldiag.engine.microbatch import resolve_auto
from rldiag.io.schema import estimator_need

#: Distinct KL estimators (one name per formula).
KL_FORMS = ("kl", "abs", "mse", "low_var_kl")
GAMMAS = (1.0, 0.99, 0.995, 0.95)
LAMS = (1.0, 0.95, 0.99, 0.9)
CLIP_RATIOS = (0.2, 0.1, 0.28, 0.3)
CLIP_HIGHS = (0.28,)
CLIP_CS = (3.0, 10.0)
KL_COEFS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1)
CLIPRANGE_VALUES = (0.5, 0.2, 1.0)
MICRO_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DP_SIZES = (2, 4, 8, 16)
#: Estimators whose recursion reads gamma (and lam for gae).
GAMMA_ESTIMATORS = ("gae", "reinforce_plus_plus")

_ADV_PREFIXES = ("advantages", "returns", "critic/advantages/", "critic/returns/", "critic/vf_explained_var",
                 "actor/pg_loss", "actor/pg_clipfrac", "critic/vf_loss", "critic/vf_clipfrac")
_REWARD_PREFIXES = ("token_level_rewards", "critic/rewards/", "actor/reward_kl_penalty")
_AGG_FIELDS = ("actor/pg_loss", "actor/entropy_loss", "actor/kl_loss")
_CLIP_FIELDS = ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/pg_loss")
_MICRO_FIELDS = ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/pg_loss",
                 "actor/entropy_loss", "actor/kl_loss", "critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean")
_VALUE_FIELDS = ("critic/vf_loss", "critic/vf_clipfrac")


def _hits(fields: set[str], prefixes: tuple[str, ...]) -> bool:
    return any(f == p or f.startswith(p) for f in fields for p in prefixes)


def candidate_overrides(settings: Settings, fields: set[str], columns: set[str], rows: int) -> list[dict[str, Any]]:
    """Single-setting overrides worth trying for the mismatching ``fields``, most plausible first.

    ``columns`` are the batch file's columns (an estimator whose inputs are missing is not
    tried); ``rows`` the step's row count (micro-batch sizes that split it).
    """
    out: list[dict[str, Any]] = []

    def add(key: str, value: Any) -> None:
        if key not in DEFAULTS or settings.get(key) == value:
            return
        cand = {key: value}
        if cand not in out:
            out.append(cand)

    # the other verl releases first: what differs between them is listed in one table
    # (rldiag/config/verl_versions.py) and a run recorded under the wrong version moves many fields
    if fields:
        current = version_of(settings)
        for release in RELEASES:
            if release != current:
                add("rldiag.verl_version", release)
    est = settings.estimator
    if _hits(fields, _ADV_PREFIXES + _REWARD_PREFIXES):
        add("algorithm.norm_adv_by_std_in_grpo", not settings["algorithm.norm_adv_by_std_in_grpo"])
        for name in ESTIMATORS.names():
            if name != est and not estimator_need(name).missing(columns):
                add("algorithm.adv_estimator", name)
        if est in GAMMA_ESTIMATORS:
            for g in GAMMAS:
                add("algorithm.gamma", g)
        if est == "gae":
            for lam in LAMS:
                add("algorithm.lam", lam)
        if {"old_log_probs", "ref_log_prob"} <= columns:
            add("algorithm.use_kl_in_reward", not settings["algorithm.use_kl_in_reward"])
    if _hits(fields, _REWARD_PREFIXES) and settings["algorithm.use_kl_in_reward"]:
        for kl in KL_FORMS:
            add("algorithm.kl_penalty", kl)
        for c in KL_COEFS:
            add("algorithm.kl_ctrl.kl_coef", c)
        add("algorithm.kl_ctrl.type", "adaptive" if settings["algorithm.kl_ctrl.type"] == "fixed" else "fixed")
    if _hits(fields, _AGG_FIELDS):
        for mode in AGG_MODES.names():
            add("actor_rollout_ref.actor.loss_agg_mode", mode)
    if _hits(fields, ("critic/vf_loss",)):
        for mode in AGG_MODES.names():
            if mode != settings.critic_agg_mode:
                add("critic.loss_agg_mode", mode)
    if _hits(fields, _CLIP_FIELDS):
        for c in CLIP_RATIOS:
            add("actor_rollout_ref.actor.clip_ratio", c)
        for c in CLIP_HIGHS:
            add("actor_rollout_ref.actor.clip_ratio_high", c)
        for c in CLIP_CS:
            add("actor_rollout_ref.actor.clip_ratio_c", c)
    if _hits(fields, ("actor/kl_loss",)):
        for kl in KL_FORMS:
            add("actor_rollout_ref.actor.kl_loss_type", kl)
    if _hits(fields, _VALUE_FIELDS):
        for c in CLIPRANGE_VALUES:
            add("critic.cliprange_value", c)
    if _hits(fields, _MICRO_FIELDS):
        # first the batching the run's own config describes (verl's ppo_mini_batch_size x
        # rollout.n and ppo_micro_batch_size_per_gpu), as one candidate
        actor = "actor_rollout_ref.actor."
        keys = ("rldiag.mini_batch_size", "rldiag.micro_batch_size")
        configured = (settings.get(actor + "ppo_mini_batch_size"), settings.get(actor + "ppo_micro_batch_size_per_gpu"))
        if None not in configured:
            cand = dict.fromkeys(keys, "auto")
            if cand not in out and any(settings.get(k) not in ("run", "auto") for k in keys):
                out.insert(0, cand)
        # the whole step as one batch, when the settings batch it otherwise
        if any(resolve_auto(settings, k) is not None for k in keys):
            out.append(dict.fromkeys(keys))
        if int(settings.get("rldiag.dp_size", 1)) > 1:
            add("trainer.balance_batch", not settings.get("trainer.balance_batch", True))
        # verl averages these over micro-batches (and DP ranks) with equal weights (verl.utils.metric, AggregationType.MEAN)
        for size in MICRO_SIZES:
            if size < rows and rows % size == 0:
                add("rldiag.micro_batch_size", size)
        for dp in DP_SIZES:
            if dp < rows and rows % dp == 0:
                add("rldiag.dp_size", dp)
        # verl also averages the logged losses over mini-batches, each normalised by its own
        # token count; tried when the engine emulates it (a no-op key is skipped by add)
        for size in MICRO_SIZES:
            if size < rows and rows % size == 0:
                add("rldiag.mini_batch_size", size)
    return out


def describe(overrides: dict[str, Any]) -> str:
    """``norm_adv_by_std_in_grpo=false`` style text of an override set."""
    parts = []
    for key, value in overrides.items():
        text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        short = key if key.startswith("rldiag.") else key.split(".")[-1]
        parts.append(f"{short}={text}")
    return ", ".join(parts)
