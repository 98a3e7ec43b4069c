"""The training-metrics page in Streamlit's AppTest: widgets change the chart; growth shows up."""

from __future__ import annotations

import json

from streamlit.testing.v1 import AppTest

from rldiag.recompute import recompute
from rldiag.store import Store
from rldiag.viz.panels import panel_csv
from tests.app.helpers import APP, charts, open_app, subplot_titles, trace_names


def _status(at) -> str:
    return next(m.value for m in at.markdown if m.value.startswith("Latest logged step") or m.value.startswith("No logged"))


def _xs(spec, name):
    return sorted({x for t in spec["data"] if t.get("name") == name for x in t["x"]})


def _panels(at) -> dict[str, dict]:
    """The page's panels (one chart each), by metric."""
    return {subplot_titles(s)[0]: s for s in charts(at)}


def test_opens_with_logged_and_recomputed_on_the_same_axes(app_run):
    at = open_app(app_run)
    assert "Latest logged step **4** (4 steps)" in _status(at)
    panels = _panels(at)
    assert list(panels) == at.multiselect(key="m_metrics").value
    spec = panels["critic/score/mean"]
    names = set(trace_names(spec))
    assert names == {"logged", "baseline"}
    # both sources in one panel share its axes
    axes = {(t["name"], t["xaxis"], t["yaxis"]) for t in spec["data"]}
    assert {("logged", "x", "y"), ("baseline", "x", "y")} <= axes
    assert _xs(spec, "logged") == [1, 2, 3, 4] and _xs(spec, "baseline") == [1, 2, 3, 4, 5, 6]


def test_choosing_metrics_changes_the_panels(app_run):
    at = open_app(app_run)
    at.multiselect(key="m_metrics").set_value(["perf/throughput", "actor/pg_loss"]).run()
    panels = _panels(at)
    assert list(panels) == ["perf/throughput", "actor/pg_loss"]
    perf = panels["perf/throughput"]["data"]
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
    assert {n for s in charts(at) for n in trace_names(s)} == {"logged"}


def test_lines_appended_to_metrics_jsonl_appear(app_run):
    at = open_app(app_run)
    m = app_run / "metrics.jsonl"
    with m.open("a") as fh:
        fh.write(json.dumps({"step": 5, "data": {"critic/score/mean": 0.77}}) + "\n")
        fh.write('{"step": 6, "data": {"critic/score/mean": 0.')  # still being written
    at.run()
    assert not at.exception
    assert "Latest logged step **5** (5 steps)" in _status(at)
    assert charts(at)
    score_panel = [t for t in _panels(at)["critic/score/mean"]["data"] if t["name"] == "logged"][0]
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


def _spiky_run(tmp_path, with_time=False):
    run = tmp_path / "spiky"
    (run / "batches").mkdir(parents=True)
    with (run / "metrics.jsonl").open("w") as fh:
        for s in range(1, 201):
            data = {"actor/grad_norm": 1e4 if s == 100 else 1.0 + 0.01 * (s % 5), "critic/score/mean": 0.01 * s}
            if with_time:
                data["_timestamp"] = 1.7e9 + 30.0 * s
            fh.write(json.dumps({"step": s, "data": data}) + "\n")
    return run


def test_log_scale_and_outlier_clipping(tmp_path):
    at = open_app(_spiky_run(tmp_path), m_metrics=["critic/score/mean", "actor/grad_norm"])
    spec = _panels(at)["actor/grad_norm"]
    assert "range" not in spec["layout"]["yaxis"] and spec["layout"]["yaxis"].get("type") != "log"
    at.toggle(key="m_clip").set_value(True).run()
    lo, hi = _panels(at)["actor/grad_norm"]["layout"]["yaxis"]["range"]
    assert hi < 2.0 and lo > 0.9  # the 1e4 spike no longer sets the axis
    at.toggle(key="m_clip").set_value(False).run()
    at.toggle(key="m_log").set_value(True).run()
    assert all(s["layout"]["yaxis"]["type"] == "log" for s in charts(at))


def test_x_by_wall_time_when_the_run_logs_a_timestamp(tmp_path):
    at = open_app(_spiky_run(tmp_path / "a"))
    assert at.radio(key="m_x").options == ["step"]
    at = open_app(_spiky_run(tmp_path / "b", with_time=True))
    assert at.radio(key="m_x").options == ["step", "wall time"]
    at.radio(key="m_x").set_value("wall_time").run()
    trace = charts(at)[0]["data"][0]
    assert str(trace["x"][0]).startswith("2023-11-14") and trace["customdata"][0] == 1  # x is time, the step rides along


def test_the_view_comes_from_the_url(app_run):
    at = AppTest.from_file(str(APP), default_timeout=90)
    at.session_state["run_path"] = str(app_run)
    at.query_params["metrics"] = ["perf/throughput", "actor/pg_loss"]
    at.run()
    assert at.multiselect(key="m_metrics").value == ["perf/throughput", "actor/pg_loss"]
    assert list(_panels(at)) == ["perf/throughput", "actor/pg_loss"]
    at.multiselect(key="m_metrics").set_value(["actor/pg_loss"]).run()
    assert at.query_params["metrics"] == "actor/pg_loss" and at.query_params["run"] == str(app_run)


def test_identical_lines_are_named(app_run):
    recompute(app_run, save_tokens=False, device="cpu", name="same")
    at = open_app(app_run, m_metrics=["actor/pg_loss", "critic/score/mean"])
    assert not any("are identical" in c.value for c in at.caption)
    at.multiselect(key="m_scenarios").set_value(["baseline", "same"]).run()
    note = next(c.value for c in at.caption if "are identical" in c.value)
    assert "**baseline** and **same** are identical" in note


def test_no_metrics_logged_is_said_so(tmp_path):
    from rldiag.synth import SynthSpec, write_synth_run

    run = write_synth_run(tmp_path / "r", SynthSpec(steps=2, write_metrics=False))
    at = open_app(run)
    assert any("No metrics logged yet" in i.value for i in at.info)
    assert not charts(at)


def test_another_run_overlaid(app_run, tmp_path):
    other = _spiky_run(tmp_path)
    at = open_app(app_run, other_runs=str(other))
    at.multiselect(key="m_metrics").set_value(["critic/score/mean"]).run()
    names = set(trace_names(charts(at)[0]))
    assert names == {"run · logged", "run · baseline", "spiky · logged"}
    xs = {t["name"]: t["x"] for t in charts(at)[0]["data"]}
    assert len(xs["spiky · logged"]) == 200 and xs["run · logged"] == [1, 2, 3, 4]


def test_a_panels_data_exports_as_csv(app_run):
    at = open_app(app_run)
    assert at.selectbox(key="m_export").options == at.multiselect(key="m_metrics").value
    store = Store(app_run)
    csv = panel_csv(store.joined(["actor/pg_loss"], ["baseline"]), "actor/pg_loss", store.source_columns(["baseline"]))
    lines = csv.decode().splitlines()
    assert lines[0] == "step,logged,baseline" and len(lines) == 7 and lines[5].startswith("5,,")
