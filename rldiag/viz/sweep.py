"""The What-if page's sweep section: the values a swept key takes, and each metric's mean over
the steps against the swept values (a line for one key, a heatmap for two), from a sweep's
summary (``summary.parquet``: ``scenario``, ``step``, ``metric``, ``value`` and one string column
per swept key, its value as YAML text)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
import polars as pl

from rldiag.viz.charts import source_colour
from rldiag.viz.colours import DIVERGING

#: the summary's own columns; every other column is a swept key
SUMMARY_COLUMNS = ("scenario", "step", "metric", "value")
#: how many values a numeric key's default list has
DEFAULT_COUNT = 5


def swept_keys(summary: pl.DataFrame) -> list[str]:
    """The swept keys of a summary, in its column order (the grid's)."""
    return [c for c in summary.columns if c not in SUMMARY_COLUMNS]


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def value_order(texts: Sequence[str]) -> list[str]:
    """A key's distinct values (YAML text): ascending when every one is a number, else in the
    order they first come."""
    distinct = list(dict.fromkeys(texts))
    if distinct and all(_number(t) is not None for t in distinct):
        return sorted(distinct, key=lambda t: _number(t) or 0.0)
    return distinct


def means(summary: pl.DataFrame, metrics: Sequence[str] | None = None) -> pl.DataFrame:
    """One row per scenario and metric: the swept keys' values and the mean of the metric over
    the steps (NaN steps left out; null when it has none)."""
    keys = swept_keys(summary)
    frame = summary if metrics is None else summary.filter(pl.col("metric").is_in(list(metrics)))
    return (frame.with_columns(pl.col("value").fill_nan(None))
            .group_by("scenario", *keys, "metric", maintain_order=True).agg(pl.col("value").mean()))


def metric_names(summary: pl.DataFrame) -> list[str]:
    return sorted(summary["metric"].unique().to_list()) if summary.height else []


def scenarios(summary: pl.DataFrame) -> list[str]:
    """The sweep's scenarios, in the summary's order."""
    return list(dict.fromkeys(summary["scenario"].to_list()))


def line_points(summary: pl.DataFrame, key: str, metric: str) -> pl.DataFrame:
    """``value`` (the key's value, YAML text), ``mean`` and ``scenario`` per point of the line of
    ``metric`` against ``key``, in :func:`value_order`."""
    m = means(summary, [metric]).select(pl.col(key).alias("value"), pl.col("value").alias("mean"), "scenario")
    order = {t: i for i, t in enumerate(value_order(m["value"].to_list()))}
    return m.with_columns(pl.col("value").replace_strict(order, return_dtype=pl.Int64).alias("_o")).sort("_o").drop("_o")


def _axis(texts: list[str]) -> list[Any]:
    nums = [_number(t) for t in texts]
    return list(texts) if any(n is None for n in nums) else nums


def _own_value(points: pl.DataFrame, own: str | None) -> float | None:
    """The mean of the run's own scenario among ``points`` (``scenario``, ``mean``), None when absent."""
    if own is None:
        return None
    hit = points.filter(pl.col("scenario") == own)["mean"].to_list()
    return float(hit[0]) if hit and hit[0] is not None and math.isfinite(hit[0]) else None


def range_text(values: Sequence[float | None], own_value: float | None) -> str:
    """``range 0.0411-0.0423 (2.9 % of the run's own 0.0417)``: what the figure's scale spans,
    relative to the run's own value where there is one, so that a small spread reads as small."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return "no value"
    lo, hi = min(finite), max(finite)
    text = f"range {lo:.4g} to {hi:.4g}"
    if own_value is not None:
        rel = f"{(hi - lo) / abs(own_value):.2%} of " if own_value else ""
        text += f" ({rel}the run's own {own_value:.4g})"
    return text


def line_figure(summary: pl.DataFrame, key: str, metric: str, own: str | None = None) -> go.Figure:
    """The mean over the steps of ``metric`` against the values of ``key`` (a point per
    scenario; each point's ``customdata`` is its scenario, for a click to open it); ``own``: the
    scenario with the run's own settings, marked (a star) and named in the title with the range."""
    pts = line_points(summary, key, metric)
    fig = go.Figure(go.Scatter(x=_axis(pts["value"].to_list()), y=pts["mean"].to_list(), mode="lines+markers",
                               name=metric, customdata=pts["scenario"].to_list(), line=dict(color=source_colour(0)),
                               hovertemplate=f"{key}=%{{x}}<br>{metric}=%{{y}}<br>%{{customdata}}<extra></extra>"))
    mine = pts.filter(pl.col("scenario") == own) if own is not None else pts.clear()
    if mine.height:
        fig.add_trace(go.Scatter(x=_axis(mine["value"].to_list()), y=mine["mean"].to_list(), mode="markers",
                                 name="the run's own settings", customdata=mine["scenario"].to_list(),
                                 marker=dict(symbol="star", size=14, color=source_colour(1)),
                                 hovertemplate="the run's own settings<br>%{y}<extra></extra>"))
    title = f"{metric}<br><sup>{range_text(pts['mean'].to_list(), _own_value(pts, own))}</sup>"
    fig.update_layout(height=300, margin=dict(l=40, r=20, t=50, b=40), title=title, xaxis_title=key,
                      yaxis_title="mean over steps", showlegend=False, yaxis=dict(tickformat=".3~g", nticks=5))
    return fig


def heatmap_cells(summary: pl.DataFrame, keys: Sequence[str], metric: str
                  ) -> tuple[list[str], list[str], list[list[float | None]], list[list[str | None]]]:
    """``(x, y, z, names)`` of the heatmap of ``metric`` over two keys: ``x`` the first key's
    values, ``y`` the second's (:func:`value_order`), ``z[i][j]`` the mean over the steps at
    ``(y[i], x[j])`` and ``names[i][j]`` its scenario (None where no scenario has that pair)."""
    kx, ky = keys[0], keys[1]
    m = means(summary, [metric])
    x = value_order(m[kx].to_list())
    y = value_order(m[ky].to_list())
    z: list[list[float | None]] = [[None] * len(x) for _ in y]
    names: list[list[str | None]] = [[None] * len(x) for _ in y]
    xi, yi = {t: j for j, t in enumerate(x)}, {t: i for i, t in enumerate(y)}
    for r in m.iter_rows(named=True):
        i, j = yi[r[ky]], xi[r[kx]]
        z[i][j], names[i][j] = r["value"], r["scenario"]
    return x, y, z, names


def heatmap_figure(summary: pl.DataFrame, keys: Sequence[str], metric: str, own: str | None = None) -> go.Figure:
    """The mean over the steps of ``metric`` for each pair of values of two keys (x the first,
    y the second); each cell's ``customdata`` is its scenario. With ``own`` (the scenario with
    the run's own settings) in the grid, the scale is the app's diverging one (:mod:`.colours`)
    centred on its value, blue above and red below, symmetric about it, and its cell is outlined;
    the title prints the range relative to it. Without, a sequential scale over the range."""
    x, y, z, names = heatmap_cells(summary, keys, metric)
    flat = [v for row in z for v in row]
    cells = [(i, j) for i, row in enumerate(names) for j, n in enumerate(row) if own is not None and n == own]
    centre = z[cells[0][0]][cells[0][1]] if cells else None
    kw: dict[str, Any] = {"colorscale": "Viridis"}
    if centre is not None and math.isfinite(centre):
        span = max((abs(v - centre) for v in flat if v is not None and math.isfinite(v)), default=0.0) or 1.0
        kw = {"colorscale": DIVERGING, "zmid": centre, "zmin": centre - span, "zmax": centre + span}
    fig = go.Figure(go.Heatmap(x=[str(v) for v in x], y=[str(v) for v in y], z=z, customdata=names,
                               texttemplate="%{z:.3g}", colorbar=dict(tickformat=".3~g", nticks=5),
                               hovertemplate=f"{keys[0]}=%{{x}}<br>{keys[1]}=%{{y}}<br>{metric}=%{{z}}"
                                             "<br>%{customdata}<extra></extra>", **kw))
    for i, j in cells:  # the run's own cell, outlined
        fig.add_shape(type="rect", xref="x", yref="y", x0=j - 0.5, x1=j + 0.5, y0=i - 0.5, y1=i + 0.5,
                      line=dict(color="black", width=3), name="the run's own settings")
    title = f"{metric}<br><sup>{range_text(flat, centre)}</sup>"
    fig.update_layout(height=340, margin=dict(l=60, r=20, t=50, b=40), title=title, xaxis_title=keys[0],
                      yaxis_title=keys[1], xaxis_type="category", yaxis_type="category")
    return fig


def selected_scenario(event: Any) -> str | None:
    """The scenario of the first point a plotly selection event (``st.plotly_chart(...,
    on_select="rerun")``) picked (its ``customdata``), or None."""
    try:
        points = event["selection"]["points"]
    except (KeyError, TypeError):
        return None
    for p in points or ():
        data = p.get("customdata") if isinstance(p, dict) else None
        if isinstance(data, (list, tuple)):
            data = data[0] if data else None
        if isinstance(data, str) and data:
            return data
    return None


def default_values(lo: float, hi: float, count: int = DEFAULT_COUNT) -> list[float]:
    """``count`` values evenly from ``lo`` to ``hi`` (a number widget's bounds), rounded to 6
    significant digits."""
    count = max(1, int(count))
    if count == 1:
        return [float(lo)]
    return [float(f"{lo + (hi - lo) * i / (count - 1):.6g}") for i in range(count)]


def values_text(values: Sequence[float]) -> str:
    return ", ".join(f"{v:g}" for v in values)


def parse_values(text: str) -> list[float]:
    """A comma (or space) separated list of numbers; raises ValueError naming a bad one."""
    out: list[float] = []
    for part in text.replace(",", " ").split():
        value = _number(part)
        if value is None:
            raise ValueError(f"{part!r} is not a number")
        if value not in out:
            out.append(value)
    return out


def sweepable_keys() -> list[str]:
    """The keys the page sweeps: the estimator (its registry's values) and every setting the
    settings schema gives a What-if number widget."""
    from rldiag.config.schema import SETTINGS
    from rldiag.viz.whatif import ESTIMATOR

    return [ESTIMATOR, *(s.key for s in SETTINGS if s.widget is not None and s.kind in ("float", "int"))]


def scenario_count(grid: dict[str, list[Any]]) -> int:
    return math.prod(len(v) for v in grid.values()) if grid else 0


def mark_own(frame: pl.DataFrame, own: str | None) -> pl.DataFrame:
    """``frame`` (a ``scenario`` column) with a first column ``own``: ``*`` on the run's own scenario."""
    return frame.select(pl.when(pl.col("scenario") == (own or "")).then(pl.lit("*")).otherwise(pl.lit(""))
                        .alias("own"), pl.all())
