"""The Health page shows each finding's counterfactual as the doctor reported it (no maths in the page)."""

from __future__ import annotations

import numpy as np

from rldiag.doctor.counterfactual import CAVEAT
from tests.app.helpers import open_app
from tests.doctor.runs import write_run

HEALTH = "views/health.py"


def _plant_clip(step, s):
    for i in range(s.rows):
        s.cur[i] = (s.old[i] + s.rng.normal(0, 0.6, len(s.old[i]))).astype(np.float32)


def test_health_shows_the_counterfactual_of_a_finding(tmp_path):
    run = write_run(tmp_path / "run", plant=_plant_clip, steps=4)
    at = open_app(run, HEALTH)
    assert not at.exception
    report = at.session_state["he_report"][1]
    f = next(f for f in report.findings if f.rule == "clipfrac_high")
    assert f.counterfactual
    table = next(d.value for d in at.dataframe if "without" in d.value.columns)
    assert table["with"].tolist() == [e["with"] for e in f.counterfactual]
    assert table["without"].tolist() == [e["without"] for e in f.counterfactual]
    assert table["settings"].tolist()[0] == "actor_rollout_ref.actor.clip_ratio_high=0.28"
    assert any(m.value.startswith("- with clip_ratio_high=0.28 instead of 0.2 on steps 1-4") for m in at.markdown)
    assert any(CAVEAT in c.value for c in at.caption)
