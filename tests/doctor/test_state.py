"""A finding's trend state (rldiag.doctor.state): each state at the exact step it began, on
series built so that each rule of the module decides; the live doctor's `changed` event for a
state change, never a `cleared` while the rule still fires."""

from __future__ import annotations

import numpy as np

from rldiag.doctor.evaluate import evaluate_rules
from rldiag.doctor.live import LiveDoctor
from rldiag.doctor.rule import Rule
from rldiag.doctor.signals import SignalTable
from rldiag.doctor.state import SPARK_POINTS, settle_steps, sparkline, state_text, trend_state

MEAN_HIGH = Rule(id="x_mean", kind="threshold", title="x is high", why="because", metric="x",
                 params={"above": 1.0, "stat": "mean"})


def _state(values, threshold=1.0, worse_up=True, first=1):
    v = np.asarray(values, dtype=np.float64)
    steps = np.arange(first, first + len(v))
    outside = v > threshold if worse_up else v < threshold
    return trend_state(steps, v, outside, worse_up, threshold)


def test_resolved_from_the_first_step_of_the_settled_stretch():
    # 20 steps: settle_steps(20) = 4; back under 1 from step 15 on (6 steps)
    values = [3.0] * 14 + [0.5] * 6
    assert settle_steps(20) == 4
    assert _state(values) == ("resolved", 15)
    # 3 steps back inside is not settled yet: the mean of the last 4 (1.25) against the 4 before (3) improves
    assert _state([3.0] * 17 + [0.5] * 3) == ("improving", 17)


def test_worsening_and_improving_compare_the_last_fifth_with_the_one_before():
    # 10 steps, k = 3: steps 8-10 mean 4 vs steps 5-7 mean 2: +100 % of 2
    assert _state([2.0] * 7 + [4.0] * 3) == ("worsening", 8)
    # steps 8-10 mean 1.2 (still outside) vs 2: -40 %
    assert _state([2.0] * 7 + [1.2] * 3) == ("improving", 8)
    # -20 % is within MOVE: ongoing since the first step outside
    assert _state([2.0] * 7 + [1.6] * 3) == ("ongoing", 1)


def test_ongoing_restarts_after_a_settled_stretch_inside_and_reads_the_lower_side():
    # outside 1-3, inside 4-8 (5 >= settle 3), outside again from step 9 to 12 (last 3 vs the 3 before: 2 vs 1.33)
    values = [2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0]
    state, since = _state(values)
    assert state == "worsening" and since == 10
    # a rule whose lower side is worse (below 0.5): a steady 0.1 from step 4 on
    assert _state([1.0, 1.0, 1.0] + [0.1] * 9, threshold=0.5, worse_up=False) == ("ongoing", 4)
    # never outside (a rule firing on a window statistic alone): ongoing since the window's first step
    assert _state([0.5] * 8, first=7) == ("ongoing", 7)


def test_sparkline_keeps_the_last_point_and_at_most_spark_points():
    steps = np.arange(1, 1001)
    s = sparkline(steps, steps * 0.5, 2.0, "above", "m")
    assert len(s["steps"]) == SPARK_POINTS and s["steps"][0] == 1 and s["steps"][-1] == 1000
    assert s["values"][-1] == 500.0 and s["threshold"] == 2.0 and s["worse"] == "above" and s["metric"] == "m"
    assert state_text("resolved", 19) == "resolved since step 19" and state_text(None, None) == ""


def test_the_threshold_rule_carries_its_state_and_series():
    table = SignalTable()
    for step, v in enumerate([3.0] * 10 + [0.2] * 8, start=1):
        table.add_logged(step, {"x": v})
    (f,) = evaluate_rules([MEAN_HIGH], table, {}).findings  # mean 1.76 > 1
    assert (f.evidence.state, f.evidence.state_since) == ("resolved", 11)
    assert f.evidence.sparkline["threshold"] == 1.0 and f.evidence.sparkline["values"][10] == 0.2


def test_a_state_change_is_a_changed_event_and_resolved_is_not_cleared():
    doc = LiveDoctor({}, [MEAN_HIGH])
    events = []
    for step, v in enumerate([3.0] * 10 + [0.2] * 8, start=1):
        doc.add_logged(step, {"x": v})
        events += [(e.event, e.step, e.finding.evidence.state) for e in doc.evaluate(step)]
    # the mean stays above 1 to step 18 (1.76): never cleared; fired ongoing, then improving as the
    # late steps fall, then resolved at step 13, once 3 steps (at least 3, a fifth of 13 rounded up)
    # are back under 1
    assert [e[0] for e in events if e[0] != "changed"] == ["fired"]
    assert events[0] == ("fired", 1, "ongoing")
    assert events[-1] == ("changed", 13, "resolved")
    assert ("changed", 11, "improving") in events
    assert doc.active()[0].evidence.state_since == 11


def test_the_state_in_words_for_the_text_output_and_follow(capsys):
    """``state_line`` (the text report and --follow's changed events): the state, its step, and
    what it means for the rule's threshold."""
    from rldiag.cli.cmd_doctor import plural, state_line
    from rldiag.doctor.evaluators import Evidence

    spark = {"metric": "response_length/clip_ratio", "threshold": 0.1, "worse": "above", "steps": [], "values": []}
    ev = Evidence(state="resolved", state_since=16, sparkline=spark)
    assert state_line(ev) == "resolved since step 16: response_length/clip_ratio back below 0.1 at every step since"
    ev = Evidence(state="worsening", state_since=24, sparkline={**spark, "worse": "below", "threshold": 0.3})
    assert state_line(ev) == ("worsening since step 24: the recent mean of response_length/clip_ratio moves away "
                              "from 0.3")
    ev = Evidence(state="improving", state_since=5, cause="policy_lag", details={"trend_metric": "rldiag/mismatch/gap_std"})
    assert state_line(ev) == "improving since step 5: rldiag/mismatch/gap_std shrinks over the last steps"
    assert state_line(Evidence(state="ongoing", state_since=1)) == "ongoing since step 1"
    assert [plural(n, "finding") for n in (0, 1, 2)] == ["0 findings", "1 finding", "2 findings"]
