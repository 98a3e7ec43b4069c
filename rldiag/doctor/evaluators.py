"""Rule kinds: a small registry of evaluators, ``fn(rule, ctx) -> Finding | Skip | Passed``.

- ``threshold``: a metric against ``above`` and/or ``below`` over a window of steps; ``stat``
  ``each`` fires when at least ``min_fraction`` of the window's steps are outside, ``mean`` /
  ``median`` / ``max`` / ``min`` / ``last`` when that statistic of the window is; ``abs``
  compares absolute values.
- ``trend``: the mean of the last ``segment`` of the window against the mean of its first
  (``direction`` ``rising``: late >= ``ratio`` x early, late >= ``min_late`` and a positive
  least-squares slope; ``falling``: late <= ``ratio`` x early, early >= ``min_early``, negative
  slope).
- ``settings``: fires when every setting of ``match`` has the given value.

Every finding carries its evidence: the steps and values behind it, the window's statistics and
its trend (slope per step, early and late means).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rldiag.doctor.rule import Rule
from rldiag.doctor.state import sparkline, trend_state
from rldiag.errors import RldiagError
from rldiag.registry import Entry, Registry

#: At most this many (step, value) pairs are listed in a finding's evidence.
MAX_EVIDENCE = 20


@dataclass
class Series:
    """One metric over steps, from the logs, the recompute, or both (logged wins per step)."""

    name: str
    steps: np.ndarray  # int64, increasing
    values: np.ndarray  # float64
    source: str  # "logged", "recomputed" or "logged+recomputed"


@dataclass
class Evidence:
    metric: str | None = None
    source: str | None = None
    window: list[int] = field(default_factory=list)  # [first step, last step] looked at
    steps: list[int] = field(default_factory=list)  # the steps behind the finding
    values: list[float] = field(default_factory=list)  # their values
    statistic: str = ""  # what was compared, in words
    trend: dict[str, float] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    # a rule that names causes (rollout_mismatch): which one, how sure, and what backs it
    cause: str | None = None
    confidence: float | None = None
    details: dict[str, Any] = field(default_factory=dict)
    # where the mean of ``values`` sits in the metric's reference bands (rldiag/doctor/bands.py);
    # None when the metric has no band
    band: dict[str, Any] | None = None
    # what the calibration corpus measured of this rule (and cause): rldiag/doctor/calibration.py
    calibration: dict[str, Any] | None = None
    # the trend state (rldiag/doctor/state.py): ongoing | resolved | worsening | improving, the step
    # it began, and the series it was read from with the rule's threshold (the Health page's sparkline)
    state: str | None = None
    state_since: int | None = None
    sparkline: dict[str, Any] | None = None


@dataclass
class Finding:
    rule: str
    title: str
    severity: str
    why: str
    message: str  # one line: what was seen
    evidence: Evidence
    remedy: str = ""  # what to do about it, where the rule knows more than its why
    counterfactual: list[dict[str, Any]] = field(default_factory=list)  # what the addressing settings change on the window's batches


@dataclass
class Skip:
    reason: str


@dataclass
class Passed:
    detail: str


#: a rule gives one finding, or (a rule naming causes) several
Outcome = Finding | list[Finding] | Skip | Passed


@dataclass
class Context:
    settings: Mapping[str, Any]
    series: Callable[[str, str], Series | None]  # (metric, source) -> series or None
    run: Any = None  # the RunDir, for a rule that reads example tokens back from the batch files
    engine_settings: Any = None  # the resolved Settings the batches are loaded under


Evaluator = Callable[[Rule, Context], Outcome]
@dataclass(frozen=True)
class RuleKindMeta(Entry):
    """A rule kind's registration: the keys a rule of this kind ``required`` and may set
    (``params``); ``check``, rule -> a problem with its parameters or None; ``min_steps``, the
    steps of data it needs by default; ``reads``, rule -> every metric name the rule may ask
    ``ctx.series`` for, whatever the data (None: not declared; a live doctor then keeps every
    metric, :func:`metrics_read`)."""

    required: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    check: Callable[[Rule], str | None] | None = None
    min_steps: int = 1
    reads: Callable[[Rule], set[str]] | None = None


RULE_KINDS: Registry[Evaluator] = Registry("doctor rule kind", meta=RuleKindMeta)


def own_metric(rule: Rule) -> set[str]:
    """``reads`` of a kind whose rules read their own ``metric`` alone."""
    return {rule.metric} if rule.metric is not None else set()


def metrics_read(rules: Iterable[Rule]) -> set[str] | None:
    """Every metric name ``rules`` may read (the union of their kinds' ``reads``); None when a
    kind does not declare it (a kind registered elsewhere): then any metric may be read."""
    out: set[str] = set()
    for rule in rules:
        try:
            reads = RULE_KINDS.meta(rule.kind).reads
        except (KeyError, RldiagError):  # not registered (the evaluation says so) or without its record
            return None
        if reads is None:
            return None
        out |= reads(rule)
    return out


# ---- helpers ----------------------------------------------------------------------------------


def _window(rule: Rule, ctx: Context) -> Series | Skip:
    # a rule read from a file has its kind's required metric; one built in code may lack it
    s = ctx.series(rule.metric, rule.source) if rule.metric is not None else None
    if s is None:
        return Skip(f"{rule.metric} is neither logged nor recomputed for this run")
    keep = np.isfinite(s.values)
    steps, values = s.steps[keep], s.values[keep]
    if rule.window is not None:
        steps, values = steps[-rule.window:], values[-rule.window:]
    if len(values) < rule.min_steps:
        return Skip(f"{rule.metric}: {len(values)} step(s) with a value, the rule needs {rule.min_steps}")
    if rule.params.get("abs"):
        values = np.abs(values)
    return Series(s.name, steps, values, s.source)


def trend_stats(steps: np.ndarray, values: np.ndarray, segment: float = 1 / 3) -> dict[str, float]:
    """Slope per step (least squares), early / late means (first and last ``segment``), first
    and last value."""
    n = len(values)
    k = max(1, int(round(n * segment)))
    slope = float(np.polyfit(steps.astype(np.float64), values, 1)[0]) if n >= 2 and np.ptp(steps) > 0 else 0.0
    return {"slope_per_step": slope, "early_mean": float(values[:k].mean()), "late_mean": float(values[-k:].mean()),
            "first": float(values[0]), "last": float(values[-1]), "steps": n}


def _evidence(rule: Rule, w: Series, steps: np.ndarray, values: np.ndarray, statistic: str,
              outside: np.ndarray, worse_up: bool, threshold: float | None) -> Evidence:
    """The finding's evidence; ``outside`` (per step of the window: on the unhealthy side of
    ``threshold``) and ``worse_up`` decide its trend state (:func:`rldiag.doctor.state.trend_state`)."""
    state, since = trend_state(w.steps, w.values, outside, worse_up, threshold)
    spark = sparkline(w.steps, w.values, threshold, "above" if worse_up else "below", _label(rule))
    if len(steps) > MAX_EVIDENCE:  # the most extreme ones
        order = np.argsort(-np.abs(values - np.median(w.values)), kind="stable")[:MAX_EVIDENCE]
        order.sort()
        steps, values = steps[order], values[order]
    return Evidence(metric=rule.metric, source=w.source, window=[int(w.steps[0]), int(w.steps[-1])],
                    steps=[int(s) for s in steps], values=[float(v) for v in values], statistic=statistic,
                    trend=trend_stats(w.steps, w.values, rule.params.get("segment", 1 / 3)),
                    state=state, state_since=since, sparkline=spark)


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def _label(rule: Rule) -> str:
    return f"|{rule.metric}|" if rule.params.get("abs") else str(rule.metric)


# ---- threshold --------------------------------------------------------------------------------

STATS: dict[str, Callable[[np.ndarray], Any]] = {
    "mean": np.mean, "median": np.median, "max": np.max, "min": np.min, "last": lambda v: v[-1],
}


def _check_threshold(rule: Rule) -> str | None:
    p = rule.params
    if p.get("above") is None and p.get("below") is None:
        return "kind threshold needs 'above' and/or 'below'"
    for k in ("above", "below"):
        if p.get(k) is not None and (isinstance(p[k], bool) or not isinstance(p[k], (int, float))):
            return f"'{k}' must be a number"
    stat = p.get("stat", "each")
    if stat != "each" and stat not in STATS:
        return f"'stat' must be each, {', '.join(STATS)}; got {stat!r}"
    mf = p.get("min_fraction", 0.5)
    if isinstance(mf, bool) or not isinstance(mf, (int, float)) or not 0 < mf <= 1:
        return f"'min_fraction' must be in (0, 1], got {mf!r}"
    return None


@RULE_KINDS.register("threshold", required=("metric",), params=("above", "below", "abs", "stat", "min_fraction"),
                     check=_check_threshold, reads=own_metric)
def threshold(rule: Rule, ctx: Context) -> Outcome:
    w = _window(rule, ctx)
    if isinstance(w, Skip):
        return w
    p = rule.params
    above, below = p.get("above"), p.get("below")

    def outside(v: np.ndarray) -> np.ndarray:
        bad = np.zeros(v.shape, dtype=bool)
        if above is not None:
            bad |= v > above
        if below is not None:
            bad |= v < below
        return bad

    bound = " or ".join(x for x in (f"> {_fmt(above)}" if above is not None else "",
                                    f"< {_fmt(below)}" if below is not None else "") if x)
    stat = p.get("stat", "each")
    span = f"steps {w.steps[0]}..{w.steps[-1]}"
    # which side is worse: the one the rule names, or with both the one the window's mean is on
    worse_up = below is None or (above is not None and float(np.mean(w.values)) > above)
    state_args = (outside(w.values), worse_up, above if worse_up else below)
    if stat == "each":
        bad = outside(w.values)
        frac = float(bad.mean())
        need = float(p.get("min_fraction", 0.5))
        text = f"{_label(rule)} {bound} at {int(bad.sum())} of {len(bad)} steps ({span}; rule fires at {need:.0%})"
        if bad.any() and frac >= need:
            ev = _evidence(rule, w, w.steps[bad], w.values[bad], text, *state_args)
            return Finding(rule.id, rule.title, rule.severity, rule.why, text, ev)
        return Passed(text)
    value = float(STATS[stat](w.values))
    text = f"{stat} of {_label(rule)} over {span} = {_fmt(value)} (rule: {bound})"
    if outside(np.array([value]))[0]:
        return Finding(rule.id, rule.title, rule.severity, rule.why, text,
                       _evidence(rule, w, w.steps, w.values, text, *state_args))
    return Passed(text)


# ---- trend ------------------------------------------------------------------------------------


def _check_trend(rule: Rule) -> str | None:
    p = rule.params
    if p.get("direction") not in ("rising", "falling"):
        return f"'direction' must be rising or falling, got {p.get('direction')!r}"
    for k in ("ratio", "min_early", "min_late"):
        v = p.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            return f"'{k}' must be a number"
    if p.get("ratio") is None or not p["ratio"] > 0:
        return "'ratio' (late mean / early mean) must be a number > 0"
    seg = p.get("segment", 1 / 3)
    if isinstance(seg, bool) or not isinstance(seg, (int, float)) or not 0 < seg <= 0.5:
        return f"'segment' must be in (0, 0.5], got {seg!r}"
    return None


@RULE_KINDS.register("trend", required=("metric", "direction", "ratio"),
                     params=("abs", "min_early", "min_late", "segment"), check=_check_trend, min_steps=6,
                     reads=own_metric)
def trend(rule: Rule, ctx: Context) -> Outcome:
    w = _window(rule, ctx)
    if isinstance(w, Skip):
        return w
    p = rule.params
    t = trend_stats(w.steps, w.values, p.get("segment", 1 / 3))
    early, late, slope, ratio = t["early_mean"], t["late_mean"], t["slope_per_step"], float(p["ratio"])
    text = (f"{_label(rule)} early mean {_fmt(early)} -> late mean {_fmt(late)} over steps {w.steps[0]}..{w.steps[-1]} "
            f"(slope {_fmt(slope)}/step)")
    if p["direction"] == "rising":
        fires = late > early and late >= ratio * early and late >= float(p.get("min_late", 0.0)) and slope > 0
        rule_text = f"rule: late >= {_fmt(ratio)} x early and >= {_fmt(float(p.get('min_late', 0.0)))}"
    else:
        fires = late < early and late <= ratio * early and early >= float(p.get("min_early", 0.0)) and slope < 0
        rule_text = f"rule: late <= {_fmt(ratio)} x early, early >= {_fmt(float(p.get('min_early', 0.0)))}"
    text = f"{text}; {rule_text}"
    if fires:
        # a step is outside where it is past the level the rule compares the late mean with
        if p["direction"] == "rising":
            level = max(ratio * early, float(p.get("min_late", 0.0)))
            state_args = (w.values >= level, True, level)
        else:
            level = ratio * early
            state_args = (w.values <= level, False, level)
        return Finding(rule.id, rule.title, rule.severity, rule.why, text,
                       _evidence(rule, w, w.steps, w.values, text, *state_args))
    return Passed(text)


# ---- settings ---------------------------------------------------------------------------------


def _check_settings(rule: Rule) -> str | None:
    m = rule.params.get("match")
    if not isinstance(m, Mapping) or not m:
        return "kind settings needs 'match': a mapping of settings to values"
    return None


@RULE_KINDS.register("settings", required=("match",), check=_check_settings, min_steps=1,
                     reads=lambda rule: set())
def settings_rule(rule: Rule, ctx: Context) -> Outcome:
    match = dict(rule.params["match"])
    probe = Rule(id=rule.id, kind=rule.kind, title=rule.title, why=rule.why, when=match)
    seen = {k: ctx.settings.get(k) for k in match}
    text = ", ".join(f"{k}={_show(v)}" for k, v in seen.items())
    if probe.applies(ctx.settings):
        return Finding(rule.id, rule.title, rule.severity, rule.why, text,
                       Evidence(statistic=text, settings=seen))
    return Passed(text)


def _show(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float) and math.isfinite(v):
        return _fmt(v)
    return str(v)
