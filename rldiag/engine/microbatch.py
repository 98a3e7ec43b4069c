"""Micro-batch emulation: which (step, mini-batch, DP rank, micro-batch) each row belongs to.

verl computes the actor's policy-loss metrics (``actor/pg_clipfrac``, ``actor/ppo_kl``,
``actor/pg_clipfrac_lower``, ...) and the critic's (``critic/vf_loss``, ``critic/vf_clipfrac``,
``critic/vpred_mean``) on each micro-batch, then logs the equal-weight mean over micro-batches
and DP ranks (``verl.utils.metric.Metric`` with ``AggregationType.MEAN``).
Losses normalised by global batch information (``actor/pg_loss``, ``actor/entropy_loss``,
``actor/kl_loss``: ``AggregationType.SUM``) add up over micro-batches to the whole-step value.
Each mini-batch's global normalisers (token count, batch size) are its own, and the trainer logs
the mean over the step's mini-batches (``reduce_metrics``).

A *segment* is one micro-batch of one rank of one mini-batch of one step. The layout
(:mod:`rldiag.engine.batch_layout`: padding rows, balancing, dispatch, shuffle, mini- and
micro-batches, token budgets) decides the segments; by default every step is one segment.

The V1 trainer's padding rows are not rows of the batch: they exist here only as members of
segments, each with no token, the padding length's workload and token count. So a segment may
hold padding rows only: verl computes its metrics anyway (every masked mean is 0 there, as
``masked_mean``'s ``1e-8`` makes it) and averages them in; and a mini-batch's row count
(``global_batch_size``) counts them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
from torch.utils.data import DataLoader, Dataset

from rldiag.engine.balance import dispatch_order, workload
from rldiag.engine.batch_layout import BatchLayout, RoleLayout, batch_layout, check_microbatch_settings, resolve_auto
from rldiag.engine.dynamic_bsz import BudgetError, token_budget_micro_batches
from rldiag.engine.segments import seg_count, seg_max, seg_mean, seg_sum
from rldiag.engine.settings import EngineSettings
from rldiag.errors import ConfigError

__all__ = [
    "Segmentation", "check_microbatch_settings", "dataloader_order", "resolve_auto", "segment_layout",
    "segment_rows", "segmentation_for", "segmentations_for",
]


@dataclass(frozen=True)
class Segmentation:
    """Rows of a packed batch grouped into segments.

    Attributes:
        seg_ids: ``(rows,)`` int64 in ``[0, n_seg)``, segments ordered by (step, mini, rank, micro).
        n_seg: number of segments (a segment of padding rows only has no row here).
        seg_step: ``(n_seg,)`` int64, the packed step of each segment.
        n_steps: number of packed steps.
        dp_size: the emulated data-parallel size.
        seg_mini: ``(n_seg,)`` the mini-batch of each segment; ``mini_step`` ``(n_mini,)`` the step
            of each mini-batch; ``row_mini`` ``(rows,)`` the mini-batch of each row; None: one
            mini-batch per step.
        mini_rows: ``(n_mini,)`` float32 rows of each mini-batch, padding rows included.
        seg_pad: ``(n_seg,)`` bool, the segment holds padding rows.
        seg_rank: ``(n_seg,)`` int64, the DP rank of each segment.
        failed: message -> ``(n_steps,)`` bool, steps on which verl raises for this layout.
    """

    seg_ids: torch.Tensor
    n_seg: int
    seg_step: torch.Tensor
    n_steps: int
    dp_size: int
    seg_mini: torch.Tensor | None = None
    mini_step: torch.Tensor | None = None
    row_mini: torch.Tensor | None = None
    mini_rows: torch.Tensor | None = None
    seg_pad: torch.Tensor | None = None
    seg_rank: torch.Tensor | None = None
    failed: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def n_mini(self) -> int:
        return self.n_steps if self.mini_step is None else int(self.mini_step.numel())

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """verl's MEAN: equal-weight mean over each mini-batch's segments, then over the step's
        mini-batches ``(n_seg,) -> (n_steps,)``."""
        if self.seg_mini is None:
            return seg_mean(x, self.seg_step, self.n_steps)
        assert self.mini_step is not None  # set with seg_mini
        return seg_mean(seg_mean(x, self.seg_mini, self.n_mini), self.mini_step, self.n_steps)

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        """verl's SUM-type losses: summed over each mini-batch's segments (they are globally
        normalised within the mini-batch), then the mean over the step's mini-batches."""
        if self.seg_mini is None:
            return seg_sum(x, self.seg_step, self.n_steps)
        assert self.mini_step is not None  # set with seg_mini
        return seg_mean(seg_sum(x, self.seg_mini, self.n_mini), self.mini_step, self.n_steps)

    def loss_scale(self) -> torch.Tensor:
        """``(n_seg,)`` each segment's factor in :meth:`loss`, which is linear:
        ``loss(x) == total(x * loss_scale())`` (1 over the step's mini-batches)."""
        if self.seg_mini is None:
            return torch.ones(self.n_seg, dtype=torch.float32, device=self.seg_step.device)
        assert self.mini_step is not None  # set with seg_mini
        minis = seg_count(self.mini_step, self.n_steps)
        return 1.0 / minis.index_select(0, self.seg_step)

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over each step's segments ``(n_seg,) -> (n_steps,)`` (counts)."""
        return seg_sum(x, self.seg_step, self.n_steps)

    def normaliser(self, per_row: torch.Tensor, per_step: torch.Tensor) -> torch.Tensor:
        """A global normaliser for each segment ``(n_seg,)``: the step's ``per_step`` value, or
        with mini-batches the sum of ``per_row`` ``(rows,)`` over the segment's mini-batch."""
        if self.seg_mini is None:
            return per_step[self.seg_step]
        assert self.row_mini is not None  # set with seg_mini
        return seg_sum(per_row, self.row_mini, self.n_mini)[self.seg_mini]

    def batch_size(self) -> torch.Tensor:
        """verl's ``global_batch_size`` for each segment ``(n_seg,)`` float32: the rows of its
        mini-batch over all ranks, padding rows included (one segment per step: its rows)."""
        if self.mini_rows is not None and self.seg_mini is not None:
            return self.mini_rows[self.seg_mini]
        return seg_count(self.seg_ids, self.n_seg)

    def per_segment(self, x: torch.Tensor) -> torch.Tensor:
        """A per-step quantity ``(n_steps,)`` repeated for each segment ``(n_seg,)``."""
        return x[self.seg_step]

    def horizon(self, lengths: torch.Tensor, step_horizon: torch.Tensor, fixed: bool) -> torch.Tensor:
        """Padded width of each segment ``(n_seg,)``: verl's ``loss_mask.shape[-1]`` fallback of
        ``seq-mean-token-sum-norm``. ``fixed``: the width is ``data.max_response_length`` (the
        step's ``step_horizon``); else the longest row of the segment (a padding row: 1)."""
        if fixed:
            return step_horizon[self.seg_step]
        width = seg_max(lengths.to(torch.float32), self.seg_ids, self.n_seg)
        if self.seg_pad is not None:
            width = torch.where(self.seg_pad, torch.fmax(width, torch.ones_like(width)), width)
        return width.to(step_horizon.dtype)


# ---- the trainer: padding rows, balancing, dispatch -----------------------------------------


@dataclass(frozen=True)
class _Dispatch:
    """Every row of the padded steps, the batch's rows first, then the padding rows.

    ``step``, ``rank``, ``local`` (place within the rank's share), ``seq_len``, ``pad``: each
    ``(rows + pads,)``; ``rows``: the batch's row count."""

    step: torch.Tensor
    rank: torch.Tensor
    local: torch.Tensor
    seq_len: torch.Tensor
    pad: torch.Tensor
    rows: int
    n_steps: int
    dp: int


def _positions(step_ids: torch.Tensor, n_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(position of each row within its step ``(rows,)``, rows per step ``(n_steps,)``)."""
    rows = step_ids.shape[0]
    per_step = seg_count(step_ids, n_steps, torch.long)
    order = torch.sort(step_ids, stable=True).indices
    start = torch.cumsum(per_step, 0) - per_step
    pos = torch.empty(rows, dtype=torch.long, device=step_ids.device)
    pos[order] = torch.arange(rows, device=step_ids.device) - start[step_ids[order]]
    return pos, per_step


def _dispatch(
    step_ids: torch.Tensor, n_steps: int, layout: BatchLayout, seq_len: torch.Tensor | None, steps: list[int] | None,
    recorded: torch.Tensor | None = None,
) -> _Dispatch:
    """Pad each step (V1), balance it (when rldiag runs the balancing) and deal it to ranks in
    contiguous chunks of ``ceil(rows / dp)`` (``DataProto.chunk``). ``recorded`` ``(rows,)``:
    each row's place in the trainer's padded dispatch order, as the capture records it
    (``batch_position``), used when rldiag does not balance: the padding rows take the free
    places, and a step is at least as large as its last recorded place (the parts of a
    ``separate_async`` step follow each other)."""
    dev = step_ids.device
    rows = step_ids.shape[0]
    pos, real = _positions(step_ids, n_steps)
    run_steps = steps if steps is not None else list(range(n_steps))
    multiple = torch.tensor([layout.pad_multiple(int(s)) for s in run_steps], dtype=torch.long, device=dev)
    pads = torch.where(real > 0, (-real) % multiple, torch.zeros_like(real))
    balance = layout.balance and seq_len is not None
    if recorded is not None and not balance and rows:
        recorded = recorded.to(device=dev, dtype=torch.long)
        last = torch.zeros(n_steps, dtype=torch.long, device=dev).scatter_reduce_(
            0, step_ids, recorded + 1, reduce="amax")
        pads = torch.maximum(real + pads, last) - real
    else:
        recorded = None
    n_pad = int(pads.sum())
    pad_step = torch.repeat_interleave(torch.arange(n_steps, device=dev), pads)
    pad_idx = real[pad_step] + torch.arange(n_pad, device=dev) - (torch.cumsum(pads, 0) - pads)[pad_step]
    seq = torch.zeros(rows, dtype=torch.long, device=dev) if seq_len is None else seq_len.to(torch.long)
    step = torch.cat([step_ids, pad_step])
    idx = torch.cat([pos, pad_idx])
    v_seq = torch.cat([seq, torch.full((n_pad,), layout.pad_seq_len, dtype=torch.long, device=dev)])
    pad = torch.cat([torch.zeros(rows, dtype=torch.bool, device=dev), torch.ones(n_pad, dtype=torch.bool, device=dev)])
    total = real + pads
    if balance:
        idx = _balanced(step, idx, v_seq, total, layout)
    elif recorded is not None:
        idx = _recorded(step, recorded, total, rows)
    chunk = torch.div(total + layout.dp - 1, layout.dp, rounding_mode="floor").clamp_min(1)
    rank = torch.div(idx, chunk[step], rounding_mode="floor")
    return _Dispatch(step, rank, idx - rank * chunk[step], v_seq, pad, rows, n_steps, layout.dp)


def _recorded(step: torch.Tensor, recorded: torch.Tensor, total: torch.Tensor, rows: int) -> torch.Tensor:
    """The batch's rows at their recorded places, the padding rows (after them in ``step``) at
    the free places of their step in increasing order."""
    real_step = step[:rows]
    start = torch.cumsum(total, 0) - total
    taken = torch.zeros(int(total.sum()), dtype=torch.bool, device=step.device)
    taken[start[real_step] + recorded] = True
    free = torch.nonzero(~taken).flatten()  # in step order, then place order: the padding rows' order
    pad_step = step[rows:]
    return torch.cat([recorded, free[: pad_step.numel()] - start[pad_step]])


def _balanced(step: torch.Tensor, idx: torch.Tensor, seq: torch.Tensor, total: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
    """Each row's place in its step's dispatch order after verl's balancing (one partition per
    step, on the host; a step whose rows do not split evenly keeps its order, where verl would
    have failed)."""
    cap = int(total.max()) if total.numel() else 0
    order = torch.argsort(step * (cap + 1) + idx).cpu()
    loads = workload(seq).cpu()[order]
    start = (torch.cumsum(total, 0) - total).tolist()
    new = idx.clone().cpu()
    for a, count in zip(start, total.tolist()):
        if count == 0 or count % layout.dp:
            continue
        members = order[a : a + count]
        placed = torch.empty(count, dtype=torch.long)
        placed[torch.tensor(dispatch_order(loads[a : a + count].tolist(), layout.dp, legacy=not layout.v1))] = (
            torch.arange(count))
        new[members] = placed
    return new.to(idx.device)


# ---- each worker: shuffle, mini-batches, micro-batches --------------------------------------


def dataloader_order(n: int, seed: int) -> torch.Tensor:
    """The order in which ``train_mini_batch``'s iterator visits ``n`` rows with ``shuffle`` on:
    torch's own ``DataLoader`` (``tensordict_utils.make_iterator``) with a ``torch.Generator``
    seeded ``seed``, its first epoch ``(n,)`` int64 (CPU)."""
    gen = torch.Generator()
    gen.manual_seed(seed)
    indices = cast("Dataset[int]", range(n))  # what the sampler draws depends on the length only
    loader: DataLoader[int] = DataLoader(indices, batch_size=max(n, 1), shuffle=True, generator=gen, collate_fn=list)
    return torch.tensor(next(iter(loader)), dtype=torch.long) if n else torch.zeros(0, dtype=torch.long)


def _shuffled(d: _Dispatch, role: RoleLayout) -> torch.Tensor:
    """Each row's place in its rank's visiting order ``(rows + pads,)``: the DataLoader's
    permutation of the rank's rows (seed ``data_loader_seed + rank``; the same every step)."""
    dev = d.step.device
    group = d.step * d.dp + d.rank
    counts = torch.bincount(group, minlength=d.n_steps * d.dp)[: d.n_steps * d.dp]
    offsets = torch.cumsum(counts, 0) - counts
    tables: list[torch.Tensor] = []
    cache: dict[tuple[int, int], torch.Tensor] = {}
    for g, n in enumerate(counts.tolist()):  # one permutation per (step, rank): a seeded generator each
        key = (g % d.dp, n)
        if key not in cache:
            perm = dataloader_order(n, role.seed + key[0])
            inverse = torch.empty(n, dtype=torch.long)
            inverse[perm] = torch.arange(n)
            cache[key] = inverse
        tables.append(cache[key])
    table = torch.cat(tables).to(dev) if tables else torch.zeros(0, dtype=torch.long, device=dev)
    return table[offsets[group] + d.local]


def _dynamic_micro(
    d: _Dispatch, mini: torch.Tensor, in_mini: torch.Tensor, role: RoleLayout, until_within: bool,
    failed: dict[str, torch.Tensor],
) -> torch.Tensor:
    """Token-budget micro-batches of every (step, mini-batch), the ranks' rows in the order each
    rank holds them (:mod:`rldiag.engine.dynamic_bsz`); a mini-batch verl raises on fails its
    step (its rows stay in micro-batch 0)."""
    n_mini_cap = int(mini.max()) + 1 if mini.numel() else 1
    cap = int(in_mini.max()) + 1 if in_mini.numel() else 1
    group = d.step * n_mini_cap + mini
    order = torch.argsort((group * d.dp + d.rank) * cap + in_mini).cpu()
    g_sorted, r_sorted = group.cpu()[order].tolist(), d.rank.cpu()[order].tolist()
    seq_sorted = d.seq_len.cpu()[order].tolist()
    micro = torch.zeros(order.numel(), dtype=torch.long)
    bad = torch.zeros(d.n_steps, dtype=torch.bool)
    i, total = 0, len(g_sorted)
    while i < total:  # one (step, mini-batch) at a time: the ranks agree on the micro-batch count
        j = i
        while j < total and g_sorted[j] == g_sorted[i]:
            j += 1
        per_rank: list[list[int]] = [[] for _ in range(d.dp)]
        members: list[list[int]] = [[] for _ in range(d.dp)]
        for k in range(i, j):
            per_rank[r_sorted[k]].append(seq_sorted[k])
            members[r_sorted[k]].append(int(order[k]))
        try:
            ids = token_budget_micro_batches(per_rank, role.max_token_len, until_within)
        except BudgetError as exc:
            step = g_sorted[i] // n_mini_cap
            bad[step] = True
            failed.setdefault(f"use_dynamic_bsz: {exc}", torch.zeros(d.n_steps, dtype=torch.bool))[step] = True
            i = j
            continue
        for rows_of_rank, ids_of_rank in zip(members, ids):
            micro[rows_of_rank] = torch.tensor(ids_of_rank, dtype=torch.long)
        i = j
    return micro.to(d.step.device)


def _role_segments(d: _Dispatch, role: RoleLayout, until_within: bool) -> Segmentation:
    """The segments of one worker's cut of the dispatched rows."""
    failed: dict[str, torch.Tensor] = {}
    q = _shuffled(d, role) if role.shuffle else d.local
    if role.mini is not None:
        per_rank = role.mini // d.dp
        mini = torch.div(q, per_rank, rounding_mode="floor")
        in_mini = q - mini * per_rank
    else:
        mini, in_mini = torch.zeros_like(q), q
    if role.dynamic:
        micro = _dynamic_micro(d, mini, in_mini, role, until_within, failed)
    elif role.micro is not None:
        micro = torch.div(in_mini, role.micro, rounding_mode="floor")
    else:
        micro = torch.zeros_like(in_mini)
    n_mini_cap = int(mini.max()) + 1 if mini.numel() else 1
    n_micro_cap = int(micro.max()) + 1 if micro.numel() else 1
    mini_key = d.step * n_mini_cap + mini
    mini_uniq, row_mini = torch.unique(mini_key, sorted=True, return_inverse=True)
    seg_key = (mini_key * d.dp + d.rank) * n_micro_cap + micro
    seg_uniq, seg_ids = torch.unique(seg_key, sorted=True, return_inverse=True)
    seg_mini = torch.searchsorted(mini_uniq, torch.div(seg_uniq, d.dp * n_micro_cap, rounding_mode="floor"))
    n_seg, n_mini = int(seg_uniq.numel()), int(mini_uniq.numel())
    return Segmentation(
        seg_ids=seg_ids[: d.rows],
        n_seg=n_seg,
        seg_step=torch.div(mini_uniq, n_mini_cap, rounding_mode="floor")[seg_mini],
        n_steps=d.n_steps,
        dp_size=d.dp,
        seg_mini=seg_mini,
        mini_step=torch.div(mini_uniq, n_mini_cap, rounding_mode="floor"),
        row_mini=row_mini[: d.rows],
        mini_rows=seg_count(row_mini, n_mini),
        seg_pad=seg_sum(d.pad.to(torch.float32), seg_ids, n_seg) > 0,
        seg_rank=torch.div(seg_uniq, n_micro_cap, rounding_mode="floor") % d.dp,
        failed=failed,
    )


def _whole_steps(step_ids: torch.Tensor, n_steps: int) -> Segmentation:
    """Every step one segment (the default layout)."""
    dev = step_ids.device
    present = seg_count(step_ids, n_steps, torch.long) > 0
    steps = torch.nonzero(present).flatten()
    remap = torch.full((n_steps,), -1, dtype=torch.long, device=dev)
    remap[steps] = torch.arange(steps.numel(), device=dev)
    return Segmentation(remap[step_ids], int(steps.numel()), steps, n_steps, 1)


def segment_layout(
    step_ids: torch.Tensor, n_steps: int, layout: BatchLayout, seq_len: torch.Tensor | None = None,
    steps: list[int] | None = None, positions: torch.Tensor | None = None,
) -> tuple[Segmentation, Segmentation]:
    """The actor's and the critic's segments of the rows ``step_ids`` ``(rows,)`` under
    ``layout``. ``seq_len`` ``(rows,)``: each row's prompt + response tokens (the balancing's
    and the token budget's measure); ``steps``: the run step of each packed step (the actor's
    update starts at ``trainer.critic_warmup``, which changes the padding multiple);
    ``positions`` ``(rows,)``: each row's recorded place in the trainer's padded dispatch order
    (the ``batch_position`` column), read when rldiag does not balance."""
    if layout.trivial:
        whole = _whole_steps(step_ids, n_steps)
        return whole, whole
    if (layout.actor.dynamic or layout.critic.dynamic) and seq_len is None:
        raise ConfigError("use_dynamic_bsz needs each row's token count")
    d = _dispatch(step_ids, n_steps, layout, seq_len, steps, positions)
    actor = _role_segments(d, layout.actor, layout.until_within)
    critic = actor if layout.critic == layout.actor else _role_segments(d, layout.critic, layout.until_within)
    return actor, critic


def segment_rows(
    step_ids: torch.Tensor, n_steps: int, micro_batch_size: int | None, dp_size: int, mini_batch_size: int | None = None,
    positions: torch.Tensor | None = None,
) -> Segmentation:
    """Segments of rows ``step_ids`` ``(rows,)`` for the given micro-batch, DP and mini-batch
    sizes, rows dealt in batch order with no padding rows (the legacy trainer's layout without
    balancing). ``positions`` ``(rows,)``: each row's place in its step's dispatch order."""
    if dp_size < 1:
        raise ConfigError(f"rldiag.dp_size must be >= 1, got {dp_size}")
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ConfigError(f"rldiag.micro_batch_size must be >= 1 or null, got {micro_batch_size}")
    if mini_batch_size is not None and mini_batch_size < 1:
        raise ConfigError(f"rldiag.mini_batch_size must be >= 1 or null, got {mini_batch_size}")
    if mini_batch_size is not None and mini_batch_size % dp_size:
        raise ConfigError(
            f"rldiag.mini_batch_size ({mini_batch_size}) must be a multiple of rldiag.dp_size ({dp_size}), as verl asserts"
        )
    role = RoleLayout(mini=mini_batch_size, micro=micro_batch_size)
    layout = BatchLayout(dp=dp_size, v1=False, actor=role, critic=role)
    if layout.trivial:
        return _whole_steps(step_ids, n_steps)
    d = _dispatch(step_ids, n_steps, layout, None, None)
    if positions is not None:
        _, real = _positions(step_ids, n_steps)
        chunk = torch.div(real + dp_size - 1, dp_size, rounding_mode="floor").clamp_min(1)[step_ids]
        rank = torch.div(positions, chunk, rounding_mode="floor")
        d = _Dispatch(step_ids, rank, positions - rank * chunk, d.seq_len, d.pad, d.rows, n_steps, dp_size)
    seg = _role_segments(d, role, True)
    return seg


def segmentations_for(
    step_ids: torch.Tensor, n_steps: int, settings: EngineSettings, seq_len: torch.Tensor | None = None,
    steps: list[int] | None = None, positions: torch.Tensor | None = None,
) -> tuple[Segmentation, Segmentation]:
    """The actor's and the critic's segments under the settings (:func:`batch_layout`)."""
    return segment_layout(step_ids, n_steps, batch_layout(settings), seq_len, steps, positions)


def segmentation_for(
    step_ids: torch.Tensor, n_steps: int, settings: EngineSettings, seq_len: torch.Tensor | None = None,
    steps: list[int] | None = None,
) -> Segmentation:
    """The actor's segments under the settings."""
    return segmentations_for(step_ids, n_steps, settings, seq_len, steps)[0]
