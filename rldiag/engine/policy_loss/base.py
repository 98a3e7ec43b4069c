"""Types, registry and shared helpers of the policy losses.

One signature: ``fn(inp: PolicyLossInput) -> PolicyLossOutput``. Token tensors are flat
``(tokens,)`` in the packed layout ``inp.norm.rows`` (:mod:`rldiag.engine.layout`). Every
reduction "over the batch" is a segment reduction keyed by ``inp.norm.seg_ids``: a segment is a
step, or one emulated micro-batch of one data-parallel rank of a step
(:mod:`rldiag.engine.microbatch`), exactly the unit verl computes a policy loss on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rldiag.engine import host
from rldiag.engine.aggregation import AggNorm, aggregate, token_weights
from rldiag.engine.segments import step_masked_mean
from rldiag.engine.settings import EngineSettings
from rldiag.errors import ConfigError
from rldiag.registry import Entry, Registry

LOG_RATIO_CLAMP = 20.0


@dataclass
class PolicyLossInput:
    """What a policy loss reads.

    ``norm.rows`` is the layout of the token tensors; ``norm.seg_ids`` ``(rows,)`` are segment ids
    in ``[0, norm.n_seg)``; the normalisers of ``norm`` are per segment (the step's global token count and batch size, verl's
    ``global_batch_info``). ``dp_size``: emulated data-parallel ranks (verl's ``dp_size``).
    """

    old_log_prob: torch.Tensor  # (tokens,) pi_old (pi_rollout in bypass mode)
    log_prob: torch.Tensor  # (tokens,) pi_theta
    advantages: torch.Tensor  # (tokens,)
    mask: torch.Tensor  # (tokens,) post-correction response_mask
    agg_mode: str
    norm: AggNorm
    settings: EngineSettings
    rollout_is_weights: torch.Tensor | None = None  # (tokens,)
    dp_size: int = 1

    @property
    def rows(self):
        """The row layout of the token tensors (``norm.rows``)."""
        return self.norm.rows


@dataclass
class PolicyLossOutput:
    """A policy loss over each segment.

    ``pg_loss`` ``(n_seg,)``: the segment's share of ``actor/pg_loss``; a step's logged value is
    the sum over its segments (verl's ``AggregationType.SUM``). ``metrics``: verl's metrics of
    this loss ``(n_seg,)``, logged as the equal-weight mean over a step's segments
    (``AggregationType.MEAN``). ``sums``: rldiag's own counts ``(n_seg,)``, summed per step.
    ``failed``: message -> ``(n_seg,)`` bool, segments on which verl raises.

    Per token, for rldiag's own diagnostics: ``weights`` ``(tokens,)``, each token's weight in its
    segment's ``pg_loss`` (``pg_loss[s] = sum_{t in s} weights_t pg_losses_t``: the aggregation's
    weights, 0 outside the mask the loss ran on); ``clipped`` ``(tokens,)`` float, 1 where the
    token counts toward ``actor/pg_clipfrac`` (clip_cov: the probability it is cut), 0 elsewhere
    and outside the mask, None for a loss without a clip fraction. Its masked mean over a segment
    is the segment's ``actor/pg_clipfrac`` (``up``: over the ``A <= 0`` tokens only).
    """

    pg_loss: torch.Tensor
    pg_losses: torch.Tensor  # (tokens,), IS weights applied
    ratio: torch.Tensor  # (tokens,), the importance ratio the loss uses
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    failed: dict[str, torch.Tensor] = field(default_factory=dict)
    weights: torch.Tensor | None = None
    clipped: torch.Tensor | None = None


PolicyLossFn = Callable[[PolicyLossInput], PolicyLossOutput]


@dataclass(frozen=True)
class LossMeta(Entry):
    """A policy loss's registration: ``needs``, the columns its ``actor/*`` metrics read;
    ``check``, settings -> None, raising :class:`~rldiag.errors.ConfigError` before any work
    where verl would reject the loss's configuration."""

    needs: tuple[str, ...] = ("old_log_probs", "log_probs")
    check: Callable[[EngineSettings], None] | None = None


POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss mode", meta=LossMeta)

ACTOR = "actor_rollout_ref.actor"
POLICY = "actor_rollout_ref.actor.policy_loss"


def clamped_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """``clamp(log_prob - old_log_prob, -20, 20)``: verl's guard before ``exp``."""
    return torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)


def seg_masked_mean(values: torch.Tensor, inp: PolicyLossInput, mask: torch.Tensor | None = None) -> torch.Tensor:
    """verl's ``masked_mean(values, mask)`` over each segment: ``sum / (count + 1e-8)`` ``(n_seg,)``."""
    return step_masked_mean(values, inp.mask if mask is None else mask, inp.rows, inp.norm.seg_ids, inp.norm.n_seg)


def weighted(losses: torch.Tensor, inp: PolicyLossInput) -> torch.Tensor:
    """Per-token losses times the rollout IS weights, when given (verl applies them after the
    loss's own clipping and before aggregation)."""
    return losses if inp.rollout_is_weights is None else losses * inp.rollout_is_weights


def agg(losses: torch.Tensor, inp: PolicyLossInput, mode: str | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``agg_loss`` of the token losses per segment with the step's global normalisers."""
    return aggregate(mode or inp.agg_mode, losses, inp.mask if mask is None else mask, inp.norm)


def agg_weights(inp: PolicyLossInput, mode: str | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's weight in :func:`agg` with the same arguments ``(tokens,)``."""
    return token_weights(mode or inp.agg_mode, inp.mask if mask is None else mask, inp.norm)


def masked(indicator: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A per-token indicator (bool or float) as float32, 0 outside ``mask``."""
    return host.indicator_on(indicator, mask)


def zeros(inp: PolicyLossInput) -> torch.Tensor:
    """A constant-0 metric ``(n_seg,)`` (verl's "for compatibility" zeros)."""
    return torch.zeros(inp.norm.n_seg, dtype=torch.float32, device=inp.mask.device)


def dual_clip_c(settings: EngineSettings) -> float:
    """``clip_ratio_c``, which verl's dual clip asserts is above 1."""
    clip_c = float(settings[f"{ACTOR}.clip_ratio_c"])
    if not clip_c > 1.0:
        raise ConfigError(f"{ACTOR}.clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_c}")
    return clip_c


def positive_setting(settings: EngineSettings, key: str, why: str, default: float | None = None) -> float:
    """A setting that must be > 0 (verl asserts it); ``None`` takes ``default`` when given."""
    value = settings[key]
    if value is None:
        value = default
    if value is None or not float(value) > 0:
        raise ConfigError(f"{why} needs {key} > 0, got {settings[key]!r}")
    return float(value)
