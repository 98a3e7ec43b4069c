"""One code path from a rule list to its outcome, shared by the batch doctor
(:func:`rldiag.doctor.doctor.diagnose`) and the live one (:class:`rldiag.doctor.live.LiveDoctor`):
each rule is *not applicable* (its ``when`` fails), *not evaluated* (a :class:`Skip`), passed, or
gives one finding or several (a rule naming causes)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from rldiag.doctor import rules as _rules  # noqa: F401  (registers every rule kind, mismatch included)
from rldiag.doctor.evaluators import RULE_KINDS, Context, Finding, Passed, Series, Skip
from rldiag.doctor.rule import Rule
from rldiag.doctor.signals import SignalTable

#: findings are listed most severe first
SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}


@dataclass
class RuleResults:
    """What a rule list gave: ``findings`` (most severe first), and by rule id what passed
    (what was seen), what was not evaluated (why) and what does not apply (the ``when`` settings)."""

    findings: list[Finding] = field(default_factory=list)
    passed: dict[str, str] = field(default_factory=dict)
    not_evaluated: dict[str, str] = field(default_factory=dict)
    not_applicable: dict[str, str] = field(default_factory=dict)


def not_applicable(rule: Rule, settings: Mapping[str, Any]) -> str | None:
    """The settings behind the ``when`` that fails for ``rule`` (None when the rule applies)."""
    if rule.applies(settings):
        return None
    return ", ".join(f"{k}={settings.get(k)!r}" for k in rule.when)


def evaluate_rules(rules: list[Rule], table: SignalTable, settings: Mapping[str, Any], run: Any = None,
                   engine_settings: Any = None) -> RuleResults:
    """Every rule of ``rules`` over ``table`` under ``settings`` (the run's keys with the derived
    ones resolved). A rule with a ``window`` reads only the tail of its series that the window
    covers (:meth:`SignalTable.series`, ``tail``); one with a ``warmup`` of N none of the run's
    first N steps (counted from the table's first step, :func:`after_warmup`). ``run`` / ``engine_settings``: the
    :class:`~rldiag.io.rundir.RunDir` and resolved Settings, for a rule that reads example
    tokens back from the batch files (``rollout_mismatch``)."""
    out = RuleResults()
    for rule in rules:
        why_not = not_applicable(rule, settings)
        if why_not is not None:
            out.not_applicable[rule.id] = why_not
            continue
        series: Callable[[str, str], Series | None] = (
            partial(table.series, tail=rule.window) if rule.window is not None else table.series)
        if rule.warmup and table.first_step is not None:
            series = after_warmup(series, table.first_step + rule.warmup)
        ctx = Context(settings=settings, series=series, run=run, engine_settings=engine_settings)
        outcome = RULE_KINDS.get(rule.kind)(rule, ctx)
        if isinstance(outcome, list):
            out.findings.extend(outcome)
        elif isinstance(outcome, Finding):
            out.findings.append(outcome)
        elif isinstance(outcome, Skip):
            out.not_evaluated[rule.id] = outcome.reason
        elif isinstance(outcome, Passed):
            out.passed[rule.id] = outcome.detail
    for f in out.findings:
        add_band(f, settings)
        add_calibration(f)
        if f.evidence.state is None:  # a rule without a series (settings): as long as the run goes
            f.evidence.state, f.evidence.state_since = "ongoing", table.first_step
    out.findings.sort(key=lambda f: SEVERITY_ORDER.get(f.severity, 3))
    return out


def after_warmup(series: Callable[[str, str], Series | None], first: int) -> Callable[[str, str], Series | None]:
    """``series`` without the steps before ``first`` (a rule's ``warmup``: the run's first steps
    are not read; a series with no step left is None, as one never given)."""

    def cut(name: str, source: str) -> Series | None:
        s = series(name, source)
        if s is None:
            return None
        keep = s.steps >= first
        return Series(s.name, s.steps[keep], s.values[keep], s.source) if keep.any() else None

    return cut


def add_band(finding: Finding, settings: Mapping[str, Any]) -> None:
    """Set ``finding.evidence.band``: where the mean of its evidence values sits in its metric's
    reference bands (:func:`rldiag.doctor.bands.place`), when the metric has a band."""
    from rldiag.doctor.bands import bands_for, place  # here: `python -m rldiag.doctor.bands` runs it as __main__

    ev = finding.evidence
    if ev.metric is None or not ev.values or not bands_for(ev.metric):
        return
    ev.band = {**place(ev.metric, sum(ev.values) / len(ev.values), settings),
               "statistic": "mean of the evidence values"}


def add_calibration(finding: Finding) -> None:
    """Set ``finding.evidence.calibration``: the shipped calibration's figures for its rule and
    cause (:func:`rldiag.doctor.calibration.calibration_for`; a rule without them says so)."""
    from rldiag.doctor.calibration import calibration_for

    finding.evidence.calibration = calibration_for(finding.rule, finding.evidence.cause)
