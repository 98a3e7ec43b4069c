"""The batch schema (docs/run-directory.md, "One batch file") and what each algorithm needs from it."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

#: list<float> columns, one value per token of the row.
FLOAT_LIST_COLUMNS = (
    "token_level_scores",
    "old_log_probs",
    "log_probs",
    "ref_log_prob",
    "rollout_log_probs",
    "values",
    "vpreds",
    "entropy",
    "token_level_rewards",
    "advantages",
    "returns",
    "sum_pi_squared",
)
#: list<int8|bool> columns holding 0/1 per token.
MASK_LIST_COLUMNS = ("response_mask", "loss_mask")
LIST_COLUMNS = MASK_LIST_COLUMNS + FLOAT_LIST_COLUMNS
#: scalar columns rldiag understands.
SCALAR_COLUMNS = {
    "uid": "string",
    "score": "float",
    "reward_baselines": "float",
    "prompt_length": "int",
    "traj_uid": "string",
    "step_index": "int",
    "session_id": "string",
    "output_index": "int",
    "step": "int",
    # the agent loop's per-row counts (verl's __num_turns__ and tool_call_counts): num_turns/*, tool_call_counts/*
    "num_turns": "int",
    "tool_call_counts": "int",
    # the row's place in the trainer's padded, balanced batch (rldiag's V1 capture writes it)
    "batch_position": "int",
}
#: scalar columns read when present, for metrics only (they land in ``Batch.extra``)
METRIC_ROW_COLUMNS = ("num_turns", "tool_call_counts")
#: scalar columns read when present for the batch layout (``Batch.extra``)
LAYOUT_ROW_COLUMNS = ("batch_position",)


def id_type_problem(t: pa.DataType) -> str | None:
    """Why a column of type ``t`` cannot hold ids (``uid``, ``traj_uid``, ``session_id``); None
    when it can: text or integers, dictionary-encoded too, never a list or a struct."""
    v = t.value_type if pa.types.is_dictionary(t) else t
    view = getattr(pa.types, "is_string_view", lambda _t: False)
    if pa.types.is_string(v) or pa.types.is_large_string(v) or view(v) or pa.types.is_integer(v):
        return None
    return f"expected string or integer ids, found type {t}"


#: columns the engine may read (the logged token_level_rewards/advantages/returns are only for
#: verification and are not loaded by a recompute).
ENGINE_TOKEN_COLUMNS = (
    "old_log_probs",
    "log_probs",
    "ref_log_prob",
    "rollout_log_probs",
    "values",
    "vpreds",
    "entropy",
    "loss_mask",
)
ENGINE_ROW_COLUMNS = ("prompt_length", "reward_baselines")
#: columns with a dedicated place in the engine Batch; any other column an estimator reads lands
#: in ``Batch.extra`` (string ids as int64 codes, other scalars as numbers, lists padded).
BATCH_COLUMNS = frozenset(
    ("uid", "response_mask", "token_level_scores", "score", "step") + ENGINE_TOKEN_COLUMNS + ENGINE_ROW_COLUMNS
)


@dataclass(frozen=True)
class Need:
    """What a setting needs: all of ``all_of`` and at least one of each group in ``any_of``."""

    all_of: tuple[str, ...] = ()
    any_of: tuple[tuple[str, ...], ...] = ()

    def missing(self, present: set[str]) -> list[str]:
        out = [c for c in self.all_of if c not in present]
        for group in self.any_of:
            if not any(c in present for c in group):
                out.append(" or ".join(group))
        return out


BASE_NEED = Need(all_of=("uid", "response_mask"), any_of=(("token_level_scores", "score"),))


def estimator_need(name: str, settings=None) -> Need:
    """Columns an advantage estimator needs beyond the base ones (with ``settings``, also those
    its settings name, e.g. gdpo's reward-component columns)."""
    from rldiag.engine.advantage import ESTIMATORS

    meta = ESTIMATORS.meta(name)
    cols = tuple(meta.needs)
    needs_fn = meta.needs_fn
    if needs_fn is not None and settings is not None:
        cols += tuple(c for c in needs_fn(settings) if c not in cols)
    return Need(all_of=cols)


def estimator_optional(name: str) -> tuple[str, ...]:
    """Columns an advantage estimator reads when the batch has them (e.g. grpo's session folding)."""
    from rldiag.engine.advantage import ESTIMATORS

    return tuple(ESTIMATORS.meta(name).optional)


#: What each optional metric family needs (docs/run-directory.md, "Metric names").
METRIC_NEEDS = {
    "actor/* (pg_loss, pg_clipfrac, ppo_kl)": Need(all_of=("old_log_probs", "log_probs")),
    "actor/entropy_loss": Need(all_of=("entropy",)),
    "actor/kl_loss (use_kl_loss)": Need(all_of=("log_probs", "ref_log_prob")),
    "KL in reward (use_kl_in_reward)": Need(all_of=("old_log_probs", "ref_log_prob")),
    "critic/values/*, vf_explained_var": Need(all_of=("values",)),
    "critic/vf_loss (vpreds)": Need(all_of=("vpreds", "values")),
    "rollout_corr/*": Need(all_of=("rollout_log_probs", "old_log_probs")),
    "algorithm.rollout_correction rollout_is / rollout_rs (IS weights, rejection)": Need(
        all_of=("rollout_log_probs", "old_log_probs")
    ),
    "algorithm.rollout_correction.bypass_mode (old_log_probs := rollout_log_probs)": Need(
        all_of=("rollout_log_probs", "log_probs")
    ),
    "prompt_length/*": Need(all_of=("prompt_length",)),
    "num_turns/*": Need(all_of=("num_turns",)),
    "tool_call_counts/*": Need(all_of=("tool_call_counts",)),
}


def policy_loss_needs() -> dict[str, Need]:
    """``loss_mode=<key>`` -> the columns its ``actor/*`` metrics need, for every registered policy
    loss (the registry's ``needs`` metadata; by default the old and current log-probs)."""
    from rldiag.engine.policy_loss import POLICY_LOSSES

    return {
        f"loss_mode={name} (actor/*)": Need(all_of=tuple(POLICY_LOSSES.meta(name).needs))
        for name in POLICY_LOSSES.names()
    }
