"""The live doctor (rldiag.doctor.live): events at exact steps on synthetic series, what counts as
a change, counterfactuals, levels; and the growing SignalTable it stands on."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from rldiag.doctor.evaluate import evaluate_rules
from rldiag.doctor.evaluators import RULE_KINDS, Context, Evidence, Finding, Passed, Series, metrics_read
from rldiag.doctor.live import CONFIDENCE_STEP, HealthEvent, LiveDoctor, LiveDoctorError, finding_dict
from rldiag.doctor.rule import Rule
from rldiag.doctor.rules import load_rules
from rldiag.doctor.signals import SignalTable
from rldiag.errors import RldiagError

HIGH = Rule(id="x_high", kind="threshold", title="x is high", why="because", metric="x",
            params={"above": 1.0, "stat": "last"})
WIDE = Rule(id="y_mean", kind="threshold", title="y mean", why="because", metric="y", window=4, severity="critical",
            params={"above": 0.5, "stat": "mean"})


def feed(doc: LiveDoctor, metric: str, values: dict[int, float]) -> list[tuple[str, int, str]]:
    out = []
    for step, v in values.items():
        doc.add_logged(step, {metric: v})
        out += [(e.event, e.step, e.finding.rule) for e in doc.evaluate(step)]
    return out


def test_a_threshold_fires_clears_and_fires_again_at_the_steps_it_holds():
    doc = LiveDoctor({}, [HIGH])
    x = {1: 0.0, 2: 0.5, 3: 2.0, 4: 2.5, 5: 3.0, 6: 0.0, 7: 0.2, 8: 5.0, 9: 6.0}
    # its message ("last of x over steps 1..N = v") differs at every step: no "changed" for that;
    # at step 9 its trend state moves: the mean of steps 7-9 (3.73) is twice that of 4-6 (1.83)
    assert feed(doc, "x", x) == [("fired", 3, "x_high"), ("cleared", 6, "x_high"), ("fired", 8, "x_high"),
                                 ("changed", 9, "x_high")]
    assert doc.counts == {"fired": 2, "changed": 1, "cleared": 1}
    assert (doc.active()[0].evidence.state, doc.active()[0].evidence.state_since) == ("worsening", 7)
    assert [f.message for f in doc.active()] == ["last of x over steps 1..9 = 6 (rule: > 1)"]
    assert doc.fired_at(("x_high", None)) == 8 and doc.step == 9 and doc.evaluations == 9


def test_cleared_carries_the_last_finding_that_held():
    doc = LiveDoctor({}, [HIGH])
    feed(doc, "x", {1: 2.0, 2: 3.0})
    doc.add_logged(3, {"x": 0.0})
    (ev,) = doc.evaluate(3)
    assert (ev.event, ev.step) == ("cleared", 3)
    assert ev.finding.evidence.steps == [1, 2] and ev.finding.evidence.values == [2.0, 3.0]
    assert doc.active() == [] and doc.levels() == {"x_high": 0}


def test_a_window_rule_sees_only_its_window():
    doc = LiveDoctor({}, [WIDE])
    y = {1: 2.0, 2: 2.0, 3: 0.0, 4: 0.0, 5: 0.0, 6: 0.0, 7: 1.0, 8: 1.0, 9: 1.0}
    # window 4: the mean of the last 4 is 2, 2, 4/3, 1 at steps 1-4; 0.5, 0, 0.25, 0.5 at 5-8 (not above 0.5); 0.75 at 9
    assert feed(doc, "y", y) == [("fired", 1, "y_mean"), ("cleared", 5, "y_mean"), ("fired", 9, "y_mean")]
    assert doc.active()[0].evidence.window == [6, 9]
    assert doc.levels() == {"y_mean": 2}


def _scripted(rule: Rule, ctx) -> Finding | Passed:
    """A rule naming a cause: severity from the last value of ``sev`` (0 passes, 1 info, 2
    warning, 3 critical), confidence the last value of ``conf``."""
    sev, conf = ctx.series("sev", "any"), ctx.series("conf", "any")
    level = int(sev.values[-1])
    if level == 0:
        return Passed("calm")
    c = float(conf.values[-1])
    return Finding(rule.id, rule.title, ["", "info", "warning", "critical"][level], rule.why,
                   f"level {level}, confidence {c:.2f}", Evidence(cause="heat", confidence=c, steps=[int(sev.steps[-1])]))


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setitem(RULE_KINDS._entries, "scripted", _scripted)
    return Rule(id="heat", kind="scripted", title="Heat", why="why")


def test_changed_is_a_new_severity_or_a_confidence_move_of_at_least_a_tenth(scripted):
    doc = LiveDoctor({}, [scripted])
    script = {  # step: (severity level, confidence)
        1: (2, 0.60), 2: (2, 0.65), 3: (2, 0.69), 4: (2, 0.70), 5: (2, 0.75), 6: (3, 0.75), 7: (3, 0.62),
        8: (0, 0.0), 9: (0, 0.0), 10: (2, 0.5),
    }
    events = []
    for step, (level, conf) in script.items():
        doc.add_logged(step, {"sev": level, "conf": conf})
        events += [(e.event, e.step, e.finding.severity, e.finding.evidence.confidence) for e in doc.evaluate(step)]
    # 0.65 and 0.69 stay within 0.1 of the 0.60 reported; 0.70 is 0.1 away (0.75 then only 0.05
    # from it); critical is a change at any confidence; 0.62 is 0.13 below the 0.75 reported
    assert events == [("fired", 1, "warning", 0.60), ("changed", 4, "warning", 0.70), ("changed", 6, "critical", 0.75),
                      ("changed", 7, "critical", 0.62), ("cleared", 8, "critical", 0.62), ("fired", 10, "warning", 0.5)]
    assert CONFIDENCE_STEP == 0.1


def test_info_findings_are_events_but_level_zero(scripted):
    doc = LiveDoctor({}, [scripted, HIGH])
    doc.add_logged(1, {"sev": 1, "conf": 0.9, "x": 0.0})
    assert [(e.event, e.finding.severity) for e in doc.evaluate(1)] == [("fired", "info")]
    assert doc.levels() == {"heat": 0, "x_high": 0} and doc.healthy
    doc.add_logged(2, {"sev": 3, "x": 2.0})
    doc.evaluate(2)
    assert doc.levels() == {"heat": 2, "x_high": 1} and not doc.healthy
    s = doc.summary()
    assert s["step"] == 2 and s["evaluations"] == 2 and s["logged_steps"] == 2 and s["events"]["fired"] == 2
    assert {(a["rule"], a["cause"], a["since"]) for a in s["active"]} == {("heat", "heat", 1), ("x_high", None, 2)}


def test_attach_counterfactual_is_a_change_at_the_fired_step_and_stays(scripted):
    doc = LiveDoctor({}, [HIGH])
    feed(doc, "x", {1: 0.0, 2: 2.0, 3: 2.0})
    cf = [{"settings": {"k": 1}, "metric": "x", "statistic": "mean", "window": [2, 3], "with": 0.5, "without": 2.0}]
    ev = doc.attach_counterfactual(("x_high", None), cf)
    assert (ev.event, ev.step, ev.finding.counterfactual) == ("changed", 2, cf)
    assert ev.to_dict()["finding"]["counterfactual"] == cf
    doc.add_logged(4, {"x": 3.0})
    assert doc.evaluate(4) == []  # the next evaluation keeps it, without another event
    assert doc.active()[0].counterfactual == cf
    doc.add_logged(5, {"x": 0.0})
    (cleared,) = doc.evaluate(5)
    assert cleared.event == "cleared" and cleared.finding.counterfactual == cf
    with pytest.raises(LiveDoctorError) as info:
        doc.attach_counterfactual(("x_high", None), cf)
    assert isinstance(info.value, RldiagError)


def test_an_event_serialises_its_finding_as_doctor_json_does():
    doc = LiveDoctor({}, [HIGH])
    doc.add_logged(1, {"x": math.inf})
    doc.add_logged(2, {"x": 4.0})
    (ev,) = doc.evaluate(2)
    d = ev.to_dict()
    assert set(d) == {"event", "step", "finding"} and d["event"] == "fired" and d["step"] == 2
    assert d["finding"] == finding_dict(ev.finding)
    assert set(d["finding"]) == {"rule", "title", "severity", "why", "message", "evidence", "remedy", "counterfactual"}
    assert isinstance(ev, HealthEvent)


def test_standing_reports_each_active_finding_once_at_its_fired_step():
    doc = LiveDoctor({}, [HIGH, WIDE])
    for step in range(1, 8):
        doc.add_logged(step, {"x": 2.0 if step >= 5 else 0.0, "y": 1.0})
        doc.evaluate(step)
    assert [(e.event, e.step, e.finding.rule) for e in doc.standing()] == [("fired", 1, "y_mean"), ("fired", 5, "x_high")]


# ---- the table ---------------------------------------------------------------------------------


def test_signal_table_keeps_steps_sorted_and_the_later_value():
    t = SignalTable()
    for step in [3, 1, 2, 5, 5, 4]:
        t.add_logged(step, {"a": float(step * 10)})
    t.add_logged(2, {"a": -1.0})  # a step logged again: the later value wins
    s = t.series("a")
    assert s.steps.tolist() == [1, 2, 3, 4, 5] and s.values.tolist() == [10.0, -1.0, 30.0, 40.0, 50.0]
    t.add_recomputed(2, {"a": 7.0})
    t.add_recomputed(6, {"a": 60.0})
    s = t.series("a")  # logged where present, recomputed elsewhere
    assert s.steps.tolist() == [1, 2, 3, 4, 5, 6] and s.values.tolist() == [10.0, -1.0, 30.0, 40.0, 50.0, 60.0]
    assert s.source == "logged+recomputed"
    assert t.series("a", "recomputed").values.tolist() == [7.0, 60.0]
    assert (t.logged_steps, t.recomputed_steps) == (5, 2)
    for step in range(7, 300):  # the buffers grow
        t.add_logged(step, {"a": 1.0})
    assert len(t.series("a").steps) == 299 and t.series("a").steps[-1] == 299


def test_a_windowed_rule_reads_the_same_from_the_tail_as_from_the_whole_series():
    rng = np.random.default_rng(0)
    t = SignalTable()
    for step in range(1, 200):
        v = float(rng.normal()) if rng.random() > 0.4 else float("nan")  # NaNs are not counted in a window
        t.add_logged(step, {"y": v})
    rule = Rule(id="w", kind="threshold", title="w", why="w", metric="y", window=30,
                params={"above": -10.0, "stat": "mean"})
    tail = t.series("y", tail=30)
    assert np.count_nonzero(np.isfinite(tail.values)) >= 30 and len(tail.values) < 199
    windowed = evaluate_rules([rule], t, {}).findings[0]
    whole = evaluate_rules([replace(rule, window=None)], t, {})
    assert windowed.evidence.window[1] == 199 and windowed.evidence.window[0] > 1
    assert whole.findings[0].evidence.window == [1, 199]
    keep = np.isfinite(t.series("y").values)
    last30 = t.series("y").steps[keep][-30:]
    assert windowed.evidence.window == [int(last30[0]), int(last30[-1])]


class AskedFor(SignalTable):
    """Every metric asked for has a series (so that each rule reads as far as it can: a ``while``
    rule's condition, the mismatch rule's every statistic); the names asked are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: set[str] = set()

    def series(self, name, source="any", tail=None):
        self.asked.add(name)
        steps = np.arange(1, 41, dtype=np.int64)
        return Series(name, steps, np.where(steps > 20, 10.0 * steps, 0.01), "logged")


def test_the_metrics_a_rule_reads_are_those_its_kind_declares(scripted):
    """What a live doctor keeps (:func:`metrics_read`) covers every metric each built-in rule asks
    for, and a live doctor's table stores those alone, counting every step it was given."""
    rules = load_rules(())
    for rule in rules:
        table = AskedFor()  # the kind's evaluator itself: its ``when`` not consulted
        RULE_KINDS.get(rule.kind)(rule, Context(settings={}, series=table.series))
        assert table.asked <= metrics_read([rule]), rule.id
        if rule.metric is not None:
            assert rule.metric in table.asked, rule.id
    kept = metrics_read(rules)
    assert kept is not None and "rldiag/mismatch/gap_std" in kept and "actor/entropy_loss" in kept
    doc = LiveDoctor({}, rules)
    for step in (1, 2, 2, 3):
        doc.add_recomputed(step, {"actor/entropy_loss": 1.0, "rldiag/unread/x": 2.0})
    doc.add_logged(1, {"rldiag/unread/y": 1.0})
    assert list(doc.table.recomputed) == ["actor/entropy_loss"] and doc.table.logged == {}
    assert (doc.table.recomputed_steps, doc.table.logged_steps) == (3, 1)
    assert doc.table.series("rldiag/unread/x") is None
    # a kind that declares nothing (registered elsewhere, here without its record): every metric kept
    assert metrics_read([*rules, scripted]) is None and LiveDoctor({}, [scripted]).table.keep is None
