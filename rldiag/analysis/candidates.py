"""Candidate settings for ``rldiag verify``: when a field does not match the log, which single
setting change would have made it match?

The list is small and depends on which fields mismatch: an advantage mismatch tries the other
estimators, ``norm_adv_by_std_in_grpo`` and gamma/lam; a loss mismatch tries the aggregation
modes; a clip-fraction mismatch the clip ratios and verl's batch layout (micro-, mini-batch and
DP sizes; and where the run's config does not say: balancing by rldiag or the rows as stored,
``use_dynamic_bsz`` with a few token budgets, shuffled ranks, mini- and micro-batch sizes
together); a reward mismatch the KL-in-reward settings; any mismatch the other verl releases
(``rldiag.verl_version``). Each candidate is one override (or one layout: a few keys together)
on top of the run's settings; keys that the settings do not define (an emulation not
available) are skipped. A candidate that changes the layout is reported with the whole layout
it makes (:func:`layout_text`).
"""

from __future__ import annotations

from typing import Any

from rldiag.config.settings import DEFAULTS, Settings
from rldiag.config.verl_versions import RELEASES, version_of
from rldiag.engine.advantage import ESTIMATORS
from rldiag.engine.aggregation import AGG_MODES
from rldiag.engine.batch_layout import batch_layout, describe_layout, is_v1, resolve_auto
from rldiag.engine.requirements import estimator_need
from rldiag.errors import RldiagError

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
#: token budgets per micro-batch tried with use_dynamic_bsz (ppo_max_token_len_per_gpu)
TOKEN_BUDGETS = (16384, 8192, 32768, 4096, 65536)
#: the keys that decide the batch layout (rldiag/engine/batch_layout.py): a candidate setting
#: one of them is reported with the whole layout it makes
LAYOUT_KEYS = frozenset({
    "rldiag.mini_batch_size", "rldiag.micro_batch_size", "rldiag.dp_size", "rldiag.rows_balanced",
    "trainer.balance_batch", "trainer.use_v1", "trainer.critic_warmup", "critic.enable",
    "actor_rollout_ref.actor.use_dynamic_bsz", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.actor.shuffle", "actor_rollout_ref.actor.data_loader_seed",
    "critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu", "critic.shuffle", "critic.data_loader_seed",
    "critic.ppo_mini_batch_size", "critic.ppo_micro_batch_size_per_gpu",
})
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
        _layout_candidates(settings, rows, out, add)
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


def _layout_candidates(settings: Settings, rows: int, out: list[dict[str, Any]], add) -> None:
    """The layouts worth trying where the run's config does not say (verl's keys absent from
    it): balancing by rldiag or the rows as stored, token-budget micro-batches, shuffled ranks;
    and, when it names no batch sizes, mini- and micro-batch sizes together."""
    actor = "actor_rollout_ref.actor."
    said = settings.configured
    try:
        layout = batch_layout(settings)
    except RldiagError:
        return
    if layout.dp > 1:
        # balanced by rldiag (rows in rollout order) or dealt as stored (the trainer's order)
        add("rldiag.rows_balanced", layout.balance)
        if not is_v1(settings):  # only the legacy trainer reads the flag
            add("trainer.balance_batch", not settings.get("trainer.balance_batch", True))
    if actor + "use_dynamic_bsz" not in said:
        dynamic = bool(settings.get(actor + "use_dynamic_bsz"))
        add(actor + "use_dynamic_bsz", not dynamic)
        if not dynamic and actor + "ppo_max_token_len_per_gpu" not in said:
            for budget in TOKEN_BUDGETS[1:]:
                cand = {actor + "use_dynamic_bsz": True, actor + "ppo_max_token_len_per_gpu": budget}
                if cand not in out:
                    out.append(cand)
    if actor + "shuffle" not in said:
        add(actor + "shuffle", not settings.get(actor + "shuffle"))
    if actor + "ppo_mini_batch_size" not in said and actor + "ppo_micro_batch_size_per_gpu" not in said:
        for mini in MICRO_SIZES:
            if mini >= rows or rows % mini or mini % layout.dp:
                continue
            for micro in MICRO_SIZES:
                if micro < mini // layout.dp and (mini // layout.dp) % micro == 0:
                    cand = {"rldiag.mini_batch_size": mini, "rldiag.micro_batch_size": micro}
                    if cand not in out:
                        out.append(cand)


def is_layout(overrides: dict[str, Any]) -> bool:
    """Whether a candidate changes the batch layout."""
    return any(k in LAYOUT_KEYS for k in overrides)


def layout_text(settings: Settings) -> str:
    """The layout the settings make, in words (``describe_layout``); empty when they make none."""
    try:
        return describe_layout(batch_layout(settings))
    except RldiagError:
        return ""


def describe(overrides: dict[str, Any]) -> str:
    """``norm_adv_by_std_in_grpo=false`` style text of an override set."""
    parts = []
    for key, value in overrides.items():
        text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        short = key if key.startswith("rldiag.") else key.split(".")[-1]
        parts.append(f"{short}={text}")
    return ", ".join(parts)
