"""The sweep charts of the What-if page: their numbers are the summary's means over the steps."""

from __future__ import annotations

import math

import polars as pl
import pytest

from rldiag.viz import sweep as vsweep


def _summary(rows: list[tuple], keys: tuple[str, ...]) -> pl.DataFrame:
    cols = ["scenario", "step", "metric", "value", *keys]
    return pl.DataFrame(rows, schema=cols, orient="row").with_columns(pl.col("value").cast(pl.Float64))


ONE = _summary([
    ("c=0.3", 1, "loss", 1.0, "0.3"), ("c=0.3", 2, "loss", 3.0, "0.3"), ("c=0.3", 1, "kl", 5.0, "0.3"),
    ("c=0.1", 1, "loss", 4.0, "0.1"), ("c=0.1", 2, "loss", float("nan"), "0.1"), ("c=0.1", 1, "kl", 6.0, "0.1"),
    ("c=0.2", 1, "loss", -2.0, "0.2"), ("c=0.2", 2, "loss", 0.0, "0.2"), ("c=0.2", 1, "kl", 7.0, "0.2"),
], ("c",))


def test_the_line_is_the_mean_over_the_steps_in_the_values_order():
    fig = vsweep.line_figure(ONE, "c", "loss")
    (trace,) = fig.data
    assert list(trace.x) == [0.1, 0.2, 0.3]  # numbers, ascending (not the summary's order)
    assert list(trace.y) == [4.0, -1.0, 2.0]  # the NaN step of c=0.1 left out
    assert list(trace.customdata) == ["c=0.1", "c=0.2", "c=0.3"]
    kl = vsweep.line_figure(ONE, "c", "kl").data[0]
    assert list(kl.y) == [6.0, 7.0, 5.0]


def test_the_line_equals_the_summary_means():
    expect = (ONE.filter(pl.col("metric") == "loss").with_columns(pl.col("value").fill_nan(None))
              .group_by("c").agg(pl.col("value").mean()).sort("c"))
    trace = vsweep.line_figure(ONE, "c", "loss").data[0]
    assert list(trace.y) == pytest.approx(expect["value"].to_list())


def test_words_are_kept_in_their_order():
    s = _summary([("e=rloo", 1, "m", 1.0, "rloo"), ("e=grpo", 1, "m", 2.0, "grpo")], ("e",))
    trace = vsweep.line_figure(s, "e", "m").data[0]
    assert list(trace.x) == ["rloo", "grpo"] and list(trace.y) == [1.0, 2.0]


TWO = _summary([
    (f"a={a},b={b}", step, "m", a * 10 + b + step, str(a), b_text)
    for a in (1, 2) for b, b_text in ((0.5, "0.5"), (0.25, "0.25"), (1.0, "1.0")) for step in (1, 2)
], ("a", "b"))


def test_the_heatmap_cells_are_the_means_of_their_pair():
    x, y, z, names = vsweep.heatmap_cells(TWO, ["a", "b"], "m")
    assert x == ["1", "2"] and y == ["0.25", "0.5", "1.0"]
    for i, b in enumerate((0.25, 0.5, 1.0)):
        for j, a in enumerate((1, 2)):
            assert z[i][j] == pytest.approx(a * 10 + b + 1.5)  # the mean of steps 1 and 2
            assert names[i][j] == f"a={a},b={b}"
    fig = vsweep.heatmap_figure(TWO, ["a", "b"], "m")
    assert fig.data[0].z[0][1] == pytest.approx(21.75)
    assert fig.layout.xaxis.title.text == "a" and fig.layout.yaxis.title.text == "b"


def test_a_missing_pair_is_an_empty_cell():
    x, y, z, names = vsweep.heatmap_cells(TWO.filter(pl.col("scenario") != "a=2,b=1.0"), ["a", "b"], "m")
    assert z[2][1] is None and names[2][1] is None


def test_means_and_keys():
    assert vsweep.swept_keys(TWO) == ["a", "b"]
    m = vsweep.means(ONE, ["loss"])
    assert m.filter(pl.col("scenario") == "c=0.1")["value"].item() == 4.0
    assert vsweep.scenarios(ONE) == ["c=0.3", "c=0.1", "c=0.2"]
    assert vsweep.metric_names(ONE) == ["kl", "loss"]


def test_a_point_click_gives_its_scenario():
    assert vsweep.selected_scenario({"selection": {"points": [{"x": 1, "customdata": "c=0.1"}]}}) == "c=0.1"
    assert vsweep.selected_scenario({"selection": {"points": [{"customdata": ["c=0.2"]}]}}) == "c=0.2"
    assert vsweep.selected_scenario({"selection": {"points": []}}) is None
    assert vsweep.selected_scenario(None) is None


def test_value_lists():
    assert vsweep.default_values(0.0, 10.0, 5) == [0.0, 2.5, 5.0, 7.5, 10.0]
    assert vsweep.default_values(1.0, 100.0, 1) == [1.0]
    assert vsweep.parse_values(vsweep.values_text([0.1, 0.2])) == [0.1, 0.2]
    assert vsweep.parse_values("0.1 0.2, 0.1") == [0.1, 0.2]
    with pytest.raises(ValueError, match="'x'"):
        vsweep.parse_values("0.1, x")
    assert all(math.isfinite(v) for v in vsweep.default_values(0.0, 1000.0))


def test_the_sweepable_keys_have_widgets():
    from rldiag.config import schema

    keys = vsweep.sweepable_keys()
    assert keys[0] == "algorithm.adv_estimator"
    for k in keys[1:]:
        assert schema.widget(k).hi > schema.widget(k).lo
    assert vsweep.scenario_count({"a": [1, 2], "b": [1, 2, 3]}) == 6


def test_the_runs_own_scenario_is_marked_and_centres_the_heatmaps_scale():
    """The run's own scenario (a=1, b=0.5: the mean of steps 1 and 2, 12) centres a diverging
    scale symmetric about its value, blue above and red below, its cell outlined and the range
    printed relative to it."""
    own = "a=1,b=0.5"
    fig = vsweep.heatmap_figure(TWO, ["a", "b"], "m", own)
    hm = fig.data[0]
    centre = 10 + 0.5 + 1.5
    assert hm.zmid == pytest.approx(centre)
    span = 20 + 1.0 + 1.5 - centre  # the farthest cell, a=2 b=1.0
    assert (hm.zmin, hm.zmax) == pytest.approx((centre - span, centre + span))
    assert hm.colorscale[0][1] == "rgb(103,0,31)" and hm.colorscale[-1][1] == "rgb(5,48,97)"  # RdBu: red low, blue high
    (rect,) = fig.layout.shapes
    assert (rect.x0, rect.x1, rect.y0, rect.y1) == (-0.5, 0.5, 0.5, 1.5)  # x "1" is column 0, y "0.5" row 1
    lo, hi = 10 + 0.25 + 1.5, 20 + 1.0 + 1.5
    assert f"range {lo:.4g} to {hi:.4g} ({(hi - lo) / centre:.2%} of the run's own {centre:.4g})" in fig.layout.title.text
    # without it: the sequential scale, no outline
    plain = vsweep.heatmap_figure(TWO, ["a", "b"], "m")
    assert plain.data[0].zmid is None and not plain.layout.shapes
    # the line: the run's own point as a star, and the range
    line = vsweep.line_figure(ONE, "c", "loss", "c=0.2")
    star = line.data[1]
    assert list(star.x) == [0.2] and list(star.y) == [-1.0] and star.marker.symbol == "star"
    assert "range -1 to 4 (500.00% of the run's own -1)" in line.layout.title.text  # the spread over |own|
    marked = vsweep.mark_own(vsweep.means(ONE, ["loss"]), "c=0.2")
    assert marked.columns[0] == "own" and marked.filter(pl.col("own") == "*")["scenario"].to_list() == ["c=0.2"]
