"""The metrics page's panels as Apache ECharts options (Streamlit's ``st.echarts_chart``).

The first page of the app draws with ECharts rather than plotly: Streamlit's ECharts component
is a quarter of its plotly one (about 1.2 MB of JavaScript against 4.7 MB), and on a two-core
machine evaluating the plotly bundle alone held the browser for 1.0-1.5 s before the first panel
could be drawn (docs/app.md). The other pages keep plotly.

One panel per metric, every source on the same axes: logged solid, scenarios and other runs
dashed; with smoothing, the raw values faint under the smoothed line. A panel knows the step of
each point it draws (:attr:`Panel.steps`), so a click on a point opens that step and a brushed
x range becomes a step range whatever the x axis (:func:`panel_action`). Inputs are the store's
polars frames (``step, metric, <source columns>``); nothing is computed here beyond laying the
values out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import polars as pl

from rldiag.viz.charts import source_colour

#: a line with at most this many points shows its points (else only the hovered one)
SYMBOL_POINTS = 60
#: height of a panel, in pixels
PANEL_HEIGHT = 320
#: top of the plotting area, in pixels (the title and the legend above it)
GRID_TOP = 56


@dataclass(frozen=True)
class Panel:
    """One metric's chart: the ECharts option, the step of every point of each series (in the
    option's series order), and a description for screen readers (``alt``), which also says
    what the panel shows (its metric, its sources and the steps they cover)."""

    spec: dict
    steps: tuple[tuple[int, ...], ...]
    alt: str


def _points(frame: pl.DataFrame, col: str, x: str, log_y: bool) -> pl.DataFrame:
    """``step, x, y`` of one source, finite values only (and positive ones on a log axis: ECharts
    cannot place the others), sorted by step."""
    y = pl.col(col).cast(pl.Float64)
    keep = y.is_not_null() & y.is_finite()
    if log_y:
        keep = keep & (y > 0)
    if x == "step":
        xs = pl.col("step")
    else:
        xs = pl.col(x).dt.epoch("ms")
        keep = keep & pl.col(x).is_not_null()
    return frame.filter(keep).sort("step").select(pl.col("step"), xs.alias("_x"), y.alias("_y"))


def _series(points: pl.DataFrame, name: str, colour: str, dashed: bool, faint: bool, selectable: bool = True) -> dict:
    data = [list(p) for p in zip(points["_x"].to_list(), points["_y"].to_list())]
    style: dict[str, object] = {"color": colour, "width": 1 if faint else 2, "type": "dashed" if dashed else "solid"}
    if faint:  # the raw values under a smoothed line: drawn, never hovered or picked
        style["opacity"] = 0.25
        return {"type": "line", "name": name, "data": data, "showSymbol": False, "silent": True,
                "lineStyle": style, "itemStyle": {"color": colour}, "emphasis": {"disabled": True},
                "tooltip": {"show": False}, "z": 1}
    out = {"type": "line", "name": name, "data": data, "lineStyle": style, "itemStyle": {"color": colour},
           "showSymbol": points.height <= SYMBOL_POINTS, "symbolSize": 6, "z": 2}
    if selectable:  # a click picks the point (its step: Panel.steps)
        out.update(selectedMode="single", select={"itemStyle": {"borderWidth": 3}})
    return out


def _y_axis(log_y: bool, y_range: tuple[float, float] | None) -> dict:
    if log_y:
        return {"type": "log"}
    axis: dict = {"type": "value", "scale": True}
    if y_range is not None:  # outliers clipped: the range of the bulk of the values, padded
        lo, hi = y_range
        pad = (hi - lo) * 0.05 or abs(hi) * 0.05 or 1.0
        axis.update(min=lo - pad, max=hi + pad)
    return axis


def metric_panel(frame: pl.DataFrame, metric: str, sources: Mapping[str, str], smoothed: pl.DataFrame | None = None,
                 log_y: bool = False, y_range: tuple[float, float] | None = None, x: str = "step",
                 selectable: bool = True) -> Panel:
    """The panel of ``metric``.

    ``frame``: the store's joined frame (``step, metric, <source columns>``, other metrics
    ignored); ``sources`` maps a legend name to its column; ``smoothed``: the same frame after
    EMA (the raw values are then drawn faint under it); ``log_y``: a logarithmic y axis;
    ``y_range``: the y range (outliers clipped, :meth:`Store.clip_bounds`); ``x``: ``step``, or
    ``wall_time`` (a datetime column, :meth:`Store.with_wall_time`); ``selectable``: points can be
    clicked and x ranges brushed (:func:`panel_action`); else the panel only shows.
    """
    mine = frame.filter(pl.col("metric") == metric) if "metric" in frame.columns else frame
    smooth = smoothed.filter(pl.col("metric") == metric) if smoothed is not None and "metric" in smoothed.columns else smoothed
    series: list[dict] = []
    steps: list[tuple[int, ...]] = []
    legend: list[str] = []
    covered: list[str] = []
    drawn: dict[tuple, str] = {}  # a drawn line's (steps, values) -> its label
    for i, (label, col) in enumerate(sources.items()):
        if col not in mine.columns:
            continue
        raw = _points(mine, col, x, log_y)
        if raw.is_empty():
            continue
        key = (tuple(raw["step"].to_list()), tuple(raw["_y"].to_list()))
        same = drawn.get(key)
        if same is not None:  # a scenario that cannot change this metric: its line would hide the other's
            first, last = raw["step"][0], raw["step"][-1]
            covered.append(f"{label} steps {first}-{last} (the same as {same}: not drawn)")
            continue
        drawn[key] = label
        colour, dashed = source_colour(i), i > 0
        line = raw
        if smooth is not None and col in smooth.columns:
            series.append(_series(raw, f"{label} (raw)", colour, dashed, faint=True))
            steps.append(tuple(raw["step"].to_list()))
            line = _points(smooth, col, x, log_y)
        series.append(_series(line, label, colour, dashed, faint=False, selectable=selectable))
        steps.append(tuple(line["step"].to_list()))
        legend.append(label)
        first, last = raw["step"][0], raw["step"][-1]
        covered.append(f"{label} steps {first}-{last}" if last != first else f"{label} step {first}")
    x_axis = {"type": "value", "min": "dataMin", "max": "dataMax"} if x == "step" else {"type": "time"}
    spec: dict = {
        "animation": False,
        "title": {"text": metric, "left": "center", "textStyle": {"fontSize": 13}},
        "legend": {"data": legend, "top": 22, "type": "scroll"},
        "grid": {"top": GRID_TOP},
        "tooltip": {"trigger": "axis"},
        "xAxis": x_axis,
        "yAxis": _y_axis(log_y, y_range),
        "series": series,
    }
    # ECharts' own export: PNG (SVG with the svg renderer the pages use), named after the metric
    save = {"saveAsImage": {"title": "Save as image", "name": metric.replace("/", "_"), "pixelRatio": 2}}
    spec["toolbox"] = {"right": 8, "feature": save}
    if selectable:  # a brushed x range zooms the page to those steps (read back by panel_action)
        spec["brush"] = {"xAxisIndex": "all", "brushType": "lineX", "brushMode": "single"}
        spec["toolbox"] = {"right": 8, "feature": {"brush": {"type": ["lineX", "clear"],
                                                             "title": {"lineX": "Zoom to steps", "clear": "Clear"}},
                                                   **save}}
    alt = f"{metric}: " + ("; ".join(covered) if covered else "no values in this range")
    # the description in the option itself too: ECharts then never puts its own generated one on
    # the chart, not even for the moment a panel is drawn again before Streamlit applies ``alt``
    spec["aria"] = {"enabled": True, "label": {"description": alt}}
    return Panel(spec=spec, steps=tuple(steps), alt=alt)


def panel_action(selection: Mapping | None, panel: Panel) -> tuple[str, object] | None:
    """What a selection on ``panel`` asks for: ``("zoom", (first, last))`` for an x range
    brushed over two or more steps, ``("step", n)`` for a clicked point, else None.

    ``selection`` is Streamlit's ECharts selection state (``selected``: per series the indices
    of the picked points; ``areas``: the brushed ranges, ``coord_range`` in x axis units).
    """
    sel = selection or {}
    for area in sel.get("areas") or []:
        rng = area.get("coord_range") or []
        if len(rng) != 2 or not all(isinstance(v, (int, float)) for v in rng):
            continue
        lo, hi = min(rng), max(rng)
        inside = [s for s, xv in _xs(panel) if lo <= xv <= hi]
        if len(set(inside)) >= 2:
            return "zoom", (min(inside), max(inside))
    for group in sel.get("selected") or []:
        k = group.get("series_index")
        idx = group.get("data_indices") or []
        if isinstance(k, int) and 0 <= k < len(panel.steps) and idx and 0 <= idx[0] < len(panel.steps[k]):
            return "step", int(panel.steps[k][idx[0]])
    return None


def _xs(panel: Panel):
    """(step, x) of every point of the panel's series."""
    for k, s in enumerate(panel.spec.get("series", [])):
        for step, point in zip(panel.steps[k], s["data"]):
            yield step, point[0]
