"""Which trainer field becomes which batch column.

verl's names at the point where a step's batch is complete (after ``compute_advantage``) are
the keys; the batch column (``rldiag/io/schema.py``, docs/run-directory.md) is the value. For each column the first
name present in the batch wins.
"""

from __future__ import annotations

#: list<float> columns, ``(rows, response_width)`` tensors in the trainer.
TOKEN_SOURCES: dict[str, tuple[str, ...]] = {
    "token_level_scores": ("token_level_scores", "rm_scores"),
    "old_log_probs": ("old_log_probs", "old_log_prob"),
    "log_probs": ("log_probs",),
    "ref_log_prob": ("ref_log_prob", "ref_log_probs"),
    "rollout_log_probs": ("rollout_log_probs",),
    "values": ("values",),
    "vpreds": ("vpreds",),
    "entropy": ("entropy", "entropys"),
    "token_level_rewards": ("token_level_rewards",),
    "advantages": ("advantages",),
    "returns": ("returns",),
}

#: list<int8> 0/1 columns.
MASK_SOURCES: dict[str, tuple[str, ...]] = {
    "response_mask": ("response_mask",),
    "loss_mask": ("loss_mask",),
}

#: per-row scalar columns -> (names, kind). ``kind`` is ``float``, ``int`` or ``string``.
ROW_SOURCES: dict[str, tuple[tuple[str, ...], str]] = {
    "uid": (("uid",), "string"),
    "score": (("score",), "float"),
    "reward_baselines": (("reward_baselines",), "float"),
    "prompt_length": (("prompt_length",), "int"),
    "traj_uid": (("traj_uid", "trajectory_uids"), "string"),
    "step_index": (("step_index", "step_indices"), "int"),
    "session_id": (("session_id",), "string"),
    "output_index": (("output_index",), "int"),
    "batch_position": (("batch_position",), "int"),
}

#: per-row weight versions -> verl's names: the number of updates the generating weights had seen
#: (verl's agent loop puts them in the DataProto's non-tensor batch, V1 in each row's TransferQueue
#: tags). verl leaves ``None`` where the rollout server reported no version; a step with such a row
#: gets no column (``rldiag.capture.unpad``), never a column with gaps.
VERSION_SOURCES: dict[str, tuple[str, ...]] = {
    "policy_version": ("max_global_steps",),
    "policy_version_min": ("min_global_steps",),
}

#: Keys that locate tokens rather than hold a column: the response token ids (their width is
#: the response width), the prompt token ids (verl left-pads them; their width is the prompt part
#: of the attention mask) and the attention mask (prompt part + response part).
RESPONSES_KEY = "responses"
PROMPTS_KEY = "prompts"
ATTENTION_KEY = "attention_mask"

#: Every trainer name consumed by one of the mappings above.
KNOWN_NAMES = frozenset(
    [n for names in TOKEN_SOURCES.values() for n in names]
    + [n for names in MASK_SOURCES.values() for n in names]
    + [n for names, _ in ROW_SOURCES.values() for n in names]
    + [n for names in VERSION_SOURCES.values() for n in names]
)
