"""``rldiag layout-audit``: which metrics are artefacts of the parallel layout, and by how much.

verl computes the actor's and the critic's metrics per micro-batch of each DP rank of each
mini-batch and then averages or sums them (docs/algorithms-losses.md), so the same data logs
different numbers under a different layout. The audit recomputes the run under the layouts verl
users change (:func:`candidate_layouts`: the run's own; one batch per step; the micro-batch
halved and doubled; DP 1, 2 and 4; ``use_dynamic_bsz`` on and off; the mini-batch halved;
``trainer.balance_batch`` off for the legacy trainer), and for every metric measures how far the
layouts spread it (:func:`audit_metrics`):

- ``relative_spread``: the median over steps of ``(max - min over layouts) / (|own| + 1e-12)``;
- ``layout_dependent``: ``relative_spread > 1e-5``;
- ``why``: the aggregation that makes it so, from how verl combines the metric's family
  (:data:`COMBINATIONS`, with the aggregation mode) and which layouts move it;
- ``best_match``: for a metric the trainer logged, the layout whose recompute is closest to the
  log (the smallest median relative error over steps).

A layout verl would refuse (:func:`refusal`: rldiag's own check, then verl's assertions on micro-
and mini-batch sizes) is listed as skipped with the reason; a layout whose resolved batch layout
equals an earlier one is folded into it (``folded``). What runs is written under
``RUN/rldiag/sweeps/layout-audit/`` (:class:`~rldiag.io.run_layout.LayoutAuditLayout`): one
scenario per layout, ``metrics.parquet`` (one row per metric) and ``audit.json`` last.

The planning and the statistics are pure functions of the settings, the steps' row counts and
per-layout metric tables; :func:`run_layouts` is the one place that recomputes. It calls
:func:`rldiag.scenario.recompute.recompute` once per layout; a sweep driver that reads each step once for
every layout (``rldiag.sweep``, being built) replaces its body, nothing else.
"""

from __future__ import annotations

import fnmatch
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rldiag.config.settings import Settings, resolve_settings
from rldiag.engine.batch_layout import (
    ACTOR,
    CRITIC,
    BatchLayout,
    batch_layout,
    describe_layout,
    is_v1,
    role_layout,
    rollout_n,
    rows_balanced,
    uses_critic,
)
from rldiag.errors import RldiagError
from rldiag.io.fs import RemotePath
from rldiag.io.outputs import json_safe
from rldiag.io.rundir import RunDir, Steps, parse_steps

if TYPE_CHECKING:
    import polars as pl

    from rldiag.io.run_layout import LayoutAuditLayout

ProgressFn = Callable[[int, int, str], None]

#: the run's own layout: every spread is relative to it
OWN = "own"
#: a metric is layout-dependent above this relative spread
DEPENDENT_ABOVE = 1e-5
#: added to |own| in the relative spread (and to |logged| in the relative error)
EPS = 1e-12
#: the DP sizes tried
DP_SIZES = (1, 2, 4)
DYNAMIC_KEYS = (ACTOR + "use_dynamic_bsz", CRITIC + "use_dynamic_bsz")

# ---- why a metric depends on the layout -----------------------------------------------------------

#: How verl combines each metric over a step's micro-batches, DP ranks and mini-batches, by
#: metric pattern (the first that matches wins), as ``rldiag/engine/stages/actor.py``
#: ``combine_policy_loss`` and the critic stage reproduce it: ``mean`` (verl's
#: ``AggregationType.MEAN``: each micro-batch's own masked mean, equal weights), ``loss``
#: (``AggregationType.SUM`` of losses normalised by the mini-batch's global token or row count),
#: ``count`` (summed, of tokens picked within each micro-batch), ``step`` (the trainer's, over the
#: whole step).
COMBINATIONS: tuple[tuple[str, str], ...] = (
    ("actor/pg_loss", "loss"),
    ("actor/entropy_loss", "loss"),
    ("actor/kl_loss", "loss"),
    ("actor/loss", "loss"),
    ("critic/vf_loss", "loss"),
    ("actor/pg_clipfrac", "mean"),
    ("actor/pg_clipfrac_lower", "mean"),
    ("actor/ppo_kl", "mean"),
    ("actor/rollout_corr/*", "mean"),
    ("critic/vf_clipfrac", "mean"),
    ("critic/vpred_mean", "mean"),
    ("rldiag/clip_cov/*", "count"),
    ("rldiag/kl_cov/*", "count"),
    # a token's share of the actor loss: its micro-batch's scale, as the loss is laid out
    ("rldiag/turns/*/loss_weight", "loss"),
    ("rldiag/filter/dropped_weight_share", "loss"),
    ("rldiag/grad_weight/*", "loss"),  # shares of the gradient weight: the loss's aggregation, as laid out
    ("*", "step"),
)
_TAIL = ", then a mean over the step's mini-batches"
#: what each combination is, in words (a ``loss`` in the words of its aggregation mode)
_COMBINED = {
    "mean": "a mean of per-micro-batch means (every micro-batch of every DP rank weighs the same, whatever its "
            "token count)" + _TAIL,
    "count": "a sum over micro-batches of tokens picked within each micro-batch",
    "step": "computed once over the whole step, before the update is laid out",
}
_LOSS = {
    "token-mean": "a sum over micro-batches of token-sum-normalised losses (each micro-batch's token sum over its "
                  "mini-batch's token count)",
    "token-sum": "a sum over micro-batches of token sums (a mini-batch's total, which grows with its size)",
    "seq-mean-token-sum": "a sum over micro-batches of row sums over the mini-batch's row count",
    "seq-mean-token-mean": "a sum over micro-batches of row means over the mini-batch's row count",
    "seq-mean-token-sum-norm": "a sum over micro-batches of row sums over the mini-batch's row count and a fixed width",
}
NOTE_DYNAMIC = "dynamic batches change the micro-batch composition"
NOTE_PADDING = "padding rows of V1 in the denominator"
NOTE_PADDING_MEAN = "micro-batches of V1's padding rows count in the mean"
NOTE_WIDTH = "the micro-batch's longest row as the divisor (seq-mean-token-sum-norm without loss_scale_factor, V1)"


def combination(metric: str) -> str:
    """How verl combines ``metric`` over micro-batches (:data:`COMBINATIONS`)."""
    return next(kind for pattern, kind in COMBINATIONS if fnmatch.fnmatchcase(metric, pattern))


@dataclass(frozen=True)
class WhyContext:
    """What the words of ``why`` depend on besides the metric: the aggregation modes, the
    trainer, the loss, and which layouts pad rows or cut by token budget."""

    actor_agg: str = "token-mean"
    critic_agg: str = "token-mean"
    v1: bool = True
    loss_mode: str = "vanilla"
    scale_factor: bool = False  # a loss_scale_factor is set (seq-mean-token-sum-norm's divisor)
    padded: frozenset[str] = frozenset()  # layouts that add V1 padding rows to some step
    dynamic: frozenset[str] = frozenset()  # layouts cutting micro-batches by token budget

    @classmethod
    def of(cls, settings: Settings, layouts: Sequence[AuditLayout] = ()) -> WhyContext:
        return cls(actor_agg=settings.actor_agg_mode, critic_agg=settings.critic_agg_mode, v1=is_v1(settings),
                   loss_mode=str(settings[ACTOR + "policy_loss.loss_mode"]),
                   scale_factor=settings[ACTOR + "loss_scale_factor"] is not None,
                   padded=frozenset(x.name for x in layouts if x.padded),
                   dynamic=frozenset(x.name for x in layouts if x.dynamic))


def why(metric: str, ctx: WhyContext, differs_in: Sequence[str] = ()) -> str:
    """The aggregation that makes ``metric`` depend on the layout (or not), and what the layouts
    it differs in (``differs_in``) change about it."""
    kind = combination(metric)
    if kind != "loss":
        text = _COMBINED[kind]
    elif metric == "actor/pg_loss" and ctx.loss_mode == "geo_mean":
        text = "a sum over micro-batches of per-micro-batch row means (geo_mean ignores loss_agg_mode)" + _TAIL
    else:
        agg = ctx.critic_agg if metric.startswith("critic/") else ctx.actor_agg
        text = _LOSS.get(agg, f"a sum over micro-batches of {agg} losses") + _TAIL
    notes = []
    moved = set(differs_in)
    if kind == "loss" and ctx.v1 and ctx.actor_agg == "seq-mean-token-sum-norm" and not ctx.scale_factor and moved:
        notes.append(NOTE_WIDTH)
    if moved & ctx.padded:
        if kind == "loss" and (ctx.critic_agg if metric.startswith("critic/") else ctx.actor_agg).startswith("seq-mean"):
            notes.append(NOTE_PADDING)
        elif kind == "mean":
            notes.append(NOTE_PADDING_MEAN)
    if moved & ctx.dynamic and kind != "step":
        notes.append(NOTE_DYNAMIC)
    return "; ".join([text, *notes])


# ---- the layouts ----------------------------------------------------------------------------------


@dataclass
class AuditLayout:
    """One layout of the audit.

    Attributes:
        name: ``own``, ``one_batch``, ``micro_batch_x0.5``, ``dp=2``, ``dynamic_bsz=on``, ...
        settings: the overrides that make it, on top of the run's settings (and the audit's own
            overrides); ``{}`` for ``own``.
        skipped: why it was not recomputed (verl would refuse it, or it cannot apply); None: it ran.
        folded: the layouts equal to this one (the same resolved batch layout), not run again.
        layout: the batch layout in words (:func:`rldiag.engine.batch_layout.describe_layout`).
        padded: V1 adds padding rows to some step under it; dynamic: token-budget micro-batches.
        steps_failed: step -> why, for the steps its recompute failed on.
    """

    name: str
    settings: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None
    folded: list[str] = field(default_factory=list)
    layout: str = ""
    padded: bool = False
    dynamic: bool = False
    steps_failed: dict[int, str] = field(default_factory=dict)

    @property
    def runs(self) -> bool:
        return self.skipped is None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "settings": dict(self.settings), "skipped": self.skipped, "folded": list(self.folded),
                "layout": self.layout, "steps_failed": {str(k): v for k, v in sorted(self.steps_failed.items())}}


def _fmt(x: float) -> str:
    return f"{x:g}"


def _scaled(settings: Settings, key: str, factor: float) -> dict[str, Any] | str:
    """``rldiag.micro_batch_size`` or ``rldiag.mini_batch_size`` times ``factor`` (an integer,
    applying to both workers), or why it cannot be."""
    micro = key == "rldiag.micro_batch_size"
    what = "micro-batch" if micro else "mini-batch"
    actor = role_layout(settings, "actor")
    if micro and actor.dynamic:
        return "the run cuts micro-batches by token budget (use_dynamic_bsz): there is no micro-batch size to scale"
    own = actor.micro if micro else actor.mini
    if own is None:
        return (f"each mini-batch is one micro-batch ({key} null or not in the run's config): there is no "
                f"{what} size to scale") if micro else (
                f"each step is one mini-batch ({key} null or not in the run's config): there is no {what} size to scale")
    if uses_critic(settings):
        critic = role_layout(settings, "critic")
        theirs = critic.micro if micro else critic.mini
        if not critic.dynamic and theirs != own:
            return (f"the actor's and the critic's {what}es differ ({own} and {theirs} rows) and {key} sets both")
    new = own * factor
    n = rollout_n(settings)
    if new != int(new) or new < 1:
        return f"a {what} of {own} rows cannot be {'halved' if factor < 1 else 'scaled'} to a whole number of rows"
    if not micro and int(new) % n:
        prompts = f"{own / n:g} prompt{'' if own == n else 's'}"
        return (f"a mini-batch of {own} rows ({prompts} x rollout.n {n}) halves to {new:g} rows, not a whole "
                "number of prompts (verl counts ppo_mini_batch_size in prompts)")
    return {key: int(new)}


def candidate_layouts(settings: Settings) -> list[AuditLayout]:
    """The layouts verl users change, named, as overrides on ``settings`` (the run's own plus
    the audit's), in the order they are listed; those that cannot apply carry the reason in
    ``skipped``. Nothing is checked against verl's rules here (:func:`plan_layouts` does)."""
    out = [AuditLayout(OWN, {}),
           AuditLayout("one_batch", {"rldiag.mini_batch_size": None, "rldiag.micro_batch_size": None,
                                     "rldiag.dp_size": 1})]
    for factor in (0.5, 2.0):
        got = _scaled(settings, "rldiag.micro_batch_size", factor)
        name = f"micro_batch_x{_fmt(factor)}"
        out.append(AuditLayout(name, got) if isinstance(got, dict) else AuditLayout(name, skipped=got))
    own_dp = int(settings.get("rldiag.dp_size", 1) or 1)
    for dp in DP_SIZES:
        over: dict[str, Any] = {"rldiag.dp_size": dp}
        if dp != own_dp and dp > 1 and rows_balanced(settings):
            # the rows are stored as balanced for the run's own DP size: balance them again
            over["rldiag.rows_balanced"] = False
        out.append(AuditLayout(f"dp={dp}", over))
    for on in (True, False):
        name = f"dynamic_bsz={'on' if on else 'off'}"
        over = {k: on for k in DYNAMIC_KEYS}
        if (not on and bool(settings.get(DYNAMIC_KEYS[0])) and settings.get("rldiag.micro_batch_size") in ("run", "auto")
                and settings.get(ACTOR + "ppo_micro_batch_size_per_gpu") is None):
            out.append(AuditLayout(name, over, skipped=(
                "without use_dynamic_bsz verl needs actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, which the "
                "run's config does not set (verl's ActorConfig asserts one)")))
        else:
            out.append(AuditLayout(name, over))
    got = _scaled(settings, "rldiag.mini_batch_size", 0.5)
    out.append(AuditLayout("mini_batch_x0.5", got) if isinstance(got, dict) else AuditLayout("mini_batch_x0.5", skipped=got))
    if is_v1(settings):
        out.append(AuditLayout("balance_batch=off", {"trainer.balance_batch": False}, skipped=(
            "the V1 trainer balances every step whatever trainer.balance_batch says (legacy-trainer runs only)")))
    elif rows_balanced(settings):
        out.append(AuditLayout("balance_batch=off", {"trainer.balance_batch": False}, skipped=(
            "the batch files hold the rows after the trainer's balancing (rldiag.rows_balanced): their order "
            "before it is not known")))
    else:
        out.append(AuditLayout("balance_batch=off", {"trainer.balance_batch": False}))
    return out


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def refusal(settings: Settings, rows: Sequence[int]) -> str | None:
    """Why verl would refuse the layout ``settings`` describe on steps of ``rows`` rows, or None.

    rldiag's own check first (``check_microbatch_settings``: sizes >= 1, the mini-batch a multiple
    of the DP size, as ``train_mini_batch`` asserts), then verl's assertions on the sizes, per
    worker with fixed micro-batches: a mini-batch no larger than the step (``ActorConfig.validate``:
    ``train_batch_size >= ppo_mini_batch_size``); each rank's share of a mini-batch (of the step,
    padded for V1, without mini-batches) a multiple of the micro-batch (``prepare_micro_batches``:
    "data size must be divisible by ... micro_batch_size_per_gpu"); and for the legacy trainer the
    step's rows a multiple of the DP size (``validate_config``: ``real_train_batch_size`` divisible
    by the GPUs; ``DataProto.chunk``)."""
    try:
        lay = batch_layout(settings)
    except RldiagError as exc:
        return str(exc)
    rows = [int(r) for r in rows if int(r) > 0]
    dp = lay.dp
    if not lay.v1 and dp > 1:
        bad = [r for r in rows if r % dp]
        if bad:
            return (f"a step of {bad[0]} rows does not split over {dp} DP ranks: the legacy trainer requires the "
                    f"batch to be divisible by the GPUs (verl's validate_config, DataProto.chunk)")
    roles = [("actor", lay.actor)] + ([("critic", lay.critic)] if uses_critic(settings) else [])
    for role, rl in roles:
        if rl.dynamic:
            continue
        if rl.mini is not None and rows and max(rows) < rl.mini:
            return (f"the {role}'s mini-batch of {rl.mini} rows is larger than a step ({max(rows)} rows): verl's "
                    "ActorConfig.validate requires train_batch_size >= ppo_mini_batch_size")
        if rl.micro is None:
            continue
        if rl.mini is not None:
            shares = [rl.mini // dp]
            where = f"its share of a mini-batch per rank ({rl.mini} rows / dp {dp} = {rl.mini // dp})"
        else:
            multiple = lay.pad_multiples[1] if lay.pad_seq_len else 1
            shares = sorted({_ceil_to(r, multiple) // dp for r in rows})
            where = f"its share of a step per rank ({', '.join(map(str, shares[:3]))} rows)"
        if any(s % rl.micro for s in shares):
            return (f"the {role}'s micro-batch of {rl.micro} rows does not divide {where}: verl's "
                    "prepare_micro_batches asserts that the data size is divisible by micro_batch_size_per_gpu")
    return None


def _pads(lay: BatchLayout, rows: Sequence[int]) -> bool:
    return bool(lay.pad_seq_len) and any(int(r) % lay.pad_multiples[1] for r in rows if int(r) > 0)


def plan_layouts(
    settings: Settings, rows: Sequence[int], resolve: Callable[[dict[str, Any]], Settings],
) -> list[AuditLayout]:
    """The candidate layouts of ``settings`` with what verl would refuse skipped and the
    duplicates folded: a layout whose resolved batch layout equals an earlier one's is named in
    that one's ``folded`` and dropped. ``rows``: the row count of each audited step;
    ``resolve(overrides)``: the settings of a layout (the run's, the audit's overrides, then these)."""
    kept: list[tuple[AuditLayout, BatchLayout]] = []
    out: list[AuditLayout] = []
    for cand in candidate_layouts(settings):
        if cand.skipped is not None:
            out.append(cand)
            continue
        try:
            s = resolve(cand.settings)
            lay = batch_layout(s)
        except RldiagError as exc:
            cand.skipped = str(exc)
            out.append(cand)
            continue
        same = next((k for k, other in kept if other == lay), None)
        if same is not None:
            same.folded.append(cand.name)
            continue
        if cand.name != OWN and (why_not := refusal(s, rows)) is not None:
            cand.skipped = why_not
            out.append(cand)
            continue
        cand.layout = describe_layout(lay)
        cand.padded = _pads(lay, rows)
        cand.dynamic = lay.actor.dynamic or (uses_critic(s) and lay.critic.dynamic)
        kept.append((cand, lay))
        out.append(cand)
    return out


# ---- the statistics -------------------------------------------------------------------------------


@dataclass
class MetricAudit:
    """One metric over the layouts.

    Attributes:
        metric: verl's name.
        layout_dependent: ``relative_spread > 1e-5``.
        relative_spread: the median over steps of ``(max - min over layouts) / (|own| + 1e-12)``
            (NaN: no step where the own layout has a value).
        values: layout -> the mean over steps.
        why: the aggregation that makes it layout-dependent (:func:`why`).
        combination: ``mean``, ``loss``, ``count`` or ``step`` (:data:`COMBINATIONS`).
        differs_in: the layouts whose values differ from the own layout's (median relative
            difference above the threshold).
        best_match: for a logged metric, the layout whose recompute is closest to the log (None:
            not logged, or no step to compare; layouts within 1e-5 of the smallest error are tied
            and the earlier one, ``own`` first, is named); best_match_error: its median relative error.
        logged_errors: layout -> the median relative error against the log.
    """

    metric: str
    layout_dependent: bool
    relative_spread: float
    values: dict[str, float]
    why: str
    combination: str
    differs_in: list[str] = field(default_factory=list)
    best_match: str | None = None
    best_match_error: float | None = None
    logged_errors: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "layout_dependent": self.layout_dependent,
                "relative_spread": self.relative_spread, "values": dict(self.values), "why": self.why,
                "best_match": self.best_match, "best_match_error": self.best_match_error,
                "combination": self.combination, "differs_in": list(self.differs_in),
                "logged_errors": dict(self.logged_errors)}


def _as_values(table: Any) -> dict[int, dict[str, float]]:
    """A layout's metrics, step -> metric -> value, from ``{step: {...}}``, a list of rows with
    ``step`` or a polars frame (one row per step)."""
    if hasattr(table, "to_dicts"):
        table = table.to_dicts()
    if isinstance(table, Mapping):
        items = [(int(s), row) for s, row in table.items()]
    else:
        items = [(int(row["step"]), row) for row in table]
    return {s: {k: float(v) for k, v in row.items() if k != "step" and v is not None} for s, row in items}


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _at(table: Mapping[int, Mapping[str, float]], step: int, metric: str) -> float:
    """The value of ``metric`` at ``step``; NaN where there is none."""
    v = table.get(step, {}).get(metric)
    return math.nan if v is None else float(v)


def _median(xs: list[float]) -> float:
    return float(np.median(np.asarray(xs, dtype=np.float64))) if xs else math.nan


def audit_metrics(
    per_layout: Mapping[str, Any], logged: Mapping[int, Mapping[str, float]] | None = None,
    ctx: WhyContext | None = None, own: str = OWN,
) -> list[MetricAudit]:
    """Every metric of the layouts' tables ``per_layout`` (layout -> its metrics: ``{step: {name:
    value}}``, rows with ``step``, or a polars frame), in name order, measured against ``own``
    (the first layout when absent); ``logged``: ``{step: {name: value}}`` of ``metrics.jsonl``
    for each metric's ``best_match``. Pure."""
    tables = {name: _as_values(t) for name, t in per_layout.items()}
    if not tables:
        return []
    own = own if own in tables else next(iter(tables))
    ctx = ctx or WhyContext()
    logged = logged or {}
    names = sorted({m for t in tables.values() for row in t.values() for m in row})
    base = tables[own]
    out = []
    for metric in names:
        spreads: list[float] = []
        diffs: dict[str, list[float]] = {name: [] for name in tables if name != own}
        for step in base:
            ref = _at(base, step, metric)
            if not math.isfinite(ref):
                continue
            vals = [v for t in tables.values() if math.isfinite(v := _at(t, step, metric))]
            spreads.append((max(vals) - min(vals)) / (abs(ref) + EPS))
            for name in diffs:
                if math.isfinite(v := _at(tables[name], step, metric)):
                    diffs[name].append(abs(v - ref) / (abs(ref) + EPS))
        spread = _median(spreads)
        differs = [name for name, d in diffs.items() if d and _median(d) > DEPENDENT_ABOVE]
        values = {}
        for name, t in tables.items():
            xs = [v for step in t if math.isfinite(v := _at(t, step, metric))]
            values[name] = float(np.mean(xs)) if xs else math.nan
        errors: dict[str, float] = {}
        for name, t in tables.items():
            errs = []
            for step in logged:
                want, got = _at(logged, step, metric), _at(t, step, metric)
                if math.isfinite(want) and math.isfinite(got):
                    errs.append(abs(got - want) / (abs(want) + EPS))
            if errs:
                errors[name] = _median(errs)
        # layouts within the dependence threshold of the smallest error are tied: the earlier wins (own first)
        least = min(errors.values()) if errors else math.nan
        best = next((n for n, e in errors.items() if e <= least + DEPENDENT_ABOVE), None)
        dependent = _finite(spread) and spread > DEPENDENT_ABOVE
        out.append(MetricAudit(
            metric=metric, layout_dependent=dependent, relative_spread=spread, values=values,
            why=why(metric, ctx, differs), combination=combination(metric), differs_in=differs, best_match=best,
            best_match_error=errors[best] if best is not None else None, logged_errors=errors))
    return out


# ---- the result -----------------------------------------------------------------------------------


@dataclass
class LayoutAuditResult:
    """The layout audit of one run (``rldiag layout-audit``): ``to_dict()`` is its ``--json``."""

    run: str
    path: Path | RemotePath | None  # RUN/rldiag/sweeps/layout-audit/
    layouts: list[AuditLayout]
    metrics: list[MetricAudit]
    steps: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def dependent(self) -> list[MetricAudit]:
        """The layout-dependent metrics, largest spread first."""
        return sorted((m for m in self.metrics if m.layout_dependent), key=lambda m: -m.relative_spread)

    @property
    def skipped(self) -> list[AuditLayout]:
        return [x for x in self.layouts if not x.runs]

    @property
    def ran(self) -> list[AuditLayout]:
        return [x for x in self.layouts if x.runs]

    def metric(self, name: str) -> MetricAudit:
        for m in self.metrics:
            if m.metric == name:
                return m
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return json_safe({"layouts": [x.to_dict() for x in self.layouts], "metrics": [m.to_dict() for m in self.metrics]})

    def metrics_frame(self) -> pl.DataFrame:
        """One row per metric: ``metric``, ``layout_dependent``, ``relative_spread``,
        ``best_match``, ``best_match_error``, ``combination``, ``why``, and the mean over steps
        under each layout that ran (one column per layout)."""
        from rldiag.io.arrays import rows_frame

        names = [x.name for x in self.ran]
        cols = ["metric", "layout_dependent", "relative_spread", "best_match", "best_match_error", "combination",
                "why", *names]
        rows = [{"metric": m.metric, "layout_dependent": m.layout_dependent, "relative_spread": m.relative_spread,
                 "best_match": m.best_match, "best_match_error": m.best_match_error, "combination": m.combination,
                 "why": m.why, **{n: m.values.get(n) for n in names}} for m in self.metrics]
        return rows_frame(rows, cols)

    def layouts_frame(self) -> pl.DataFrame:
        """One row per layout: ``name``, ``skipped`` (the reason, or null), ``folded``, ``layout``,
        ``settings`` (as text), ``steps_failed`` (a count)."""
        from rldiag.io.arrays import rows_frame

        rows = [{"name": x.name, "skipped": x.skipped, "folded": ", ".join(x.folded), "layout": x.layout,
                 "settings": ", ".join(f"{k}={v}" for k, v in x.settings.items()), "steps_failed": len(x.steps_failed)}
                for x in self.layouts]
        return rows_frame(rows, ["name", "skipped", "folded", "layout", "settings", "steps_failed"])


# ---- the run --------------------------------------------------------------------------------------


@dataclass
class LayoutRun:
    """What one layout's recompute gave: ``{step: {metric: value}}`` and the failed steps."""

    metrics: dict[int, dict[str, float]]
    steps_failed: dict[int, str]


def run_layouts(
    run: Path | RemotePath, scenarios: Mapping[str, Mapping[str, Any]], target: LayoutAuditLayout,
    steps: Steps, device: str, progress: ProgressFn | None,
) -> dict[str, LayoutRun]:
    """Recompute ``run`` once per layout (``scenarios``: name -> overrides, the run's settings
    under them) into ``target.scenario(name)``, unchanged steps reused. The one place the audit
    recomputes: ``rldiag.sweep`` (one read of each step for every layout) replaces this body."""
    from rldiag.scenario.recompute import recompute

    out: dict[str, LayoutRun] = {}
    count = len(parse_steps(steps, [sf.step for sf in RunDir(run).require_steps()]))
    total = count * len(scenarios)
    for i, (name, overrides) in enumerate(scenarios.items()):
        def update(done: int, _total: int, step: int, name: str = name, offset: int = i * count) -> None:
            if progress is not None:
                progress(offset + done, total, f"{name}: step {step}")

        rep = recompute(run, dict(overrides), name=name, steps=steps, device=device, progress=update,
                        target=target.scenario(name))
        out[name] = LayoutRun({int(r["step"]): {k: v for k, v in r.items() if k != "step"} for r in rep.metrics},
                              dict(rep.steps_failed))
    return out


def _write(target: LayoutAuditLayout, result: LayoutAuditResult, overrides: Mapping[str, Any]) -> None:
    """``metrics.parquet`` then ``audit.json``, staged (:mod:`rldiag.io.staged`); the layouts'
    scenario directories beside them were each written whole by their recompute."""
    import pyarrow as pa

    from rldiag.io.arrays import floats_or_null
    from rldiag.io.staged import open_staged
    from rldiag.version import __version__

    names = [x.name for x in result.ran]
    cols: dict[str, Any] = {
        "metric": pa.array([m.metric for m in result.metrics], pa.string()),
        "layout_dependent": pa.array([m.layout_dependent for m in result.metrics], pa.bool_()),
        "relative_spread": floats_or_null([m.relative_spread for m in result.metrics]),
        "best_match": pa.array([m.best_match for m in result.metrics], pa.string()),
        "combination": pa.array([m.combination for m in result.metrics], pa.string()),
        "why": pa.array([m.why for m in result.metrics], pa.string()),
    }
    for n in names:
        cols[n] = floats_or_null([m.values.get(n) for m in result.metrics])
    writer = open_staged(target.dir, marker=target.META, replace=False)
    try:
        writer.write_table(target.METRICS, pa.table(cols))
        writer.commit({**result.to_dict(), "run": result.run, "overrides": dict(overrides), "steps": result.steps,
                       "rldiag_version": __version__, "seconds": round(result.seconds, 3)})
    except BaseException:
        writer.abort()
        raise


def layout_audit(
    run: str | Path | RemotePath, overrides: Mapping[str, Any] | None = None, *, steps: Steps = None,
    device: str = "cpu", progress: ProgressFn | None = None,
) -> LayoutAuditResult:
    """Audit ``run`` (its settings plus ``overrides``) over the layouts of :func:`candidate_layouts`
    on ``steps`` (a ``--steps`` spec), write ``RUN/rldiag/sweeps/layout-audit/`` and return the
    result. ``progress(done, total, what)`` counts layouts x steps. Raises :class:`RldiagError`
    when the run cannot be recomputed under its own settings."""
    from rldiag.analysis.logged import logged_metrics
    from rldiag.io.loader import row_count
    from rldiag.scenario.plan import check_settings

    t0 = time.perf_counter()
    rd = RunDir(run)
    overrides = dict(overrides or {})
    settings = resolve_settings(rd.path, overrides)
    check_settings(settings)
    files = {sf.step: sf for sf in rd.require_steps()}
    chosen = parse_steps(steps, sorted(files))
    rows = [row_count(files[s]) for s in chosen]
    layouts = plan_layouts(settings, rows, lambda extra: resolve_settings(rd.path, {**overrides, **extra}))
    target = rd.layout.layout_audit
    ran = run_layouts(rd.path, {x.name: {**overrides, **x.settings} for x in layouts if x.runs}, target,
                      chosen if steps is not None else None, device, progress)
    for x in layouts:
        got = ran.get(x.name)
        if got is None:
            continue
        x.steps_failed = dict(got.steps_failed)
        if not got.metrics and x.name != OWN:
            first = next(iter(got.steps_failed.values()), "no step was recomputed")
            x.skipped = f"verl raises on every step: {first}"
    tables = {x.name: ran[x.name].metrics for x in layouts if x.runs}
    logged = {s: v for s, v in logged_metrics(rd.metrics_file).items() if s in set(chosen)}
    metrics = audit_metrics(tables, logged, WhyContext.of(settings, layouts))
    result = LayoutAuditResult(run=str(rd.path), path=target.dir, layouts=layouts, metrics=metrics, steps=chosen)
    result.seconds = time.perf_counter() - t0
    _write(target, result, overrides)
    return result


__all__ = [
    "COMBINATIONS", "DEPENDENT_ABOVE", "OWN", "AuditLayout", "LayoutAuditResult", "LayoutRun", "MetricAudit",
    "WhyContext", "audit_metrics", "candidate_layouts", "combination", "layout_audit", "plan_layouts", "refusal",
    "run_layouts", "why",
]
