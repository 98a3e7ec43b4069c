"""The packed tensor batch the engine works on.

One :class:`Batch` holds the rows of one or more steps, right-padded to a common width.
Padding positions carry 0 in every tensor and 0 in ``response_mask``; ``lengths`` gives each
row's real length ``T_i`` (tool-observation tokens included).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

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
    """Padded ``(rows, tokens)`` tensors of one or more packed steps.

    Attributes:
        response_mask: ``(rows, tokens)`` float32, 1 = token sampled by the actor.
        token_level_scores: ``(rows, tokens)`` float32 reward-manager scores.
        lengths: ``(rows,)`` int64, each row's length ``T_i``.
        step_ids: ``(rows,)`` int64 in ``[0, n_steps)``: the packed step of each row.
        group_ids: ``(rows,)`` int64 in ``[0, n_groups)``: the (step, uid) group of each row.
        steps: the run's step number of each packed step, ``len == n_steps``.
        max_response_length: ``(n_steps,)`` the response horizon of each step (the setting or
            the step's longest row).
        optional tensors: ``None`` when the batch does not carry them.
        extra: estimator-specific columns by name, ``(rows,)`` (ids as int64 codes, numbers) or
            ``(rows, tokens)`` (padded lists such as ``sum_pi_squared``).
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

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    @property
    def n_rows(self) -> int:
        return int(self.response_mask.shape[0])

    @property
    def width(self) -> int:
        return int(self.response_mask.shape[1])

    @property
    def device(self) -> torch.device:
        return self.response_mask.device

    def valid(self) -> torch.Tensor:
        """``(rows, tokens)`` bool: inside the row (not padding)."""
        pos = torch.arange(self.width, device=self.device)
        return pos.unsqueeze(0) < self.lengths.unsqueeze(1)

    def has(self, name: str) -> bool:
        return getattr(self, name, None) is not None

    def to(self, device: torch.device | str) -> Batch:
        changes = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                changes[f.name] = v.to(device, non_blocking=True)
        changes["extra"] = {k: v.to(device) for k, v in self.extra.items()}
        return replace(self, **changes)

    def pin_memory(self) -> Batch:
        """Page-locked copies of the tensors, so a later ``to(cuda, non_blocking=True)`` overlaps."""
        changes = {f.name: getattr(self, f.name).pin_memory() for f in fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        changes["extra"] = {k: v.pin_memory() for k, v in self.extra.items()}
        return replace(self, **changes)

    def select_rows(self, index: torch.Tensor) -> Batch:
        """A batch of the given rows (same steps; group ids kept)."""
        changes = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor) and f.name not in ("max_response_length", "max_prompt_length"):
                changes[f.name] = v[index]
        changes["extra"] = {k: v[index] for k, v in self.extra.items()}
        return replace(self, **changes)


#: neutral fillers ``(rows, device) -> (rows,)`` for optional extra columns a packed batch lacks:
#: grpo's session folding with every row its own session is plain grpo.
_NEUTRAL_EXTRA = {
    "session_id": lambda rows, dev: torch.arange(rows, dtype=torch.long, device=dev),
    "output_index": lambda rows, dev: torch.zeros(rows, dtype=torch.long, device=dev),
}


def pack(batches: list[Batch]) -> Batch:
    """Concatenate several batches (each of one or more steps) into one, re-padding to the
    widest and renumbering steps and groups so that they stay distinct."""
    if len(batches) == 1:
        return batches[0]
    width = max(b.width for b in batches)
    step_off, group_off = 0, 0
    cols: dict[str, list[torch.Tensor]] = {}
    steps: list[int] = []
    for b in batches:
        for name in TOKEN_FIELDS:
            t = getattr(b, name)
            cols.setdefault(name, []).append(
                None if t is None else torch.nn.functional.pad(t, (0, width - t.shape[1]))
            )
        for name in ("lengths", "prompt_length", "reward_baselines", "max_response_length", "max_prompt_length"):
            cols.setdefault(name, []).append(getattr(b, name))
        cols.setdefault("step_ids", []).append(b.step_ids + step_off)
        cols.setdefault("group_ids", []).append(b.group_ids + group_off)
        step_off += b.n_steps
        group_off += b.n_groups
        steps.extend(b.steps)
    out = {}
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
    extra = {}
    for k in extra_keys:
        parts, off = [], 0
        for b in batches:
            if k in _NEUTRAL_EXTRA and not all(x in b.extra for x in _NEUTRAL_EXTRA):
                codes = _NEUTRAL_EXTRA[k](b.n_rows, b.device)  # the pair is filled together
            else:
                codes = b.extra[k]
            if codes.dim() == 2:  # (rows, tokens) extras are re-padded like the token fields
                codes = torch.nn.functional.pad(codes, (0, width - codes.shape[1]))
            if k in ID_EXTRA_KEYS and codes.numel():
                parts.append(codes + off)
                off += int(codes.max()) + 1
            else:
                parts.append(codes)
        extra[k] = torch.cat(parts)
    return Batch(steps=steps, n_groups=group_off, extra=extra, **out)
