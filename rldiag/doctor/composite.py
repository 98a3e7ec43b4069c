"""Rule kind ``while``: a trend that holds *while* a second condition holds over the same steps.

The rule's own keys are a ``trend``'s (``metric``, ``direction``, ``ratio``, ``min_early``,
``min_late``, ``segment``, ``abs``); ``while`` is a mapping that is a second rule of kind
``trend`` (the default) or ``threshold``, with its ``metric``, its ``source`` (default ``any``)
and its kind's keys. The second rule is evaluated over the steps of the first one's window only
(from its first to its last step), so "the score rises while the length runs away" compares
the two over one span. The finding carries the first rule's evidence, the second's under
``details["while"]``.

The reward-hacking rules are of this kind: a rising score is what the policy is paid for, and
what it is paid with (length, reference KL, one component, the diversity of a group) shows in
the second metric.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any

from rldiag.doctor.evaluators import RULE_KINDS, Context, Finding, Outcome, Passed, Series, Skip, own_metric, trend
from rldiag.doctor.rule import Rule

#: the kinds a ``while`` condition may have
SECOND_KINDS = ("trend", "threshold")
_TREND_PARAMS = ("direction", "ratio", "abs", "min_early", "min_late", "segment")


def _second(rule: Rule) -> Rule | str:
    """The ``while`` condition as a rule of its own (same id), or what is wrong with it."""
    raw = rule.params.get("while")
    if not isinstance(raw, Mapping):
        return "'while' must be a mapping: a trend or threshold condition with its metric"
    kind = raw.get("kind", "trend")
    if kind not in SECOND_KINDS:
        return f"'while.kind' must be one of {', '.join(SECOND_KINDS)}, got {kind!r}"
    meta = RULE_KINDS.meta(kind)
    allowed = {"kind", "metric", "source", "min_steps"} | set(meta.params) | set(meta.required)
    unknown = sorted(set(raw) - allowed)
    if unknown:
        return f"unknown key(s) {', '.join(unknown)} under 'while' (kind {kind}); valid: {', '.join(sorted(allowed))}"
    if not isinstance(raw.get("metric"), str):
        return "'while' needs 'metric'"
    source = raw.get("source", "any")
    if source not in ("any", "logged", "recomputed"):
        return f"'while.source' must be any, logged or recomputed, got {source!r}"
    min_steps = raw.get("min_steps", meta.min_steps)
    if isinstance(min_steps, bool) or not isinstance(min_steps, int) or min_steps < 1:
        return f"'while.min_steps' must be a positive integer, got {min_steps!r}"
    params = {k: v for k, v in raw.items() if k not in ("kind", "metric", "source", "min_steps")}
    return Rule(id=rule.id, kind=kind, title=rule.title, why=rule.why, severity=rule.severity, metric=raw["metric"],
                source=source, min_steps=min_steps, params=params)


def _as_trend(rule: Rule) -> Rule:
    return replace(rule, kind="trend", params={k: v for k, v in rule.params.items() if k in _TREND_PARAMS})


def _check(rule: Rule) -> str | None:
    meta = RULE_KINDS.meta("trend")
    problem = meta.check(_as_trend(rule)) if meta.check is not None else None
    if problem:
        return problem
    second = _second(rule)
    if isinstance(second, str):
        return second
    check = RULE_KINDS.meta(second.kind).check
    problem = check(second) if check is not None else None
    return f"under 'while': {problem}" if problem else None


def _within(ctx: Context, lo: int, hi: int) -> Context:
    """``ctx`` with every series cut to the steps ``lo..hi``."""

    def series(name: str, source: str) -> Series | None:
        s = ctx.series(name, source)
        if s is None:
            return None
        keep = (s.steps >= lo) & (s.steps <= hi)
        return Series(s.name, s.steps[keep], s.values[keep], s.source) if keep.any() else None

    return replace(ctx, series=series)


def _reads(rule: Rule) -> set[str]:
    """The rule's own metric and its ``while`` condition's."""
    second = _second(rule)
    return own_metric(rule) | (own_metric(second) if isinstance(second, Rule) else set())


@RULE_KINDS.register("while", required=("metric", "direction", "ratio", "while"),
                     params=("abs", "min_early", "min_late", "segment"), check=_check, min_steps=6, reads=_reads)
def while_rule(rule: Rule, ctx: Context) -> Outcome:
    first = trend(_as_trend(rule), ctx)
    if not isinstance(first, Finding):
        return first
    second = _second(rule)
    assert isinstance(second, Rule)  # checked when the rule was loaded
    lo, hi = first.evidence.window
    other = RULE_KINDS.get(second.kind)(second, _within(ctx, lo, hi))
    if isinstance(other, Skip):
        return Skip(f"{first.message}; but {other.reason} (steps {lo}..{hi})")
    if isinstance(other, Passed):
        return Passed(f"{first.message}; but not while {other.detail}")
    assert isinstance(other, Finding)  # trend and threshold give one finding
    details: dict[str, Any] = {**first.evidence.details, "while": asdict(other.evidence)}
    evidence = replace(first.evidence, details=details)
    return Finding(rule.id, rule.title, rule.severity, rule.why, f"{first.message}; while {other.message}", evidence)
