"""The packed token batch the engine works on.

One :class:`Batch` holds the rows of one or more steps in the packed token layout
(:mod:`rldiag.engine.layout`): every token tensor is flat ``(tokens,)``, the rows one after the
other, and ``rows`` (from ``lengths``, each row's length ``T_i``, tool-observation tokens
included) says where each row starts. Nothing is padded: memory is in proportion to the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from rldiag.engine.layout import Rows

TOKEN_FIELDS = (
    "response_mask",
    "token_level_scores",
    "old_log_probs",
    "log_probs",
    "ref_log_prob",
    "rollout_log_probs",
    "values",
    "vpreds",
    "entropy",
    "loss_mask",
)
ROW_FIELDS = ("lengths", "step_ids", "group_ids", "prompt_length", "reward_baselines")
#: ``extra`` entries holding int64 id codes (factorised strings); :func:`pack` offsets them so
#: that ids of different packed batches never collide, as it does for ``group_ids``.
ID_EXTRA_KEYS = ("traj_uid", "session_id")


@dataclass
class Batch:
    """Flat ``(tokens,)`` token tensors of one or more packed steps.

    Attributes:
        response_mask: ``(tokens,)`` float32, 1 = token sampled by the actor.
        token_level_scores: ``(tokens,)`` float32 reward-manager scores.
        lengths: ``(rows,)`` int64, each row's length ``T_i``.
        step_ids: ``(rows,)`` int64 in ``[0, n_steps)``: the packed step of each row.
        group_ids: ``(rows,)`` int64 in ``[0, n_groups)``: the (step, uid) group of each row.
        steps: the run's step number of each packed step, ``len == n_steps``.
        max_response_length: ``(n_steps,)`` the response horizon of each step (the setting or
            the step's longest row).
        optional tensors: ``None`` when the batch does not carry them.
        extra: estimator-specific columns by name, ``(rows,)`` (ids as int64 codes, numbers) or
            ``(tokens,)`` (list columns such as ``sum_pi_squared``, named in ``token_extra``).
        token_extra: the names of the ``extra`` entries that are token columns.
        rows: the row layout (built from ``lengths`` when not given).
    """

    response_mask: torch.Tensor
    token_level_scores: torch.Tensor
    lengths: torch.Tensor
    step_ids: torch.Tensor
    group_ids: torch.Tensor
    steps: list[int]
    n_groups: int
    max_response_length: torch.Tensor
    old_log_probs: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    ref_log_prob: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    vpreds: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    prompt_length: torch.Tensor | None = None
    max_prompt_length: torch.Tensor | None = None
    reward_baselines: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    token_extra: tuple[str, ...] = ()
    rows: Rows = None  # type: ignore[assignment]  # built from lengths in __post_init__ when not given

    def __post_init__(self) -> None:
        if self.rows is None:
            self.rows = Rows.from_lengths(self.lengths)
        if self.response_mask.dim() != 1 or self.response_mask.numel() != self.rows.n_tokens:
            raise ValueError(
                f"token tensors are flat (tokens,): response_mask has shape {tuple(self.response_mask.shape)}, "
                f"the rows hold {self.rows.n_tokens} tokens"
            )

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    @property
    def n_rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(self.response_mask.shape[0])

    @property
    def device(self) -> torch.device:
        return self.response_mask.device

    def has(self, name: str) -> bool:
        return getattr(self, name, None) is not None

    def _map(self, fn) -> Batch:
        changes = {f.name: fn(getattr(self, f.name)) for f in fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        changes["extra"] = {k: fn(v) for k, v in self.extra.items()}
        changes["rows"] = Rows(fn(self.rows.offsets), fn(self.rows.row_ids))
        return replace(self, **changes)

    def to(self, device: torch.device | str) -> Batch:
        return self._map(lambda v: v.to(device, non_blocking=True))

    def pin_memory(self) -> Batch:
        """Page-locked copies of the tensors, so a later ``to(cuda, non_blocking=True)`` overlaps."""
        return self._map(lambda v: v.pin_memory())

    def select_rows(self, index: torch.Tensor) -> Batch:
        """A batch of the given rows (same steps; group ids kept)."""
        sub, tok = self.rows.take(index)
        changes: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, torch.Tensor) or f.name in ("max_response_length", "max_prompt_length"):
                continue
            changes[f.name] = v[tok] if f.name in TOKEN_FIELDS else v[index]
        changes["extra"] = {k: v[tok] if k in self.token_extra else v[index] for k, v in self.extra.items()}
        changes["rows"] = sub
        return replace(self, **changes)


#: neutral fillers ``(rows, device) -> (rows,)`` for optional extra columns a packed batch lacks:
#: grpo's session folding with every row its own session is plain grpo.
_NEUTRAL_EXTRA = {
    "session_id": lambda rows, dev: torch.arange(rows, dtype=torch.long, device=dev),
    "output_index": lambda rows, dev: torch.zeros(rows, dtype=torch.long, device=dev),
}


def pack(batches: list[Batch]) -> Batch:
    """Concatenate several batches (each of one or more steps) into one, their tokens one after
    the other (nothing re-padded), renumbering steps and groups so that they stay distinct."""
    if len(batches) == 1:
        return batches[0]
    step_off, group_off = 0, 0
    cols: dict[str, list[torch.Tensor]] = {}
    steps: list[int] = []
    for b in batches:
        for name in TOKEN_FIELDS:
            t = getattr(b, name)
            cols.setdefault(name, []).append(t)
        for name in ("lengths", "prompt_length", "reward_baselines", "max_response_length", "max_prompt_length"):
            cols.setdefault(name, []).append(getattr(b, name))
        cols.setdefault("step_ids", []).append(b.step_ids + step_off)
        cols.setdefault("group_ids", []).append(b.group_ids + group_off)
        step_off += b.n_steps
        group_off += b.n_groups
        steps.extend(b.steps)
    out: dict[str, torch.Tensor | None] = {}
    for name, parts in cols.items():
        if any(p is None for p in parts):
            out[name] = None
        else:
            out[name] = torch.cat(parts)
    extra_keys = set.intersection(*(set(b.extra) for b in batches)) if batches else set()
    # optional columns some batches lack: filled where a neutral value exists (each row its own
    # session is no folding), else dropped for the whole pack
    union = set.union(*(set(b.extra) for b in batches)) if batches else set()
    extra_keys |= {k for k in union - extra_keys if k in _NEUTRAL_EXTRA}
    token_extra = tuple(k for k in sorted(extra_keys) if any(k in b.token_extra for b in batches))
    extra = {}
    for k in extra_keys:
        parts, off = [], 0
        for b in batches:
            if k in _NEUTRAL_EXTRA and not all(x in b.extra for x in _NEUTRAL_EXTRA):
                codes = _NEUTRAL_EXTRA[k](b.n_rows, b.device)  # the pair is filled together
            else:
                codes = b.extra[k]
            if k in ID_EXTRA_KEYS and codes.numel():
                parts.append(codes + off)
                off += int(codes.max()) + 1
            else:
                parts.append(codes)
        extra[k] = torch.cat(parts)
    rows = Rows.cat([b.rows for b in batches])
    return Batch(steps=steps, n_groups=group_off, extra=extra, token_extra=token_extra, rows=rows,
                 **out)  # type: ignore[arg-type]  # the required columns are in every batch, so never None
