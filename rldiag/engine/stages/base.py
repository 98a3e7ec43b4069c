"""What a stage is: a step of verl's order of operations run over a shared :class:`State`, with a
declaration of what it reads (batch columns, settings) and what it writes (metrics, token outputs,
per-row outputs).

The declarations are the one place these facts are written: the column planner
(:mod:`rldiag.engine.requirements`) derives which columns a load reads from them, ``rldiag check``
its metric families, and ``docs/metrics.md`` its table (``python -m rldiag.engine.stages``).

Metric names in a declaration may be patterns: ``{a,b}`` one of the alternatives, ``<word>`` a
placeholder for a name part (no ``/``, e.g. ``<option>``), ``*`` any rest of the name.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rldiag.engine.aggregation import AggNorm
from rldiag.engine.batch import Batch
from rldiag.engine.kl_control import KLControllerState, PresetKLCoefficients
from rldiag.engine.layout import Rows
from rldiag.engine.microbatch import Segmentation
from rldiag.engine.policy_loss.base import PolicyLossOutput
from rldiag.engine.segments import seg_sum
from rldiag.engine.settings import EngineSettings
from rldiag.engine.step_failures import StepErrors

ColumnsFn = Callable[[EngineSettings], tuple[str, ...]]


@dataclass(frozen=True)
class Metric:
    """One metric (or a family of names, as a pattern) a stage writes, ``(n_steps,)`` per step.

    ``family``: where the number comes from (verl's data / actor / critic / rollout-correction /
    reward / training metrics, or rldiag's own); ``needs``: columns it needs beyond its stage's;
    ``when``: the setting (or other condition) under which it is written, in words."""

    name: str
    meaning: str
    family: str
    needs: tuple[str, ...] = ()
    when: str = ""


@dataclass(frozen=True)
class CheckFamily:
    """A row of ``rldiag check``'s metric-families table: ``label`` is available when a run's
    columns include ``needs`` (the stage's own ``needs`` when None). ``listed``: the row's place
    in that table (the order the command has always printed)."""

    label: str
    listed: int
    needs: tuple[str, ...] | None = None


def per_bucket(key: torch.Tensor, live: torch.Tensor, n_steps: int, n_buckets: int, span_sums: torch.Tensor) -> torch.Tensor:
    """``(spans,)`` -> ``(n_steps, n_buckets)``: the live spans' sums added up per ``key`` (step *
    buckets + bucket), in float64."""
    x = span_sums.to(torch.float64)
    return seg_sum(torch.where(live, x, torch.zeros_like(x)), key, n_steps * n_buckets).view(n_steps, n_buckets)


@dataclass(frozen=True)
class TurnSpans:
    """Every row cut at its turn starts (a span lies in one turn, or before the first), and what
    sums over spans per (step, turn bucket) need: what the ``turns`` stage finds and
    ``turns_loss`` reuses (:mod:`rldiag.engine.stages.turns`)."""

    spans: Rows
    key: torch.Tensor  # (spans,) step * buckets + bucket
    live: torch.Tensor  # (spans,) the span is in a turn (a row's leading tool tokens are not)
    n_steps: int
    count: torch.Tensor  # (n_steps, buckets) T_k, the trained-on tokens of each turn bucket

    def per_turn(self, span_sums: torch.Tensor) -> torch.Tensor:
        """``(spans,)`` -> ``(n_steps, buckets)``: summed per step and turn bucket."""
        return per_bucket(self.key, self.live, self.n_steps, int(self.count.shape[1]), span_sums)

    def means(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-token means over each bucket's T_k tokens (0 where it has none)."""
        has = self.count > 0
        return {k: torch.where(has, v / torch.where(has, self.count, torch.ones_like(self.count)), torch.zeros_like(v))
                for k, v in sums.items()}


@dataclass
class State:
    """What the stages share for one packed batch: the inputs, what earlier stages produced,
    and the results (``metrics``: name -> ``(n_steps,)``; ``tokens``: name -> ``(tokens,)``; ``rows``:
    name -> ``(rows,)``, the batch's packed row order; not to be confused with ``batch.rows``, the layout)."""

    batch: Batch
    settings: EngineSettings
    kl_state: KLControllerState | PresetKLCoefficients | None
    errors: StepErrors
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    keep_tokens: bool = True  # the per-token outputs are kept (False: a stage may skip making them)
    # anchor
    bypass: bool = False
    mask0: torch.Tensor = field(init=False)  # the original mask (loss_mask, else response_mask)
    old_lp: torch.Tensor | None = None  # pi_old as the update uses it (rollout_log_probs in bypass mode)
    # reward KL, rollout correction
    rewards: torch.Tensor = field(init=False)  # token_level_rewards
    mask: torch.Tensor = field(init=False)  # response_mask after rejection
    is_weights: torch.Tensor | None = None
    # diagnostic IS weights (diag_is; never enter the loss): TIS at 2.0 on the original mask
    diag_is_token: torch.Tensor | None = None  # (tokens,) token-level weights
    diag_is_seq: torch.Tensor | None = None  # (rows,) sequence-level weights
    diag_is_seq_ratio: torch.Tensor | None = None  # (rows,) sequence-level ratios, untruncated
    # the filters (stages/filter.py): the rows they take out of the update, (rows,) bool, None
    # when none is set; the update's mask before the filter and the advantages it would have had
    dropped: torch.Tensor | None = None
    mask_before: torch.Tensor | None = None
    adv_before: torch.Tensor | None = None
    # advantages
    use_critic: bool = False
    adv: torch.Tensor = field(init=False)
    ret: torch.Tensor = field(init=False)
    # the micro-batch layout
    segs: Segmentation = field(init=False)
    critic_segs: Segmentation = field(init=False)
    fixed_width: bool = False  # the legacy trainer pads to data.max_response_length
    token_count: torch.Tensor = field(init=False)  # (n_steps,) the original mask's tokens
    actor_norm: AggNorm = field(init=False)
    agg_mode: str = ""
    # the actor's policy loss (actor_loss), None without log_probs and pi_old
    policy: PolicyLossOutput | None = None
    # turns (turns): each token's turn (0: not an actor token), each token's weight in actor/pg_loss
    turn: torch.Tensor = field(init=False)
    turn_spans: TurnSpans | None = None  # the rows cut at their turns (turns), for the loss's part (turns_loss, which drops them)
    loss_weights: torch.Tensor | None = None

    def global_norm_of(self, s: Segmentation, filtered: bool = True) -> AggNorm:
        """The global normalisers of a segmentation: verl's ``global_batch_info`` (the original
        mask's token count, the mini-batch's rows with V1's padding rows). ``filtered``: the rows
        the filters dropped (:attr:`dropped`) are out of both (at least 1 left)."""
        batch, rows = self.batch, self.batch.rows
        row_tokens = rows.sum(self.mask0.to(torch.float32))
        tokens, size = s.normaliser(row_tokens, self.token_count), s.batch_size()
        if filtered and self.dropped is not None:
            out = self.dropped.to(torch.float32)
            sid, n = batch.step_ids, batch.n_steps
            tokens = (tokens - s.normaliser(row_tokens * out, seg_sum(row_tokens * out, sid, n))).clamp_min(1)
            size = (size - s.normaliser(out, seg_sum(out, sid, n))).clamp_min(1)
        return AggNorm(
            seg_ids=s.seg_ids,
            n_seg=s.n_seg,
            horizon=s.horizon(batch.lengths, batch.max_response_length, self.fixed_width),
            rows=rows,
            batch_num_tokens=tokens,
            global_batch_size=size,  # the mini-batch's rows, V1's padding rows included
            loss_scale_factor=self.settings["actor_rollout_ref.actor.loss_scale_factor"],
        )


@dataclass(frozen=True)
class Stage:
    """A named step of the recompute and its declaration.

    ``needs``: the columns it needs to write its metrics (as ``rldiag check`` and the docs name
    them); ``needs_fn``: the same under given settings, where they decide (the PPO anchor, a
    registry entry); ``optional`` / ``optional_fn``: columns it reads when the batch has them.
    ``settings``: the keys it reads (``prefix.*`` for a block). ``metrics``, ``tokens``, ``rows``:
    what it writes (per step, per token, per row). ``checks``: its rows of ``rldiag check``'s
    metric families.

    ``settings_fn``: the keys it reads under given settings, where they decide (a stage that does
    nothing unless a feature is on reads the feature's keys alone when it is off); a sweep compares
    scenarios on these.

    ``uses`` / ``sets``: the :class:`State` fields it reads (beyond ``batch`` and ``settings``;
    ``metrics:<name>`` for a metric an earlier stage wrote) and those it assigns or changes
    (``errors`` where it flags a step; the metrics, tokens and rows it writes are those it
    declares). A sweep (:mod:`rldiag.engine.sweep`) runs a stage once for scenarios that differ
    only in stages it does not depend on; None (undeclared): it is never moved, nor another
    stage past it."""

    name: str
    doc: str
    run: Callable[[State], None]
    needs: tuple[str, ...] = ()
    needs_fn: ColumnsFn | None = None
    optional: tuple[str, ...] = ()
    optional_fn: ColumnsFn | None = None
    settings: tuple[str, ...] = ()
    settings_fn: ColumnsFn | None = None
    metrics: tuple[Metric, ...] = ()
    tokens: tuple[str, ...] = ()
    rows: tuple[str, ...] = ()
    checks: tuple[CheckFamily, ...] = ()
    uses: tuple[str, ...] | None = None
    sets: tuple[str, ...] | None = None

    def required(self, settings: EngineSettings | None = None) -> tuple[str, ...]:
        """The columns it needs (under ``settings`` when given)."""
        return self.needs_fn(settings) if settings is not None and self.needs_fn is not None else self.needs

    def reads(self, settings: EngineSettings | None = None) -> tuple[str, ...]:
        """Every column it reads when the batch has it: required and optional, each once."""
        optional = self.optional_fn(settings) if settings is not None and self.optional_fn is not None else self.optional
        return tuple(dict.fromkeys(self.required(settings) + optional))


def expand(pattern: str) -> list[str]:
    """A pattern with its ``{a,b}`` alternatives spelt out (``x/{a,b}`` -> ``x/a``, ``x/b``)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    return [p for alt in m.group(1).split(",") for p in expand(pattern[:m.start()] + alt + pattern[m.end():])]


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """The regular expression of a metric-name pattern (the whole name)."""
    out = ""
    for token in re.split(r"(\{[^{}]*\}|<[^<>]*>|\*)", pattern):
        if token.startswith("{"):
            out += "(?:" + "|".join(re.escape(a) for a in token[1:-1].split(",")) + ")"
        elif token.startswith("<"):
            out += "[^/]+"
        elif token == "*":
            out += ".+"
        else:
            out += re.escape(token)
    return re.compile(out + r"\Z")
