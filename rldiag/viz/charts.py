"""Plotly figures for the app. Inputs are the store's polars frames; nothing is computed here
beyond laying values out (EMA smoothing is :mod:`.smoothing`, spans of a mask :func:`mask_spans`).

Series go to plotly as numpy arrays, not lists: plotly then validates them without a Python loop
and sends them to the browser as typed binary (7-10x faster for 10,000-step series).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

from rldiag.viz.colours import DIVERGING, QUANTITIES

if TYPE_CHECKING:
    import numpy as np

#: colour of the logged values and of successive scenarios
LOGGED_COLOUR = "#1f77b4"
SCENARIO_COLOURS = ("#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")
#: above this many points a trace is drawn with WebGL
GL_POINTS = 5000


#: room above the panels' titles for the legend, in pixels
LEGEND_PX = 28


def _paper(px: float, height: int, top: int, bottom: int) -> float:
    """``px`` pixels as a fraction of the plotting area's height (to place the legend above
    the subplot titles instead of over them)."""
    return px / max(1, height - top - bottom)


def source_colour(i: int) -> str:
    """Colour of source ``i`` (0 = logged)."""
    return LOGGED_COLOUR if i == 0 else SCENARIO_COLOURS[(i - 1) % len(SCENARIO_COLOURS)]


def _scatter(n_points: int):
    return go.Scattergl if n_points > GL_POINTS else go.Scatter


def metric_grid(
    joined: pl.DataFrame,
    metrics: list[str],
    sources: dict[str, str],
    smoothed: pl.DataFrame | None = None,
    columns: int = 2,
    row_height: int = 260,
    log_y: bool = False,
    y_ranges: dict[str, tuple[float, float]] | None = None,
    x: str = "step",
) -> go.Figure:
    """One panel per metric, every source on the same axes: logged solid, scenarios dashed.

    ``joined`` is :meth:`Store.joined` (``step, metric, <source columns>``); ``sources`` maps a
    legend name to its column. With ``smoothed`` (the same frame after EMA) the raw values are
    drawn faint under the smoothed line. ``log_y``: logarithmic y axes; ``y_ranges``: a y range
    per metric (outliers clipped: :meth:`Store.clip_bounds`); ``x``: the column on the x axis
    (``step``, or ``wall_time`` from :meth:`Store.with_wall_time`). Every point carries its step
    as ``customdata`` (a click opens that step).
    """
    metrics = [m for m in metrics]
    n = max(1, len(metrics))
    cols = 1 if n == 1 else columns
    rows = math.ceil(n / cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=metrics or ["(no metric selected)"],
                        horizontal_spacing=0.08, vertical_spacing=min(0.12, 0.3 / rows))
    by_metric = {m: f for (m,), f in joined.partition_by("metric", as_dict=True).items()} if not joined.is_empty() else {}
    sm_by = ({m: f for (m,), f in smoothed.partition_by("metric", as_dict=True).items()}
             if smoothed is not None and not smoothed.is_empty() else {})
    shown: set[str] = set()
    for k, metric in enumerate(metrics):
        r, c = k // cols + 1, k % cols + 1
        f = by_metric.get(metric)
        if f is None:
            continue
        f = f.sort("step")
        for i, (label, col) in enumerate(sources.items()):
            if col not in f.columns:
                continue
            part = _series(f, col, x)
            if part.is_empty():
                continue
            colour = source_colour(i)
            dash = None if i == 0 else "dash"
            trace = _scatter(part.height)
            smooth = sm_by.get(metric)
            if smooth is not None:
                fig.add_trace(trace(x=part[x].to_numpy(), y=part[col].to_numpy(), mode="lines", name=label,
                                    legendgroup=label, showlegend=False, opacity=0.25,
                                    line=dict(color=colour, width=1, dash=dash), hoverinfo="skip"), row=r, col=c)
                part = _series(smooth.sort("step"), col, x)
            fig.add_trace(trace(x=part[x].to_numpy(), y=part[col].to_numpy(), customdata=part["step"].to_numpy(),
                                mode="lines+markers" if part.height <= 60 else "lines",
                                name=label, legendgroup=label, showlegend=label not in shown,
                                line=dict(color=colour, width=2, dash=dash), marker=dict(size=4)), row=r, col=c)
            shown.add(label)
        if y_ranges and metric in y_ranges and not log_y:
            lo, hi = y_ranges[metric]
            pad = (hi - lo) * 0.05 or abs(hi) * 0.05 or 1.0
            fig.update_yaxes(range=[lo - pad, hi + pad], row=r, col=c)
    height = max(300, rows * row_height) + LEGEND_PX
    fig.update_layout(height=height, margin=dict(l=40, r=20, t=40 + LEGEND_PX, b=30),
                      legend=dict(orientation="h", yanchor="bottom", x=0, y=1 + _paper(LEGEND_PX, height, 40 + LEGEND_PX, 30)),
                      hovermode="x unified", clickmode="event+select")
    fig.update_xaxes(title_text=None)
    if log_y:
        fig.update_yaxes(type="log")
    return fig


def _series(f: pl.DataFrame, col: str, x: str) -> pl.DataFrame:
    cols = ["step", col] if x == "step" else ["step", x, col]
    return f.select(cols).drop_nulls()


def group_figure(rows: pl.DataFrame, scenarios: list[str]) -> go.Figure:
    """One step's rows by group: each row's mean advantage under each scenario (bars) and its
    score total (markers, right axis). ``rows`` is :meth:`Store.step_rows`."""
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    if rows.is_empty():
        return fig
    x = [rows["grp"].to_list(), [str(r) for r in rows["row"].to_list()]]
    for i, s in enumerate(scenarios):
        col = f"adv:{s}"
        if col in rows.columns:
            fig.add_trace(go.Bar(x=x, y=rows[col].to_list(), name=f"advantage · {s}",
                                 marker_color=source_colour(i + 1)), secondary_y=False)
    fig.add_trace(go.Scatter(x=x, y=rows["score_total"].to_list(), mode="markers", name="score total",
                             marker=dict(symbol="diamond", size=9, color="#333")), secondary_y=True)
    fig.update_layout(barmode="group", height=380, margin=dict(l=40, r=40, t=30, b=60),
                      legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0))
    # readable ticks on both axes: each its own round steps (never synced to the other's grid)
    fig.update_yaxes(title_text="mean advantage over actor tokens", secondary_y=False, **READABLE_TICKS)
    fig.update_yaxes(title_text="score", secondary_y=True, tickmode="auto", showgrid=False, **READABLE_TICKS)
    fig.update_xaxes(title_text="group (uid) / row")
    return fig


def mask_spans(mask: list[int], value: int = 0) -> list[tuple[int, int]]:
    """Runs of ``value`` in ``mask`` as ``(first, last)`` positions, inclusive."""
    spans, start = [], None
    for i, m in enumerate(mask):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            spans.append((start, i - 1))
            start = None
    if start is not None:
        spans.append((start, len(mask) - 1))
    return spans


#: ticks a reader can read: at most 5, round numbers, 3 significant digits without trailing zeros
READABLE_TICKS = {"nticks": 5, "tickformat": ".3~g"}
#: strip name -> (label, colour scale, centre of the scale): the app's one convention for each
#: quantity (:mod:`rldiag.viz.colours`: blue above the neutral value, red below), in the strips' order
STRIPS = {k: (QUANTITIES[k][0], DIVERGING, QUANTITIES[k][1])
          for k in ("advantages", "ratio", "rollout_is_weights", "token_level_rewards", "ref_kl")}


def heat_strip(tokens: dict[str, list]) -> go.Figure:
    """One row's tokens: a strip per quantity (shared token axis), the mask strips last.

    Tool observations (original mask 0) are shaded across every strip; tokens rejected by rollout
    correction (original 1, post-correction 0) show in the post-correction mask strip.
    """
    strips = [k for k in STRIPS if tokens.get(k) is not None]
    masks = ["mask"] + (["post_mask"] if tokens.get("post_mask") is not None else [])
    names = [STRIPS[k][0] for k in strips] + ["mask (batch)" if m == "mask" else "mask (after correction)" for m in masks]
    n = len(names)
    fig = make_subplots(rows=n, cols=1, shared_xaxes=True, vertical_spacing=0.04, row_titles=None)
    length = len(tokens.get("mask", []))
    x = list(range(length))
    for i, k in enumerate(strips):
        label, scale, centre = STRIPS[k]
        z = [[v if v is None or math.isfinite(v) else None for v in tokens[k]]]
        kw = {}
        if centre is not None:
            finite = [v for v in z[0] if v is not None]
            span = max((abs(v - centre) for v in finite), default=1.0) or 1.0
            kw = dict(zmin=centre - span, zmax=centre + span)
        fig.add_trace(go.Heatmap(z=z, x=x, y=[label], colorscale=scale, showscale=True,
                                 colorbar=dict(len=1 / n, y=1 - (i + 0.5) / n, thickness=10, title=None,
                                               **READABLE_TICKS),
                                 hovertemplate=f"token %{{x}}<br>{label} %{{z:.4g}}<extra></extra>", **kw),
                      row=i + 1, col=1)
    for j, m in enumerate(masks):
        row = len(strips) + j + 1
        fig.add_trace(go.Heatmap(z=[tokens[m]], x=x, y=[names[row - 1]], zmin=0, zmax=1, showscale=False,
                                 colorscale=[[0, "#d9d9d9"], [1, "#3a7d44"]],
                                 hovertemplate="token %{x}<br>mask %{z}<extra></extra>"),
                      row=row, col=1)
    for a, b in mask_spans(tokens.get("mask", [])):
        # one shaded band per strip, labelled once above the first
        fig.add_vrect(x0=a - 0.5, x1=b + 0.5, fillcolor="rgba(120,120,120,0.18)", line_width=0, row="all", col=1)
        fig.add_annotation(x=(a + b) / 2, y=1.0, xref="x", yref="paper", yanchor="bottom", text="tool",
                           showarrow=False, font=dict(size=10, color="#555"))
    fig.update_layout(height=90 + 70 * n, margin=dict(l=150, r=20, t=30, b=30))
    fig.update_xaxes(title_text="token position", row=n, col=1)
    return fig


def quantile_band(q: pl.DataFrame, title: str) -> go.Figure:
    """Quantiles over steps (``step, q05, q25, q50, q75, q95, max``): 5-95% and 25-75% bands,
    the median and the maximum."""
    fig = go.Figure()
    if q.is_empty() or "q50" not in q.columns:
        return fig
    s = q["step"].to_numpy()
    for lo, hi, alpha, name in (("q05", "q95", 0.15, "5–95%"), ("q25", "q75", 0.3, "25–75%")):
        fig.add_trace(go.Scatter(x=s, y=q[hi].to_numpy(), mode="lines", line=dict(width=0), showlegend=False,
                                 hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=s, y=q[lo].to_numpy(), mode="lines", line=dict(width=0), fill="tonexty",
                                 fillcolor=f"rgba(31,119,180,{alpha})", name=name))
    fig.add_trace(go.Scatter(x=s, y=q["q50"].to_numpy(), mode="lines+markers", name="median",
                             line=dict(color=LOGGED_COLOUR)))
    fig.add_trace(go.Scatter(x=s, y=q["max"].to_numpy(), mode="lines", name="max",
                             line=dict(color="#d62728", dash="dot")))
    fig.update_layout(title=title, height=320, margin=dict(l=40, r=20, t=50, b=30), xaxis_title="step")
    return fig


def histogram(values: Sequence[float] | np.ndarray, title: str, x_title: str) -> go.Figure:
    fig = go.Figure(go.Histogram(x=values, nbinsx=60, marker_color=LOGGED_COLOUR))
    fig.update_layout(title=title, height=300, margin=dict(l=40, r=20, t=50, b=30), xaxis_title=x_title,
                      yaxis_title="tokens", bargap=0.02)
    return fig


def agreement_figure(tokens: pl.DataFrame) -> go.Figure:
    """Per step agreement of two scenarios' advantages (the compare command's ``tokens``)."""
    fig = go.Figure()
    if tokens.is_empty():
        return fig
    for i, col in enumerate(c for c in ("sign_agreement", "sign_flip_fraction", "pearson", "spearman") if c in tokens.columns):
        fig.add_trace(go.Scatter(x=tokens["step"].to_list(), y=tokens[col].to_list(), mode="lines+markers",
                                 name=col, line=dict(color=source_colour(i))))
    fig.update_layout(height=300, margin=dict(l=40, r=20, t=30, b=30), xaxis_title="step",
                      legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0))
    return fig
