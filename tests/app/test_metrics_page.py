"""The training-metrics page in Streamlit's AppTest: widgets change the chart; growth shows up."""

from __future__ import annotations

import json

from tests.app.helpers import charts, open_app, subplot_titles, trace_names

def _status(at) -> str:
    return next(m.value for m in at.markdown if m.value.startswith("Latest logged step") or m.value.startswith("No logged"))


def _xs(spec, name):
    return sorted({x for t in spec["data"] if t.get("name") == name for x in t["x"]})


def test_opens_with_logged_and_recomputed_on_the_same_axes(app_run):
    at = open_app(app_run)
    assert "Latest logged step **4** (4 steps)" in _status(at)
    (spec,) = charts(at)
    assert subplot_titles(spec) == at.multiselect(key="m_metrics").value
    names = set(trace_names(spec))
    assert names == {"logged", "baseline"}
    # both sources in one panel share its axes
    axes = {(t["name"], t["xaxis"], t["yaxis"]) for t in spec["data"]}
    assert {("logged", "x", "y"), ("baseline", "x", "y")} <= axes
    assert _xs(spec, "logged") == [1, 2, 3, 4] and _xs(spec, "baseline") == [1, 2, 3, 4, 5, 6]


def test_choosing_metrics_changes_the_panels(app_run):
    at = open_app(app_run)
    at.multiselect(key="m_metrics").set_value(["perf/throughput", "actor/pg_loss"]).run()
    (spec,) = charts(at)
    assert subplot_titles(spec) == ["perf/throughput", "actor/pg_loss"]
    perf = [t for t in spec["data"] if t["xaxis"] == "x"]
    assert {t["name"] for t in perf} == {"logged"} and set(perf[0]["y"]) == {1234.0}


def test_search_and_groups_filter_the_options(app_run):
    at = open_app(app_run)
    before = at.multiselect(key="m_metrics").options
    assert len(before) > 60  # logged and recomputed names
    at.text_input(key="m_query").set_value("clipfrac").run()
    opts = at.multiselect(key="m_metrics").options
    selected = set(at.multiselect(key="m_metrics").value)
    assert {o for o in opts if o not in selected} and all("clipfrac" in o for o in opts if o not in selected)
    at.text_input(key="m_query").set_value("").run()
    at.multiselect(key="m_groups").set_value(["rollout_corr/"]).run()
    opts = at.multiselect(key="m_metrics").options
    assert all(o.startswith("rollout_corr/") for o in opts if o not in selected)


def test_ema_smoothing_changes_the_lines(app_run):
    at = open_app(app_run)
    at.multiselect(key="m_metrics").set_value(["critic/advantages/max"]).run()
    raw = [t for t in charts(at)[0]["data"] if t["name"] == "baseline"][0]["y"]
    at.slider(key="m_ema").set_value(0.8).run()
    traces = [t for t in charts(at)[0]["data"] if t["name"] == "baseline"]
    faint, smooth = traces  # raw drawn faint under the smoothed line
    assert faint["y"] == raw and faint["opacity"] < 1
    assert smooth["y"][0] == raw[0] and smooth["y"][1:] != raw[1:]
    assert max(smooth["y"]) - min(smooth["y"]) < max(raw) - min(raw)


def test_step_range_and_overlay(app_run):
    at = open_app(app_run)
    at.slider(key="m_range").set_value((2, 3)).run()
    spec = charts(at)[0]
    assert _xs(spec, "logged") == [2, 3] and _xs(spec, "baseline") == [2, 3]
    at.multiselect(key="m_scenarios").set_value([]).run()
    assert set(trace_names(charts(at)[0])) == {"logged"}


def test_lines_appended_to_metrics_jsonl_appear(app_run):
    at = open_app(app_run)
    m = app_run / "metrics.jsonl"
    with m.open("a") as fh:
        fh.write(json.dumps({"step": 5, "data": {"critic/score/mean": 0.77}}) + "\n")
        fh.write('{"step": 6, "data": {"critic/score/mean": 0.')  # still being written
    at.run()
    assert not at.exception
    assert "Latest logged step **5** (5 steps)" in _status(at)
    spec = charts(at)[0]
    score_panel = [t for t in spec["data"] if t["name"] == "logged" and t["xaxis"] == "x"][0]
    assert score_panel["x"][-1] == 5 and score_panel["y"][-1] == 0.77
    with m.open("a") as fh:
        fh.write('9}}\n')
    at.run()
    assert "Latest logged step **6**" in _status(at)


def test_a_range_reaching_the_last_step_follows_the_run(app_run):
    at = open_app(app_run)
    at.multiselect(key="m_scenarios").set_value([]).run()  # logged only: steps 1..4
    at.slider(key="m_range").set_value((2, 4)).run()
    with (app_run / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps({"step": 5, "data": {"critic/score/mean": 0.5}}) + "\n")
    at.text_input(key="m_query").set_value("score").run()  # any interaction: a full rerun
    assert at.slider(key="m_range").value == (2, 5)
    assert _xs(charts(at)[0], "logged") == [2, 3, 4, 5]
    at.slider(key="m_range").set_value((2, 3)).run()  # a narrowed range stays put
    with (app_run / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps({"step": 6, "data": {"critic/score/mean": 0.6}}) + "\n")
    at.text_input(key="m_query").set_value("").run()
    assert at.slider(key="m_range").value == (2, 3)
