"""Micro-batch emulation: which (step, data-parallel rank, micro-batch) each row belongs to.

verl computes the actor's policy-loss metrics (``actor/pg_clipfrac``, ``actor/ppo_kl``,
``actor/pg_clipfrac_lower``, ...) and the critic's (``critic/vf_loss``, ``critic/vf_clipfrac``,
``critic/vpred_mean``) on each micro-batch, then logs the equal-weight mean over micro-batches
and DP ranks (``verl.utils.metric.Metric`` with ``AggregationType.MEAN``).
Losses normalised by global batch information (``actor/pg_loss``, ``actor/entropy_loss``,
``actor/kl_loss``: ``AggregationType.SUM``) add up over micro-batches to the whole-step value.

With ``rldiag.mini_batch_size`` (rows per optimizer step, verl's ``ppo_mini_batch_size`` times
``rollout.n``) a step is first cut into mini-batches in batch order; the global normalisers
(token count, batch size) are then each mini-batch's own, a SUM-type loss is the mini-batch's
total, and verl's trainer logs the mean over the step's mini-batches (``reduce_metrics``), for
MEAN-type metrics too (mean over a mini-batch's micro-batches, then over mini-batches).

A *segment* is one micro-batch of one rank of one mini-batch of one step. With ``rldiag.micro_batch_size`` null
and ``rldiag.dp_size`` 1 (the defaults) every step is a single segment. Rows are dealt in batch
order: rank ``r`` of a step with ``R`` rows takes rows ``[r L, (r + 1) L)``, ``L = ceil(R / D)``,
and cuts them into micro-batches of ``micro_batch_size`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rldiag.engine.balance import balanced_positions
from rldiag.engine.segments import seg_count, seg_max, seg_mean, seg_sum
from rldiag.engine.settings import EngineSettings
from rldiag.errors import ConfigError


@dataclass(frozen=True)
class Segmentation:
    """Rows of a packed batch grouped into segments.

    Attributes:
        seg_ids: ``(rows,)`` int64 in ``[0, n_seg)``, segments ordered by (step, rank, micro).
        n_seg: number of non-empty segments.
        seg_step: ``(n_seg,)`` int64, the packed step of each segment.
        n_steps: number of packed steps.
        dp_size: the emulated data-parallel size.
    """

    seg_ids: torch.Tensor
    n_seg: int
    seg_step: torch.Tensor
    n_steps: int
    dp_size: int
    seg_mini: torch.Tensor | None = None  # (n_seg,) mini-batch of each segment
    mini_step: torch.Tensor | None = None  # (n_mini,) step of each mini-batch
    row_mini: torch.Tensor | None = None  # (rows,) mini-batch of each row

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

    def per_segment(self, x: torch.Tensor) -> torch.Tensor:
        """A per-step quantity ``(n_steps,)`` repeated for each segment ``(n_seg,)``."""
        return x[self.seg_step]

    def horizon(self, lengths: torch.Tensor, step_horizon: torch.Tensor, fixed: bool) -> torch.Tensor:
        """Padded width of each segment ``(n_seg,)``: verl's ``loss_mask.shape[-1]`` fallback of
        ``seq-mean-token-sum-norm``. ``fixed``: the width is ``data.max_response_length`` (the
        step's ``step_horizon``); else the longest row of the segment."""
        if fixed:
            return step_horizon[self.seg_step]
        return seg_max(lengths.to(torch.float32), self.seg_ids, self.n_seg).to(step_horizon.dtype)


def segment_rows(
    step_ids: torch.Tensor, n_steps: int, micro_batch_size: int | None, dp_size: int, mini_batch_size: int | None = None,
    positions: torch.Tensor | None = None,
) -> Segmentation:
    """Segments of rows ``step_ids`` ``(rows,)`` for the given micro-batch, DP and mini-batch sizes.
    ``positions`` ``(rows,)``: each row's place in its step's order (default: batch order; verl's
    ``trainer.balance_batch`` reorders, :mod:`rldiag.engine.balance`)."""
    if dp_size < 1:
        raise ConfigError(f"rldiag.dp_size must be >= 1, got {dp_size}")
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ConfigError(f"rldiag.micro_batch_size must be >= 1 or null, got {micro_batch_size}")
    if mini_batch_size is not None and mini_batch_size < 1:
        raise ConfigError(f"rldiag.mini_batch_size must be >= 1 or null, got {mini_batch_size}")
    dev = step_ids.device
    if mini_batch_size is not None:
        return _segment_mini(step_ids, n_steps, micro_batch_size, dp_size, mini_batch_size, positions)
    if micro_batch_size is None and dp_size == 1:
        present = seg_count(step_ids, n_steps, torch.long) > 0
        steps = torch.nonzero(present).flatten()
        remap = torch.full((n_steps,), -1, dtype=torch.long, device=dev)
        remap[steps] = torch.arange(steps.numel(), device=dev)
        return Segmentation(remap[step_ids], int(steps.numel()), steps, n_steps, 1)
    pos, per_step = _positions(step_ids, n_steps)
    if positions is not None:
        pos = positions
    rank, local = _ranks(pos, per_step[step_ids], dp_size)
    micro = torch.zeros_like(local) if micro_batch_size is None else torch.div(local, micro_batch_size, rounding_mode="floor")
    cap = int(micro.max()) + 1 if micro.numel() else 1
    key = (step_ids * dp_size + rank) * cap + micro
    uniq, inv = torch.unique(key, sorted=True, return_inverse=True)
    seg_step = torch.div(uniq, dp_size * cap, rounding_mode="floor")
    return Segmentation(inv, int(uniq.numel()), seg_step, n_steps, dp_size)


def _positions(step_ids: torch.Tensor, n_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(position of each row within its step ``(rows,)``, rows per step ``(n_steps,)``)."""
    rows = step_ids.shape[0]
    per_step = seg_count(step_ids, n_steps, torch.long)
    order = torch.sort(step_ids, stable=True).indices
    start = torch.cumsum(per_step, 0) - per_step
    pos = torch.empty(rows, dtype=torch.long, device=step_ids.device)
    pos[order] = torch.arange(rows, device=step_ids.device) - start[step_ids[order]]
    return pos, per_step


def _ranks(pos: torch.Tensor, step_rows: torch.Tensor, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's dispatch: a step's rows in contiguous chunks of ``ceil(R / D)``, one per rank
    (``DataProto.chunk``). Returns (rank, position within the rank's chunk), each ``(rows,)``."""
    chunk = torch.div(step_rows + dp_size - 1, dp_size, rounding_mode="floor").clamp_min(1)
    rank = torch.div(pos, chunk, rounding_mode="floor")
    return rank, pos - rank * chunk


def _segment_mini(
    step_ids: torch.Tensor, n_steps: int, micro_batch_size: int | None, dp_size: int, mini_batch_size: int,
    positions: torch.Tensor | None = None,
) -> Segmentation:
    """Step -> one contiguous chunk per DP rank -> each rank's mini-batches of
    ``mini_batch_size / dp_size`` rows -> micro-batches, as verl's workers cut their own share
    (``train_mini_batch``); mini-batch ``k`` of a step is the ``k``-th of every rank."""
    if mini_batch_size % dp_size:
        raise ConfigError(
            f"rldiag.mini_batch_size ({mini_batch_size}) must be a multiple of rldiag.dp_size ({dp_size}), as verl asserts"
        )
    pos, per_step = _positions(step_ids, n_steps)
    if positions is not None:
        pos = positions
    rank, local = _ranks(pos, per_step[step_ids], dp_size)
    per_rank = mini_batch_size // dp_size
    mini = torch.div(local, per_rank, rounding_mode="floor")
    in_mini = local - mini * per_rank
    micro = torch.zeros_like(in_mini) if micro_batch_size is None else torch.div(in_mini, micro_batch_size, rounding_mode="floor")
    n_mini_cap = int(mini.max()) + 1 if pos.numel() else 1
    n_micro_cap = int(micro.max()) + 1 if pos.numel() else 1
    mini_key = step_ids * n_mini_cap + mini
    mini_uniq, row_mini = torch.unique(mini_key, sorted=True, return_inverse=True)
    seg_key = (mini_key * dp_size + rank) * n_micro_cap + micro
    seg_uniq, seg_ids = torch.unique(seg_key, sorted=True, return_inverse=True)
    seg_mini_key = torch.div(seg_uniq, dp_size * n_micro_cap, rounding_mode="floor")
    seg_mini = torch.searchsorted(mini_uniq, seg_mini_key)
    return Segmentation(
        seg_ids=seg_ids,
        n_seg=int(seg_uniq.numel()),
        seg_step=torch.div(seg_mini_key, n_mini_cap, rounding_mode="floor"),
        n_steps=n_steps,
        dp_size=dp_size,
        seg_mini=seg_mini,
        mini_step=torch.div(mini_uniq, n_mini_cap, rounding_mode="floor"),
        row_mini=row_mini,
    )


def resolve_auto(settings: EngineSettings, key: str) -> int | None:
    """``rldiag.mini_batch_size`` / ``rldiag.micro_batch_size`` with ``auto`` read from verl's
    keys in the run's config (``run``, the default: the same when the config has them, else the
    whole step): mini = ``actor.ppo_mini_batch_size * rollout.n`` (as verl's trainer
    multiplies it), micro = ``actor.ppo_micro_batch_size_per_gpu``."""
    value = settings.get(key)
    actor = "actor_rollout_ref.actor."
    if value == "run":  # the default: the run's own batching when its config says what it was
        value = "auto" if _run_has_batch_keys(settings, key) else None
    if value != "auto":
        return None if value is None else int(value)
    if key == "rldiag.mini_batch_size":
        mini, n = settings.get(actor + "ppo_mini_batch_size"), settings.get("actor_rollout_ref.rollout.n", 1)
        if mini is None:
            raise ConfigError(f"{key}=auto needs {actor}ppo_mini_batch_size in the run's config")
        return int(mini) * int(n or 1)
    micro = settings.get(actor + "ppo_micro_batch_size_per_gpu")
    if micro is None:
        raise ConfigError(f"{key}=auto needs {actor}ppo_micro_batch_size_per_gpu in the run's config")
    return int(micro)


def _run_has_batch_keys(settings: EngineSettings, key: str) -> bool:
    """Whether the run's config holds the verl keys ``auto`` reads for ``key`` (micro-batches of
    a fixed row count only: with ``use_dynamic_bsz`` verl packs them by tokens, not emulated)."""
    actor = "actor_rollout_ref.actor."
    if key == "rldiag.mini_batch_size":
        return settings.get(actor + "ppo_mini_batch_size") is not None
    return settings.get(actor + "ppo_micro_batch_size_per_gpu") is not None and not settings.get(actor + "use_dynamic_bsz")


def check_microbatch_settings(settings: EngineSettings) -> None:
    """Fail early on a micro-batch size or DP size that cannot be emulated."""
    dp = settings.get("rldiag.dp_size", 1)
    if dp is None or int(dp) < 1:
        raise ConfigError(f"rldiag.dp_size must be >= 1, got {dp!r}")
    mbs = resolve_auto(settings, "rldiag.micro_batch_size")
    if mbs is not None and int(mbs) < 1:
        raise ConfigError(f"rldiag.micro_batch_size must be >= 1 or null, got {mbs!r}")
    mini = resolve_auto(settings, "rldiag.mini_batch_size")
    if mini is not None and int(mini) < 1:
        raise ConfigError(f"rldiag.mini_batch_size must be >= 1 or null, got {mini!r}")
    if mini is not None and int(mini) % int(dp):
        raise ConfigError(f"rldiag.mini_batch_size ({mini}) must be a multiple of rldiag.dp_size ({dp}), as verl asserts")


def segmentation_for(
    step_ids: torch.Tensor, n_steps: int, settings: EngineSettings, seq_len: torch.Tensor | None = None
) -> Segmentation:
    """:func:`segment_rows` under ``rldiag.micro_batch_size``, ``rldiag.dp_size`` and
    ``rldiag.mini_batch_size``; with ``trainer.balance_batch`` (verl's default) and more than one
    rank, rows are first reordered by verl's workload balancing of ``seq_len`` ``(rows,)``
    (prompt + response tokens)."""
    dp = int(settings.get("rldiag.dp_size", 1))
    positions = None
    if dp > 1 and settings.get("trainer.balance_batch", True) and seq_len is not None:
        positions = balanced_positions(seq_len, step_ids, n_steps, dp)
    return segment_rows(
        step_ids, n_steps, resolve_auto(settings, "rldiag.micro_batch_size"), dp,
        resolve_auto(settings, "rldiag.mini_batch_size"), positions,
    )
