"""docs/calibration.md is rendered from the shipped calibration (rldiag/doctor/calibration.json),
and every finding carries that calibration (evidence.calibration) with its one-line text."""

from __future__ import annotations

from pathlib import Path

from rldiag.doctor.calibration import KEYS, calibration_for, load, render_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_docs_calibration_is_rendered_from_the_shipped_json():
    assert (ROOT / "docs" / "calibration.md").read_text() == render_markdown(), (
        "regenerate: python -m rldiag.doctor.calibration > docs/calibration.md")


def test_the_shipped_calibration_is_complete_and_every_rule_has_its_line():
    from rldiag.doctor.rules import load_rules

    cal = load()
    assert cal is not None and set(cal["splits"]) == {"train", "test"} and "runs" not in cal
    test = cal["splits"]["test"]
    assert test["healthy_steps"] >= 240  # the sample size
    rules = {r["rule"] for r in test["rules"]}
    assert {r.id for r in load_rules(())} <= rules
    for r in test["rules"]:
        got = calibration_for(r["rule"], r["cause"])
        assert set(KEYS) <= set(got) and got["status"] == r["status"] and got["text"]
        if r["status"] == "calibrated":
            assert got["precision"] == r["precision"] and got["text"].startswith("on the calibration corpus: precision")
        else:
            assert got["precision"] is None
