"""The step page: groups under two scenarios, one row's heat strip, the seed 002 §13 checklist."""

from __future__ import annotations

import shutil

from rldiag.recompute import recompute
from tests.app.helpers import charts, open_app, trace_names

PAGE = "views/step.py"
RLOO = "adv_estimator=rloo"


def _checklist(at) -> list[str]:
    return [m.value for m in at.markdown if "**" in m.value and ". " in m.value and "—" in m.value]


def test_groups_strip_and_checklist(app_run):
    recompute(app_run, {"algorithm.adv_estimator": "rloo"}, save_tokens=True, device="cpu")
    at = open_app(app_run, PAGE)
    assert at.selectbox(key="st_a").value == "baseline" and at.selectbox(key="st_b").value == RLOO
    groups, strip = charts(at)
    assert set(trace_names(groups)) == {"advantage · baseline", f"advantage · {RLOO}", "score total"}
    assert len(groups["data"][0]["y"]) == 12  # one bar per row of the step
    strip_rows = [t["y"][0] for t in strip["data"]]
    assert strip_rows[0] == "advantage" and "mask (batch)" in strip_rows
    items = _checklist(at)
    assert len(items) == 8 and [i.split("**")[1].split(".")[0] for i in items] == [str(k) for k in range(1, 9)]


def test_changing_row_and_step_changes_the_charts(app_run):
    at = open_app(app_run, PAGE)
    groups0, strip0 = charts(at)
    rows = at.selectbox(key="st_row").options
    other = 0 if at.selectbox(key="st_row").value != 0 else 5
    at.selectbox(key="st_row").set_value(other).run()
    _, strip1 = charts(at)
    assert strip1["data"][0]["z"] != strip0["data"][0]["z"]
    at.selectbox(key="st_step").set_value(3).run()
    groups3, _ = charts(at)
    assert [t["y"] for t in groups3["data"]] != [t["y"] for t in groups0["data"]]
    assert groups3["data"][0]["x"][0][0].startswith("s3-")  # step 3's uids
    assert len(rows) == 12 and rows[5].startswith("row 5 · uid")
    assert at.selectbox(key="st_row").value == other


def test_a_link_to_a_step_opens_it(app_run):
    at = open_app(app_run, PAGE)
    at.query_params["step"] = "4"
    at.run()
    assert at.selectbox(key="st_step").value == 4


def test_without_tokens_the_page_offers_to_recompute(app_run):
    shutil.rmtree(app_run / "rldiag")
    at = open_app(app_run, PAGE)
    assert any("No scenario saved per-token outputs" in i.value for i in at.info)
    items = _checklist(at)
    assert len(items) == 8 and "Needs a scenario with saved tokens" in items[1]
    at.button(key="st_recompute").click().run()
    assert not at.exception
    assert at.selectbox(key="st_a").value == "baseline"
    assert "advantage · baseline" in trace_names(charts(at)[0])
