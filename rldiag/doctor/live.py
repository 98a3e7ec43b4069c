"""Incremental rule evaluation: the doctor of a run that is still training.

:class:`LiveDoctor` holds the run's signals so far (a :class:`~rldiag.doctor.signals.SignalTable`
that grows by one step at a time) and, on each :meth:`LiveDoctor.evaluate`, runs the same rule
path as ``rldiag doctor`` (:func:`rldiag.doctor.evaluate.evaluate_rules`) and turns the difference
from the previous evaluation into :class:`HealthEvent` s. ``rldiag doctor --follow``
(:mod:`rldiag.doctor.follow`) and the capture hook both stand on it; it does no I/O of its own
(with ``run`` given, a rule naming causes reads example tokens back from the batch files for the
findings an event reports).

A finding is identified by its ``rule`` plus ``evidence.cause`` (``rollout_mismatch`` gives one
finding per cause; other rules have none). Between two evaluations an identity

- ``fired``: holds now and did not before;
- ``changed``: holds in both, and its severity or its trend state (``evidence.state``:
  ongoing, resolved, worsening, improving; :mod:`rldiag.doctor.state`) differs from the one last
  reported, or its ``evidence.confidence`` moved by at least :data:`CONFIDENCE_STEP` from the one last reported;
  its counterfactual arriving (:meth:`LiveDoctor.attach_counterfactual`) is a change too. The
  message is not compared: a threshold rule's message counts steps and changes every step;
  a ``resolved`` finding still holds (its rule still fires): a change, never a clear;
- ``cleared``: held before and not now (passed, or not evaluated any more); its ``step`` is the
  first evaluated step at which it no longer holds, its finding the last one that held.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from rldiag.doctor.evaluate import RuleResults, evaluate_rules
from rldiag.doctor.evaluators import Finding, metrics_read
from rldiag.doctor.rule import Rule
from rldiag.doctor.rules import load_rules
from rldiag.doctor.signals import SignalTable
from rldiag.errors import RldiagError
from rldiag.io.outputs import json_safe

#: a cause's confidence must move by this much (from the value last reported) to count as a change
CONFIDENCE_STEP = 0.1
#: ``levels()``: a rule's level by the severity of its worst active finding (info counts as ok)
LEVELS = {"info": 0, "warning": 1, "critical": 2}
EVENTS = ("fired", "changed", "cleared")

#: a finding's identity: ``(rule, evidence.cause)``, the cause None for rules that name none
Identity = tuple[str, str | None]


class LiveDoctorError(RldiagError):
    """A live doctor was asked about a finding it does not hold."""


def identity(finding: Finding) -> Identity:
    return finding.rule, finding.evidence.cause


def finding_dict(finding: Finding) -> dict[str, Any]:
    """A finding as ``rldiag doctor --json`` prints it (:meth:`DoctorReport.to_dict`)."""
    return json_safe(asdict(finding))


@dataclass
class HealthEvent:
    """One change of a finding: ``event`` (``fired`` | ``changed`` | ``cleared``), the ``step``
    it happened at, and the finding (for ``cleared``, the last one that held)."""

    event: str
    step: int
    finding: Finding

    def to_dict(self) -> dict[str, Any]:
        """``{"event": ..., "step": N, "finding": {...}}``: exactly the keys of a ``--follow --json`` line."""
        return {"event": self.event, "step": int(self.step), "finding": finding_dict(self.finding)}


class LiveDoctor:
    """The doctor's rules evaluated again after each step, reporting only what changed.

    ``settings``: the run's settings as the rules' ``when`` reads them (verl's dotted keys, the
    derived ones resolved); ``rules``: default the built-in ones; ``run`` (a RunDir) and
    ``engine_settings`` (the resolved Settings): for example tokens of ``rollout_mismatch``.

    Cost per :meth:`evaluate`: every rule's own work on arrays the table keeps (a rule with a
    ``window`` touches only its window; one without reads every step with a value, in numpy).
    """

    def __init__(self, settings: Mapping[str, Any], rules: list[Rule] | None = None, run: Any = None,
                 engine_settings: Any = None) -> None:
        self.settings = dict(settings)
        self.rules = list(rules) if rules is not None else load_rules(())
        self.run = run
        self.engine_settings = engine_settings
        # only what the rules read: a step costs a few floats, not one per metric given
        self.table = SignalTable(keep=metrics_read(self.rules))
        self.results = RuleResults()  # the last evaluation's outcome, rule by rule
        self.step: int | None = None  # the last step evaluated
        self.evaluations = 0
        self.counts = dict.fromkeys(EVENTS, 0)
        self._active: dict[Identity, Finding] = {}
        self._since: dict[Identity, int] = {}  # the step each active finding fired at
        self._reported: dict[Identity, Finding] = {}  # as last reported (fired or changed)
        self._counterfactual: dict[Identity, list[dict[str, Any]]] = {}

    # ---- data ----------------------------------------------------------------------------------

    def add_logged(self, step: int, values: Mapping[str, float]) -> None:
        """A ``metrics.jsonl`` line's numbers (a step logged again: its later values win)."""
        self.table.add_logged(step, values)

    def add_recomputed(self, step: int, values: Mapping[str, float]) -> None:
        """A recomputed step's metrics (the engine's ``rldiag/...`` signals among them)."""
        self.table.add_recomputed(step, values)

    # ---- evaluation ----------------------------------------------------------------------------

    def evaluate(self, step: int) -> list[HealthEvent]:
        """Run the rules on the data so far; the events since the previous evaluation, at ``step``:
        fired and changed in the order of the findings (most severe first), then cleared."""
        # without the run: a rule reading example tokens back from the batch files does so only
        # for the findings an event reports (below), not at every step
        self.results = evaluate_rules(self.rules, self.table, self.settings)
        self.step = int(step)
        self.evaluations += 1
        events: list[HealthEvent] = []
        now: dict[Identity, Finding] = {}
        for f in self.results.findings:
            key = identity(f)
            now[key] = f
            before = self._reported.get(key)
            if key not in self._active:
                self._since[key] = self.step
                events.append(HealthEvent("fired", self.step, f))
            elif before is not None and _changed(before, f):
                events.append(HealthEvent("changed", self.step, f))
        full = self._with_run({ev.finding.rule for ev in events})
        for ev in events:
            ev.finding = now[identity(ev.finding)] = full.get(identity(ev.finding), ev.finding)
            self._reported[identity(ev.finding)] = ev.finding
            self.counts[ev.event] += 1
        for key, f in now.items():
            f.counterfactual = list(self._counterfactual.get(key, []))
        for key, f in self._active.items():
            if key not in now:
                events.append(HealthEvent("cleared", self.step, f))
                self.counts["cleared"] += 1
                self._since.pop(key, None)
                self._reported.pop(key, None)
                self._counterfactual.pop(key, None)
        self._active = now
        return events

    def _with_run(self, rule_ids: set[str]) -> dict[Identity, Finding]:
        """The findings of the rules ``rule_ids`` evaluated again with the run (example tokens)."""
        if self.run is None or not rule_ids:
            return {}
        rules = [r for r in self.rules if r.id in rule_ids]
        res = evaluate_rules(rules, self.table, self.settings, run=self.run, engine_settings=self.engine_settings)
        return {identity(f): f for f in res.findings}

    def attach_counterfactual(self, key: Identity, counterfactual: list[dict[str, Any]]) -> HealthEvent:
        """Set an active finding's ``counterfactual`` (kept on it at later evaluations): a
        ``changed`` event at the step the finding fired. Raises :class:`LiveDoctorError` when
        ``key`` is not active (it cleared meanwhile)."""
        f = self._active.get(key)
        if f is None:
            raise LiveDoctorError(f"no active finding {key[0]}{'/' + key[1] if key[1] else ''}")
        self._counterfactual[key] = list(counterfactual)
        f = replace(f, counterfactual=list(counterfactual))  # the events already out keep their finding
        self._active[key] = self._reported[key] = f
        self.counts["changed"] += 1
        return HealthEvent("changed", self._since[key], f)

    # ---- state ---------------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self._active

    def active(self) -> list[Finding]:
        """The findings that hold at the last evaluation, most severe first."""
        return list(self._active.values())

    def fired_at(self, key: Identity) -> int:
        """The step an active finding fired at (it has held at every evaluation since)."""
        return self._since[key]

    def standing(self) -> list[HealthEvent]:
        """One ``fired`` event per active finding, at the step it fired, with the finding as it is
        now (example tokens included): what a reader joining late needs (``doctor --follow``
        prints these after catching up with a run's existing steps)."""
        for key, f in self._with_run({f.rule for f in self._active.values()}).items():
            if key in self._active:
                f.counterfactual = self._active[key].counterfactual
                self._active[key] = f
        return sorted((HealthEvent("fired", self._since[k], f) for k, f in self._active.items()),
                      key=lambda e: e.step)

    def levels(self) -> dict[str, int]:
        """Rule id -> 0 (no finding, or info only), 1 (warning), 2 (critical), for every rule."""
        out = dict.fromkeys((r.id for r in self.rules), 0)
        for f in self._active.values():
            out[f.rule] = max(out.get(f.rule, 0), LEVELS.get(f.severity, 1))
        return out

    @property
    def healthy(self) -> bool:
        return not any(f.severity != "info" for f in self._active.values())

    def summary(self) -> dict[str, Any]:
        """``step`` (last evaluated), ``evaluations``, ``logged_steps``, ``recomputed_steps``,
        ``events`` (count per kind), ``active`` (``[{rule, cause, severity, since}]``), ``levels``,
        ``healthy``, and the rule ids ``passed`` / ``not_evaluated`` / ``not_applicable`` at the
        last evaluation."""
        return {
            "step": self.step, "evaluations": self.evaluations, "logged_steps": self.table.logged_steps,
            "recomputed_steps": self.table.recomputed_steps, "events": dict(self.counts),
            "active": [{"rule": f.rule, "cause": f.evidence.cause, "severity": f.severity, "since": self._since[k]}
                       for k, f in self._active.items()],
            "levels": self.levels(), "healthy": self.healthy, "passed": sorted(self.results.passed),
            "not_evaluated": sorted(self.results.not_evaluated), "not_applicable": sorted(self.results.not_applicable),
        }


def _changed(before: Finding, now: Finding) -> bool:
    if before.severity != now.severity or before.evidence.state != now.evidence.state:
        return True
    a, b = before.evidence.confidence, now.evidence.confidence
    if (a is None) != (b is None):
        return True
    return a is not None and b is not None and abs(b - a) >= CONFIDENCE_STEP - 1e-9  # 0.7 - 0.6 counts
