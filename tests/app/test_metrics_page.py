"""The training-metrics page in Streamlit's AppTest: widgets change the panels (ECharts options);
growth shows up."""

from __future__ import annotations

import json

from streamlit.testing.v1 import AppTest

from rldiag.scenario.recompute import recompute
from rldiag.store import Store
from rldiag.viz.panels import panel_csv
from tests.app.helpers import APP, open_app, panels, request_sent_now, series, series_names, xs, ys


def _status(at) -> str:
    return next(m.value for m in at.markdown if m.value.startswith("Latest logged step") or m.value.startswith("No logged"))


def _first(at) -> dict:
    return next(iter(panels(at).values()))


def test_opens_with_logged_and_recomputed_on_the_same_axes(app_run):
    at = open_app(app_run)
    assert "Latest logged step **4** (4 steps)" in _status(at)
    shown = panels(at)
    assert list(shown) == at.multiselect(key="m_metrics").value
    spec = shown["critic/score/mean"]
    assert series_names(spec) == ["logged", "baseline"]  # one panel, one pair of axes, both sources
    assert series(spec, "logged")["lineStyle"]["type"] == "solid" and series(spec, "baseline")["lineStyle"]["type"] == "dashed"
    assert xs(spec, "logged") == [1, 2, 3, 4] and xs(spec, "baseline") == [1, 2, 3, 4, 5, 6]
    assert spec["alt"] == "critic/score/mean: logged steps 1-4; baseline steps 1-6"


def test_choosing_metrics_changes_the_panels(app_run):
    at = open_app(app_run)
    at.multiselect(key="m_metrics").set_value(["perf/throughput", "actor/pg_loss"]).run()
    shown = panels(at)
    assert list(shown) == ["perf/throughput", "actor/pg_loss"]
    perf = shown["perf/throughput"]
    assert series_names(perf) == ["logged"] and set(ys(perf, "logged")) == {1234.0}


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
    raw = ys(_first(at), "baseline")
    at.slider(key="m_ema").set_value(0.8).run()
    spec = _first(at)
    faint, smooth = ys(spec, "baseline (raw)"), ys(spec, "baseline")  # raw drawn faint under the smoothed line
    assert faint == raw and series(spec, "baseline (raw)")["lineStyle"]["opacity"] < 1
    assert series(spec, "baseline (raw)")["silent"] and "baseline (raw)" not in spec["legend"]["data"]
    assert smooth[0] == raw[0] and smooth[1:] != raw[1:]
    assert max(smooth) - min(smooth) < max(raw) - min(raw)


def test_step_range_and_overlay(app_run):
    at = open_app(app_run)
    at.slider(key="m_range").set_value((2, 3)).run()
    spec = _first(at)
    assert xs(spec, "logged") == [2, 3] and xs(spec, "baseline") == [2, 3]
    at.multiselect(key="m_scenarios").set_value([]).run()
    assert {n for s in panels(at).values() for n in series_names(s)} == {"logged"}


def test_lines_appended_to_metrics_jsonl_appear(app_run):
    at = open_app(app_run)
    m = app_run / "metrics.jsonl"
    with m.open("a") as fh:
        fh.write(json.dumps({"step": 5, "data": {"critic/score/mean": 0.77}}) + "\n")
        fh.write('{"step": 6, "data": {"critic/score/mean": 0.')  # still being written
    at.run()
    assert not at.exception
    assert "Latest logged step **5** (5 steps)" in _status(at)
    score = panels(at)["critic/score/mean"]
    assert xs(score, "logged")[-1] == 5 and ys(score, "logged")[-1] == 0.77
    assert "logged steps 1-5" in score["alt"]
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
    assert xs(_first(at), "logged") == [2, 3, 4, 5]
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
    axis = panels(at)["actor/grad_norm"]["yAxis"]
    assert "max" not in axis and axis["type"] == "value"
    at.toggle(key="m_clip").set_value(True).run()
    axis = panels(at)["actor/grad_norm"]["yAxis"]
    assert axis["max"] < 2.0 and axis["min"] > 0.9  # the 1e4 spike no longer sets the axis
    at.toggle(key="m_clip").set_value(False).run()
    at.toggle(key="m_log").set_value(True).run()
    assert all(s["yAxis"]["type"] == "log" for s in panels(at).values())


def test_x_by_wall_time_when_the_run_logs_a_timestamp(tmp_path):
    at = open_app(_spiky_run(tmp_path / "a"))
    assert at.toggle(key="m_wall").disabled and "logs none" in at.toggle(key="m_wall").help
    assert _first(at)["xAxis"]["type"] == "value"
    at = open_app(_spiky_run(tmp_path / "b", with_time=True))
    assert not at.toggle(key="m_wall").disabled and _first(at)["xAxis"]["type"] == "value"
    at.toggle(key="m_wall").set_value(True).run()
    spec = _first(at)
    assert spec["xAxis"]["type"] == "time"
    assert xs(spec, "logged")[:2] == [1_700_000_030_000, 1_700_000_060_000]  # ms since the epoch, step by step


def test_the_view_comes_from_the_url(app_run):
    at = AppTest.from_file(str(APP), default_timeout=90)
    at.session_state["run_path"] = str(app_run)
    at.query_params["metrics"] = ["perf/throughput", "actor/pg_loss"]
    at.run()
    assert at.multiselect(key="m_metrics").value == ["perf/throughput", "actor/pg_loss"]
    assert list(panels(at)) == ["perf/throughput", "actor/pg_loss"]
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
    # the baseline computed on open is drawn meanwhile
    assert panels(at) and all(series_names(p) == ["baseline"] for p in panels(at).values())
    empty = write_synth_run(tmp_path / "e", SynthSpec(steps=2, write_metrics=False))
    for f in (empty / "batches").iterdir():
        f.unlink()
    at = open_app(empty)
    assert any("No metrics logged yet" in i.value for i in at.info)
    assert not panels(at)


def test_another_run_overlaid(app_run, tmp_path):
    other = _spiky_run(tmp_path)
    at = open_app(app_run, other_runs=str(other))
    at.multiselect(key="m_metrics").set_value(["critic/score/mean"]).run()
    spec = _first(at)
    assert set(series_names(spec)) == {"run · logged", "run · baseline", "spiky · logged"}
    assert len(xs(spec, "spiky · logged")) == 200 and xs(spec, "run · logged") == [1, 2, 3, 4]


def test_a_panels_data_exports_as_csv(app_run):
    at = open_app(app_run)
    assert not at.selectbox  # the export's widgets wait until asked for
    at.toggle(key="m_export_on").set_value(True).run()
    assert at.selectbox(key="m_export").options == at.multiselect(key="m_metrics").value
    assert at.get("download_button")
    store = Store(app_run)
    csv = panel_csv(store.joined(["actor/pg_loss"], ["baseline"]), "actor/pg_loss", store.source_columns(["baseline"]))
    lines = csv.decode().splitlines()
    assert lines[0] == "step,logged,baseline" and len(lines) == 7 and lines[5].startswith("5,,")


def test_a_request_sent_before_the_page_was_drawn_again_undoes_nothing(app_run, tmp_path, monkeypatch):
    """The browser sends every widget's state with each request, the panels' timer's (every
    second) included: one sent before it drew the page's last run carries the widgets as they
    were then. The baseline the page added to the overlay when the worker wrote it, and a zoom
    drawn on a panel, stay (Streamlit would apply the old values over the page's, and call the
    overlay's on_change as if it had been changed by hand: the baseline left the panels for good)."""
    from rldiag.app import worker

    monkeypatch.setattr(worker, "MODE", "off")  # the baseline lands when the test says so
    scenario = app_run / "rldiag" / "scenarios" / "baseline"
    scenario.rename(tmp_path / "away")
    at = open_app(app_run)
    assert series_names(_first(at)) == ["logged"] and at.multiselect(key="m_scenarios").value == []
    sent = request_sent_now(at)  # the panels' timer fires: the widgets as the browser has them
    (tmp_path / "away").rename(scenario)  # the background baseline is written
    at.run()  # the baseline's fragment saw it: the whole page again
    assert series_names(_first(at)) == ["logged", "baseline"]
    sent()  # ... and is taken after that run, which the browser had not drawn when it sent it
    at.run()
    spec = _first(at)
    assert series_names(spec) == ["logged", "baseline"] and xs(spec, "baseline") == [1, 2, 3, 4, 5, 6]
    assert "m_scenarios_auto" not in at.session_state  # the overlay was not changed by hand

    sent = request_sent_now(at)
    at.session_state["m_zoom"] = (2, 3)  # a box drawn over steps 2-3 of a panel (metrics._on_select)
    at.run()
    assert xs(_first(at), "logged") == [2, 3]
    sent()  # a request sent before the browser drew the zoom
    at.run()
    spec = _first(at)
    assert xs(spec, "logged") == [2, 3] and xs(spec, "baseline") == [2, 3]
    assert spec["alt"] == "critic/score/mean: logged steps 2-3; baseline steps 2-3"
