"""rldiag calibrate's arithmetic (rldiag/analysis/calibrate.py) on hand-made replays: true and false
positives by planted kind and by gap cause (implied causes counted neither way), false alarms per
100 healthy steps as events, lead times against the labelled onsets, Wilson intervals, the statuses,
and the shipped calibration's sentence (rldiag/doctor/calibration.py)."""

from __future__ import annotations

import math

import pytest

from rldiag.analysis.calibrate import Alert, RunReplay, summarise, summarise_key, wilson
from rldiag.doctor.calibration import calibration_for, lead_words, render_table


def run(name, split="test", healthy=False, pathologies=(), alerts=(), steps=30, named=()):
    labels = {"healthy": healthy, "pathologies": list(pathologies), "split": split}
    return RunReplay(name, labels, steps, [Alert(*a) for a in alerts], [Alert(*a) for a in named])


def collapse(onset):
    return {"kind": "entropy_collapse", "onset_step": onset, "signal": "actor/entropy_loss"}


def gap(cause, implied_by=None):
    p = {"kind": "rollout_gap", "cause": cause, "onset_step": 1, "signal": "rldiag/mismatch"}
    if implied_by:
        p["implied_by"] = implied_by
    return p


def test_wilson_interval_matches_the_formula():
    lo, hi = wilson(9, 10)
    # Wilson (1927): centre (p + z^2/2n) / (1 + z^2/n), half-width z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n)
    z = 1.959963984540054
    centre = (0.9 + z * z / 20) / (1 + z * z / 10)
    half = z * math.sqrt(0.9 * 0.1 / 10 + z * z / 400) / (1 + z * z / 10)
    assert lo == pytest.approx(centre - half) and hi == pytest.approx(centre + half)
    assert lo == pytest.approx(0.5958, abs=1e-4) and hi == pytest.approx(0.9821, abs=1e-4)
    assert wilson(0, 0) is None and wilson(0, 5)[0] == 0.0 and wilson(5, 5)[1] == 1.0


def test_a_general_rule_true_and_false_positives_false_alarms_and_lead():
    runs = [run(f"c{i}", pathologies=[collapse(10)], alerts=[("entropy_collapse", None, 7 + i, "warning")])
            for i in range(5)]
    runs += [run("c5", pathologies=[collapse(12)])]  # missed
    # a healthy run with two alert events of 20 steps, one without: 2 false alarms / 50 healthy steps
    runs += [run("h0", healthy=True, steps=20, alerts=[("entropy_collapse", None, 3, "warning"),
                                                         ("entropy_collapse", None, 9, "warning")]),
             run("h1", healthy=True, steps=30)]
    row = summarise_key(("entropy_collapse", None), runs, "warning")
    assert (row["tp"], row["fp"], row["fn"], row["fired"], row["runs"]) == (5, 1, 1, 6, 8)
    assert row["precision"] == pytest.approx(5 / 6) and row["recall"] == pytest.approx(5 / 6)
    assert row["false_alarms"] == 2 and row["healthy_steps"] == 50
    assert row["false_alarms_per_100_steps"] == pytest.approx(4.0)
    # onsets 10, first alerts 7..11: leads 3, 2, 1, 0, -1 -> median 1
    assert row["lead_steps"] == 1 and row["lead_runs"] == 5 and row["detects"] == "entropy_collapse"
    assert row["status"] == "calibrated" and row["meets_floor"] is False
    assert row["precision_ci"] == pytest.approx(wilson(5, 6)) and row["recall_ci"] == pytest.approx(wilson(5, 6))


def test_a_gap_cause_counts_only_its_own_runs_and_leaves_implied_ones_out():
    key = ("rollout_mismatch", "policy_lag")
    runs = [run(f"lag{i}", pathologies=[gap("policy_lag")], alerts=[("rollout_mismatch", "policy_lag", 2, "warning")])
            for i in range(4)]
    runs += [run("lag-missed", pathologies=[gap("policy_lag")]),
             # named on a run planting another cause: a false positive, though the run is not healthy
             run("trunc", pathologies=[gap("sampling_truncation")],
                 alerts=[("rollout_mismatch", "policy_lag", 3, "warning")]),
             # implied by the planted outliers: neither true nor false
             run("implied", pathologies=[gap("outlier_tokens"), gap("policy_lag", implied_by="outlier_tokens")],
                 alerts=[("rollout_mismatch", "policy_lag", 2, "warning")])]
    row = summarise_key(key, runs, "warning")
    assert (row["runs"], row["tp"], row["fp"], row["fn"]) == (6, 4, 1, 1)
    assert row["detects"] == "rollout_gap/policy_lag" and row["recall"] == pytest.approx(0.8)
    assert row["lead_steps"] == -1  # onset 1, first alert 2


def test_statuses_and_the_split():
    rows = {r["rule"]: r for r in summarise(
        [run("h", healthy=True, alerts=[("only_healthy", None, 1, "warning")]),
         run("c", pathologies=[collapse(5)], alerts=[("rare", None, 4, "warning")]),
         run("t", split="train", pathologies=[collapse(5)], alerts=[("only_healthy", None, 1, "warning")]),
         run("unproduced", pathologies=[collapse(None)], alerts=[("rare", None, 1, "warning")])],
        [], "test")["rules"]}
    assert rows["only_healthy"]["status"] == "uncalibrated" and rows["only_healthy"]["fp"] == 1
    assert rows["only_healthy"]["meets_floor"] is False  # it fires, on healthy runs only
    assert rows["rare"]["status"] == "not enough data" and rows["rare"]["tp"] == 1  # the unproduced run left out
    assert rows["rare"]["meets_floor"] is None
    split = summarise([run("u", pathologies=[collapse(None)])], [], "test")
    assert split["left_out"] == ["u"] and split["runs"] == 0


def test_the_calibration_sentence_and_table():
    cal = {"corpus": {"size": "full", "seed": 0}, "splits": {"test": {"rules": [
        {"rule": "r", "cause": None, "severity": "warning", "status": "calibrated", "precision": 0.95, "recall": 0.8,
         "false_alarms_per_100_steps": 0.4, "lead_steps": 4, "detects": "reward_hacking", "fired": 20,
         "precision_ci": [0.8, 0.99], "recall_ci": [0.6, 0.9], "runs": 30, "tp": 19, "fp": 1, "fn": 5,
         "lead_runs": 12, "meets_floor": True},
        {"rule": "few", "cause": None, "severity": "warning", "status": "not enough data", "fired": 3}]}}}
    got = calibration_for("r", None, cal)
    assert got["precision"] == 0.95 and got["lead_steps"] == 4 and "test split" in got["corpus"]
    assert got["text"] == ("on the calibration corpus: precision 0.95, recall 0.80, fires 4 steps before the onset "
                           "of reward_hacking, 0.40 false alarms per 100 healthy steps")
    few = calibration_for("few", None, cal)
    assert few["precision"] is None and few["status"] == "not enough data" and "3 run(s)" in few["text"]
    assert calibration_for("other", None, cal)["status"] == "no calibration"
    assert lead_words(-2, "divergence") == "fires 2 steps after the onset of divergence"
    assert lead_words(1, "divergence") == "fires 1 step before the onset of divergence"
    table = render_table(cal["splits"]["test"] | {"rules": cal["splits"]["test"]["rules"][:1]})
    assert "| `r` |  | warning | 30 | 20 | 19 | 1 | 5 | 0.95 [0.80, 0.99] | 0.80 [0.60, 0.90] |" in table
    assert "meets the floor" in table


def test_a_cause_expected_at_info_is_detected_when_named_and_never_a_false_alarm_at_info():
    key = ("rollout_mismatch", "precision")
    planted = {**gap("precision"), "expected_severity": "info"}
    runs = [run(f"p{i}", pathologies=[planted], named=[("rollout_mismatch", "precision", 1, "info")])
            for i in range(5)]
    # healthy runs name bf16 precision at info: not an alert, not a false alarm
    runs += [run("h", healthy=True, named=[("rollout_mismatch", "precision", 1, "info")])]
    row = summarise_key(key, runs, "warning")
    assert (row["tp"], row["fp"], row["fn"], row["false_alarms"]) == (5, 0, 0, 0) and row["recall"] == 1.0
