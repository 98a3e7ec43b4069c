"""The metrics page's ECharts panels (rldiag.viz.echarts): what each panel draws, and what a
click or a brushed range on it asks for."""

from __future__ import annotations

import datetime as dt
import json

import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st

from rldiag.viz.charts import source_colour
from rldiag.viz.echarts import SYMBOL_POINTS, metric_panel, panel_action

SOURCES = {"logged": "logged", "baseline": "base"}


def _frame():
    return pl.DataFrame({
        "step": [1, 2, 3, 4, 1, 2],
        "metric": ["a", "a", "a", "a", "b", "b"],
        "logged": [1.0, None, float("nan"), 4.0, 7.0, 8.0],
        "base": [1.5, 2.5, float("inf"), 4.5, None, None],
    })


def _series(panel, name):
    (s,) = [s for s in panel.spec["series"] if s["name"] == name]
    return s


def test_a_panel_draws_its_metrics_finite_values_of_every_source():
    p = metric_panel(_frame(), "a", SOURCES)
    assert [s["name"] for s in p.spec["series"]] == ["logged", "baseline"]
    assert _series(p, "logged")["data"] == [[1, 1.0], [4, 4.0]]  # null, NaN and inf are not drawn
    assert _series(p, "baseline")["data"] == [[1, 1.5], [2, 2.5], [4, 4.5]]
    assert p.steps == ((1, 4), (1, 2, 4))
    assert _series(p, "logged")["lineStyle"]["color"] == source_colour(0)
    assert _series(p, "baseline")["lineStyle"] == {"color": source_colour(1), "width": 2, "type": "dashed"}
    assert p.spec["title"]["text"] == "a" and p.spec["legend"]["data"] == ["logged", "baseline"]
    assert p.alt == "a: logged steps 1-4; baseline steps 1-4"
    assert p.spec["aria"] == {"enabled": True, "label": {"description": p.alt}}  # ECharts' own text never shows
    json.dumps(p.spec, allow_nan=False)  # what Streamlit sends must be strict JSON


def test_a_panel_that_only_shows_has_no_brush_and_no_picking():
    p = metric_panel(_frame(), "a", SOURCES, selectable=False)
    # its only tool: ECharts' own save-as-image (the selectable panel has it beside the brush)
    assert "brush" not in p.spec and list(p.spec["toolbox"]["feature"]) == ["saveAsImage"]
    assert p.spec["toolbox"]["feature"]["saveAsImage"]["name"] == "a"
    assert list(metric_panel(_frame(), "a", SOURCES).spec["toolbox"]["feature"]) == ["brush", "saveAsImage"]
    assert all("selectedMode" not in s for s in p.spec["series"])
    assert p.steps == metric_panel(_frame(), "a", SOURCES).steps and "brush" in metric_panel(_frame(), "a", SOURCES).spec


def test_other_metrics_and_missing_sources_stay_out():
    p = metric_panel(_frame(), "b", {**SOURCES, "absent": "nope"})
    assert [s["name"] for s in p.spec["series"]] == ["logged"] and p.steps == ((1, 2),)
    empty = metric_panel(_frame(), "zzz", SOURCES)
    assert empty.spec["series"] == [] and empty.alt == "zzz: no values in this range"


def test_short_lines_show_their_points_long_ones_only_the_hovered_one():
    short = pl.DataFrame({"step": list(range(SYMBOL_POINTS)), "metric": "m", "logged": 1.0})
    long = pl.DataFrame({"step": list(range(SYMBOL_POINTS + 1)), "metric": "m", "logged": 1.0})
    assert metric_panel(short, "m", {"logged": "logged"}).spec["series"][0]["showSymbol"] is True
    assert metric_panel(long, "m", {"logged": "logged"}).spec["series"][0]["showSymbol"] is False


def test_log_axis_drops_what_it_cannot_place_and_clipping_pads_the_range():
    f = pl.DataFrame({"step": [1, 2, 3], "metric": "m", "logged": [-1.0, 0.0, 10.0]})
    p = metric_panel(f, "m", {"logged": "logged"}, log_y=True)
    assert p.spec["yAxis"] == {"type": "log"} and p.spec["series"][0]["data"] == [[3, 10.0]] and p.steps == ((3,),)
    clipped = metric_panel(f, "m", {"logged": "logged"}, y_range=(0.0, 2.0))
    assert clipped.spec["yAxis"] == {"type": "value", "scale": True, "min": -0.1, "max": 2.1}
    assert metric_panel(f, "m", {"logged": "logged"}, log_y=True, y_range=(0.0, 2.0)).spec["yAxis"] == {"type": "log"}


def test_smoothing_draws_the_raw_values_faint_and_silent_under_the_line():
    f = pl.DataFrame({"step": [1, 2, 3], "metric": "m", "logged": [0.0, 3.0, 0.0]})
    sm = f.with_columns(pl.Series("logged", [0.0, 1.5, 0.75]))
    p = metric_panel(f, "m", {"logged": "logged"}, smoothed=sm)
    faint, line = p.spec["series"]
    assert faint["name"] == "logged (raw)" and faint["silent"] and faint["lineStyle"]["opacity"] < 1
    assert faint["data"] == [[1, 0.0], [2, 3.0], [3, 0.0]] and line["data"] == [[1, 0.0], [2, 1.5], [3, 0.75]]
    assert "selectedMode" not in faint and line["selectedMode"] == "single"
    assert p.spec["legend"]["data"] == ["logged"] and p.steps == ((1, 2, 3), (1, 2, 3))


def test_wall_time_on_x_with_each_points_step_kept():
    t0 = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc).replace(tzinfo=None)
    f = pl.DataFrame({"step": [5, 6, 7], "metric": "m", "logged": [1.0, 2.0, 3.0],
                      "wall_time": [t0, None, t0 + dt.timedelta(seconds=90)]})
    p = metric_panel(f, "m", {"logged": "logged"}, x="wall_time")
    ms = int(t0.replace(tzinfo=dt.timezone.utc).timestamp() * 1000)
    assert p.spec["xAxis"] == {"type": "time"}
    assert p.spec["series"][0]["data"] == [[ms, 1.0], [ms + 90_000, 3.0]] and p.steps == ((5, 7),)
    # a brushed time range is the steps of the points inside it
    assert panel_action({"areas": [{"coord_range": [ms - 1, ms + 90_000]}]}, p) == ("zoom", (5, 7))
    assert panel_action({"selected": [{"series_index": 0, "data_indices": [1]}]}, p) == ("step", 7)


def test_a_click_opens_the_points_step_and_a_brushed_range_zooms():
    f = pl.DataFrame({"step": [10, 20, 30, 40], "metric": "m", "logged": [1.0, 2.0, 3.0, 4.0],
                      "base": [None, 1.0, 1.0, 1.0]})
    sm = f.with_columns(pl.col("logged") * 0.5, pl.col("base") * 0.5)
    p = metric_panel(f, "m", SOURCES, smoothed=sm)
    assert [s["name"] for s in p.spec["series"]] == ["logged (raw)", "logged", "baseline (raw)", "baseline"]
    assert panel_action({"selected": [{"series_index": 3, "data_indices": [0]}], "areas": []}, p) == ("step", 20)
    assert panel_action({"selected": [{"series_index": 1, "data_indices": [2]}]}, p) == ("step", 30)
    assert panel_action({"areas": [{"coord_range": [12.5, 33.0]}]}, p) == ("zoom", (20, 30))
    assert panel_action({"areas": [{"coord_range": [15, 25]}]}, p) is None  # one step: nothing to zoom into
    assert panel_action({"selected": [{"series_index": 9, "data_indices": [0]}]}, p) is None
    assert panel_action({"selected": [{"series_index": 1, "data_indices": [99]}]}, p) is None
    assert panel_action({"selected": [], "areas": []}, p) is None and panel_action(None, p) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True))),
                min_size=0, max_size=40, unique_by=lambda t: t[0]))
def test_every_drawn_point_knows_its_step(points):
    f = pl.DataFrame({"step": [s for s, _ in points], "metric": ["m"] * len(points),
                      "logged": [v for _, v in points]}, schema={"step": pl.Int64, "metric": pl.String, "logged": pl.Float64})
    p = metric_panel(f, "m", {"logged": "logged"})
    finite = sorted((s, v) for s, v in points if v is not None and v == v and abs(v) != float("inf"))
    drawn = p.spec["series"][0]["data"] if p.spec["series"] else []
    assert [tuple(d) for d in drawn] == finite
    assert (p.steps[0] if p.steps else ()) == tuple(s for s, _ in finite)
    for i, (s, _) in enumerate(finite):
        assert panel_action({"selected": [{"series_index": 0, "data_indices": [i]}]}, p) == ("step", s)
    json.dumps(p.spec, allow_nan=False)


def test_a_scenario_that_cannot_change_a_metric_is_not_drawn_over_the_baseline():
    """An estimator scenario's entropy is the baseline's, bit for bit: drawing it would hide the
    baseline's line; it is left out and the panel's description says so."""
    frame = _frame().with_columns(pl.col("base").alias("same"), (pl.col("base") + 1).alias("moved"))
    p = metric_panel(frame, "a", {**SOURCES, "rloo": "same", "clip": "moved"})
    assert [s["name"] for s in p.spec["series"]] == ["logged", "baseline", "clip"]
    assert p.spec["legend"]["data"] == ["logged", "baseline", "clip"]
    assert "rloo steps 1-4 (the same as baseline: not drawn)" in p.alt and "clip steps 1-4" in p.alt
