"""The batch schema (docs/run-directory.md, "One batch file"): the columns rldiag understands and
their types. What each estimator, policy loss, stage or metric family needs from it is the column
planner's (:mod:`rldiag.engine.requirements`)."""

from __future__ import annotations

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
#: list<string> columns, the text of each token for display (the engine never reads them):
#: ``response_tokens`` has one string per response token (the row's length, like every list
#: column above); ``prompt_tokens`` one per prompt token, any length.
RESPONSE_TEXT_COLUMN = "response_tokens"
PROMPT_TEXT_COLUMN = "prompt_tokens"
TEXT_LIST_COLUMNS = (RESPONSE_TEXT_COLUMN, PROMPT_TEXT_COLUMN)
#: per-row string columns a reward function reads (verl's reward manager's inputs; the engine
#: never reads them): the data source, the ground truth and ``extra_info`` as JSON text, and the
#: response and prompt decoded as verl's reward manager decodes them (valid ids,
#: ``skip_special_tokens=True``). ``rldiag rescore`` passes them to a reward function.
REWARD_INPUT_COLUMNS = ("data_source", "ground_truth", "extra_info", "response_text", "prompt_text")
#: int8 per row: 1 where ``ground_truth`` or ``extra_info`` could not be encoded as JSON and holds
#: the value's ``repr`` instead (a rescore reports such a row rather than pass it the text)
REWARD_INPUT_REPR_COLUMN = "reward_inputs_repr"
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
    # the weights that generated the row: how many updates they had seen (verl's max_global_steps,
    # an on-policy row of step s has s - 1; its lag is step - 1 - policy_version) and, for a row
    # generated across a weight update (partial rollout), the first weights' (min_global_steps)
    "policy_version": "int",
    "policy_version_min": "int",
}


def id_type_problem(t: pa.DataType) -> str | None:
    """Why a column of type ``t`` cannot hold ids (``uid``, ``traj_uid``, ``session_id``); None
    when it can: text or integers, dictionary-encoded too, never a list or a struct."""
    v = t.value_type if pa.types.is_dictionary(t) else t
    view = getattr(pa.types, "is_string_view", lambda _t: False)
    if pa.types.is_string(v) or pa.types.is_large_string(v) or view(v) or pa.types.is_integer(v):
        return None
    return f"expected string or integer ids, found type {t}"

