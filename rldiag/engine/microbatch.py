"""Micro-batch emulation: which (step, data-parallel rank, micro-batch) each row belongs to.

verl computes the actor's policy-loss metrics (``actor/pg_clipfrac``, ``actor/ppo_kl``,
``actor/pg_clipfrac_lower``, ...) and the critic's (``critic/vf_loss``, ``critic/vf_clipfrac``,
``critic/vpred_mean``) on each micro-batch, then logs the equal-weight mean over micro-batches
and DP ranks (``verl.utils.metric.Metric`` with ``AggregationType.MEAN``, seed 001 section 15).
Losses normalised by global batch information (``actor/pg_loss``, ``actor/entropy_loss``,
``actor/kl_loss``: ``AggregationType.SUM``) add up over micro-batches to the whole-step value.

A *segment* is one micro-batch of one rank of one step. With ``rldiag.micro_batch_size`` null
and ``rldiag.dp_size`` 1 (the defaults) every step is a single segment. Rows are dealt in batch
order: rank ``r`` of a step with ``R`` rows takes rows ``[r L, (r + 1) L)``, ``L = ceil(R / D)``,
and cuts them into micro-batches of ``micro_batch_size`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rldiag.config.settings import Settings
from rldiag.engine.segments import seg_count, seg_max, seg_mean, seg_sum
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

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """Equal-weight mean over each step's segments ``(n_seg,) -> (n_steps,)`` (verl's MEAN)."""
        return seg_mean(x, self.seg_step, self.n_steps)

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over each step's segments ``(n_seg,) -> (n_steps,)``."""
        return seg_sum(x, self.seg_step, self.n_steps)

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


def segment_rows(step_ids: torch.Tensor, n_steps: int, micro_batch_size: int | None, dp_size: int) -> Segmentation:
    """Segments of rows ``step_ids`` ``(rows,)`` for the given micro-batch and DP sizes."""
    if dp_size < 1:
        raise ConfigError(f"rldiag.dp_size must be >= 1, got {dp_size}")
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ConfigError(f"rldiag.micro_batch_size must be >= 1 or null, got {micro_batch_size}")
    dev = step_ids.device
    rows = step_ids.shape[0]
    if micro_batch_size is None and dp_size == 1:
        present = seg_count(step_ids, n_steps, torch.long) > 0
        steps = torch.nonzero(present).flatten()
        remap = torch.full((n_steps,), -1, dtype=torch.long, device=dev)
        remap[steps] = torch.arange(steps.numel(), device=dev)
        return Segmentation(remap[step_ids], int(steps.numel()), steps, n_steps, 1)
    per_step = seg_count(step_ids, n_steps, torch.long)
    order = torch.sort(step_ids, stable=True).indices
    start = torch.cumsum(per_step, 0) - per_step
    pos = torch.empty(rows, dtype=torch.long, device=dev)
    pos[order] = torch.arange(rows, device=dev) - start[step_ids[order]]
    chunk = torch.div(per_step + dp_size - 1, dp_size, rounding_mode="floor").clamp_min(1)  # L per step
    rank = torch.div(pos, chunk[step_ids], rounding_mode="floor")
    local = pos - rank * chunk[step_ids]
    if micro_batch_size is None:
        micro = torch.zeros_like(local)
        cap = 1
    else:
        micro = torch.div(local, micro_batch_size, rounding_mode="floor")
        cap = int(micro.max()) + 1 if rows else 1
    key = (step_ids * dp_size + rank) * cap + micro
    uniq, inv = torch.unique(key, sorted=True, return_inverse=True)
    seg_step = torch.div(uniq, dp_size * cap, rounding_mode="floor")
    return Segmentation(inv, int(uniq.numel()), seg_step, n_steps, dp_size)


def check_microbatch_settings(settings: Settings) -> None:
    """Fail early on a micro-batch size or DP size that cannot be emulated."""
    dp = settings.get("rldiag.dp_size", 1)
    if dp is None or int(dp) < 1:
        raise ConfigError(f"rldiag.dp_size must be >= 1, got {dp!r}")
    mbs = settings.get("rldiag.micro_batch_size")
    if mbs is not None and int(mbs) < 1:
        raise ConfigError(f"rldiag.micro_batch_size must be >= 1 or null, got {mbs!r}")


def segmentation_for(step_ids: torch.Tensor, n_steps: int, settings: Settings) -> Segmentation:
    """:func:`segment_rows` under ``rldiag.micro_batch_size`` and ``rldiag.dp_size``."""
    return segment_rows(step_ids, n_steps, settings.get("rldiag.micro_batch_size"), int(settings.get("rldiag.dp_size", 1)))
