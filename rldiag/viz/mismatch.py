"""The Off-policy page's mismatch diagnosis (:func:`rldiag.api.mismatch`) laid out, and the
pictures that make each cause's fingerprint visible on one step's actor tokens
(:func:`rldiag.api.mismatch_tokens`: ``row, position, old_log_prob, rollout_log_prob, gap, kl,
kl_share, old_next, old_prev[, policy_lag][, token]``, one row per token).

The gap is ``d = old - rollout`` (trainer minus rollout engine). Each picture has a pure
function that computes what it draws (counts, bins, means; numpy) and one that draws it
(plotly), so the numbers can be tested without a browser:

- sampling truncation: the gap's histogram is one-sided (:func:`gap_histogram`);
- a temperature on one side: the 2-D histogram of the two log-probs leaves the identity line
  with a slope (:func:`logprob_hist2d`);
- precision: a narrow, symmetric gap histogram, flat over positions (:func:`position_profile`);
- misalignment: the rollout series agrees with the trainer's shifted by one position better than
  unshifted (:func:`shift_agreement`);
- outlier tokens: a handful of tokens hold most of the KL (:func:`top_kl_tokens`);
- policy lag: the gap grows with each row's lag (:func:`lag_profile`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

from rldiag.viz.charts import LOGGED_COLOUR, SCENARIO_COLOURS

if TYPE_CHECKING:
    from rldiag.api import MismatchResult

PREFIX = "rldiag/mismatch/"
#: the over-training lines beside the step's shift-0 / shift-±1 bars (positions, never "lag": that is policy staleness)
SHIFT_METRICS = (PREFIX + "pair_abs_gap", PREFIX + "shift_next_abs_gap", PREFIX + "shift_prev_abs_gap")
#: the statistic that picks the step shown first
KL_METRIC = PREFIX + "kl_k2"
#: tokens in the table of the largest shares of the KL
TOP_TOKENS = 20
#: the verl setting that makes the rollout engine return its log-probs
CALCULATE_LOG_PROBS = "actor_rollout_ref.rollout.calculate_log_probs=True"
NEEDS_LOG_PROBS = (
    "The mismatch diagnosis needs the batches' `rollout_log_probs` (the rollout engine's log-probs of the sampled "
    "tokens) beside `old_log_probs` (the trainer's), and no step has both. In verl, set "
    f"`{CALCULATE_LOG_PROBS}` so that the rollout returns its log-probs and the batches keep them.")

TITLES = {
    "sampling_truncation": "Sampling truncation",
    "temperature": "Temperature gap",
    "precision": "Numeric precision",
    "misaligned": "Misaligned log-probs",
    "policy_lag": "Policy lag",
    "outlier_tokens": "Outlier tokens",
}
#: severity -> (Streamlit message box: st.error / st.warning / st.info, badge colour)
SEVERITY = {"critical": ("error", "red"), "warning": ("warning", "orange"), "info": ("info", "blue")}
HEIGHT = 340
MARGIN = dict(l=50, r=20, t=50, b=40)
#: a legend under the x axis (the title has the top), and the room it takes
LEGEND_BELOW = dict(orientation="h", yanchor="top", y=-0.22, x=0)
MARGIN_LEGEND = dict(l=50, r=20, t=50, b=90)


# ---- the diagnosis ----------------------------------------------------------------------------


def compact_steps(steps: Sequence[int]) -> str:
    """Steps as ranges: ``[1, 2, 3, 5, 7, 8]`` -> ``"1-3, 5, 7-8"`` (sorted, each once)."""
    runs: list[list[int]] = []
    for s in sorted({int(s) for s in steps}):
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@dataclass(frozen=True)
class CauseView:
    """One found cause as the page shows it."""

    cause: str
    title: str
    severity: str
    box: str  # the Streamlit message box of its severity: "error", "warning" or "info"
    badge: str  # the badge colour
    confidence: str
    message: str
    statistic: str
    steps: str  # compact ranges
    remedy: str
    examples: pl.DataFrame | None  # the tokens to look at (None: none listed)


def examples_frame(examples: Sequence[Mapping[str, Any]]) -> pl.DataFrame | None:
    """A cause's example tokens as a table (``step, row, position[, token], old_log_prob,
    rollout_log_prob, gap, kl_share[, policy_lag]``); None without examples. A ``token``
    column that holds no text is left out."""
    if not examples:
        return None
    frame = pl.DataFrame(list(examples), infer_schema_length=None)
    if "token" in frame.columns and frame["token"].null_count() == frame.height:
        frame = frame.drop("token")
    order = ["step", "row", "position", "token", "old_log_prob", "rollout_log_prob", "gap", "kl_share", "policy_lag"]
    return frame.select([c for c in order if c in frame.columns])


def cause_views(diag: MismatchResult) -> list[CauseView]:
    """The diagnosis's causes, most confident first."""
    out = []
    for c in diag.causes:
        box, badge = SEVERITY.get(c.severity, ("info", "gray"))
        out.append(CauseView(
            cause=c.cause, title=TITLES.get(c.cause, c.cause), severity=c.severity, box=box, badge=badge,
            confidence=f"{c.confidence:.2f}", message=c.message, statistic=c.statistic, steps=compact_steps(c.steps),
            remedy=c.remedy, examples=examples_frame(c.examples)))
    return out


def verdict(diag: MismatchResult) -> tuple[str, str] | None:
    """What the page says when no cause is found: ``(box, text)``, the box ``"info"`` when the
    run has no step with both log-probs (and what to set in verl), ``"success"`` when the two
    streams agree; None when causes were found."""
    if diag.causes:
        return None
    if not diag.steps:
        return "info", NEEDS_LOG_PROBS
    p99 = diag.summary.get("gap_abs_p99", float("nan"))
    return "success", (f"The rollout engine's and the trainer's log-probs agree: no cause found over "
                       f"{len(diag.steps)} steps (99th percentile of |old - rollout| {p99:.3g}).")


def default_step(steps: Sequence[int], kl: Mapping[int, float], preferred: Sequence[int] = ()) -> int | None:
    """The step shown first: the one with the largest ``kl`` (step -> the step's k2 KL) among
    ``preferred`` (the top cause's steps) that are in ``steps``, else among ``steps``; without a
    finite KL there, the last of them. None when ``steps`` is empty."""
    pool = [s for s in preferred if s in set(steps)] or list(steps)
    if not pool:
        return None
    scored = [(kl[s], s) for s in pool if s in kl and np.isfinite(kl[s])]
    return max(scored)[1] if scored else max(pool)


def metric_by_step(joined: pl.DataFrame, metric: str, column: str) -> dict[int, float]:
    """step -> value of ``metric`` in ``column`` of the store's joined frame (``step, metric,
    <sources>``); steps without a value left out."""
    if joined.is_empty() or column not in joined.columns:
        return {}
    f = joined.filter((pl.col("metric") == metric) & pl.col(column).is_not_null())
    return dict(zip(f["step"].to_list(), f[column].cast(pl.Float64).to_list(), strict=True))


# ---- rollout vs trainer log-prob ----------------------------------------------------------------


@dataclass(frozen=True)
class Hist2d:
    """Token counts over a grid: ``counts`` ``(bins, bins)`` indexed ``[y bin, x bin]``;
    ``edges`` ``(bins + 1,)``, the same on both axes (so the identity is the diagonal)."""

    counts: np.ndarray
    edges: np.ndarray

    @property
    def centres(self) -> np.ndarray:
        return (self.edges[:-1] + self.edges[1:]) / 2


def _finite(*cols: np.ndarray) -> np.ndarray:
    keep = np.ones(len(cols[0]), dtype=bool)
    for c in cols:
        keep &= np.isfinite(c)
    return keep


def _span(values: np.ndarray) -> tuple[float, float]:
    """The range of ``values``, widened when it is a point (an empty one: ``(-1, 0)``)."""
    if not values.size:
        return -1.0, 0.0
    lo, hi = float(values.min()), float(values.max())
    if hi <= lo:
        pad = max(abs(lo) * 0.01, 1e-6)
        lo, hi = lo - pad, hi + pad
    return lo, hi


def logprob_hist2d(rollout: np.ndarray, old: np.ndarray, bins: int = 60) -> Hist2d:
    """Counts of ``(rollout, old)`` pairs (both ``(n,)``) on one square grid spanning both
    (non-finite pairs left out): x the rollout log-prob, y the trainer's."""
    x, y = np.asarray(rollout, dtype=np.float64), np.asarray(old, dtype=np.float64)
    keep = _finite(x, y)
    x, y = x[keep], y[keep]
    lo, hi = _span(np.concatenate([x, y]))
    edges = np.linspace(lo, hi, bins + 1)
    counts, _, _ = np.histogram2d(y, x, bins=[edges, edges])
    return Hist2d(counts.astype(np.int64), edges)


def _log_counts(counts: np.ndarray) -> tuple[np.ndarray, list[float], list[str]]:
    """log10 of the counts (NaN where 0: left blank), and a colour bar's ticks in counts."""
    with np.errstate(divide="ignore"):
        z = np.where(counts > 0, np.log10(np.maximum(counts, 1)), np.nan)
    top = int(np.ceil(np.log10(max(int(counts.max(initial=0)), 1)))) if counts.size else 0
    ticks = list(range(0, max(top, 1) + 1))
    return z, [float(t) for t in ticks], [f"{10 ** t:g}" for t in ticks]


def logprob_figure(tokens: pl.DataFrame, bins: int = 60) -> go.Figure:
    """The 2-D histogram of rollout (x) against trainer (y) log-probs, log colour scale, with
    the identity line across the data's range: off the line, the two streams disagree; a line
    of another slope is a temperature gap, a band below it truncation."""
    h = logprob_hist2d(tokens["rollout_log_prob"].to_numpy(), tokens["old_log_prob"].to_numpy(), bins)
    z, tickvals, ticktext = _log_counts(h.counts)
    c = h.centres
    fig = go.Figure(go.Heatmap(
        x=c, y=c, z=z, customdata=h.counts, colorscale="Viridis", name="tokens",
        colorbar=dict(title="tokens", tickvals=tickvals, ticktext=ticktext, thickness=12),
        hovertemplate="rollout %{x:.3f}<br>trainer %{y:.3f}<br>%{customdata} tokens<extra></extra>"))
    lo, hi = float(h.edges[0]), float(h.edges[-1])
    fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="identity",
                             line=dict(color="#d62728", dash="dash", width=1.5)))
    fig.update_layout(title="Rollout vs trainer log-prob", height=HEIGHT, margin=MARGIN, showlegend=False,
                      xaxis_title="rollout_log_prob", yaxis_title="old_log_prob (trainer)")
    fig.update_xaxes(range=[lo, hi])
    fig.update_yaxes(range=[lo, hi])
    return fig


# ---- the gap's distribution ---------------------------------------------------------------------


@dataclass(frozen=True)
class GapHist:
    """``counts`` ``(bins,)`` over ``edges`` ``(bins + 1,)``, symmetric about 0 (0 an edge for
    an even ``bins``), and the share of tokens with a gap above and below 0."""

    counts: np.ndarray
    edges: np.ndarray
    above: float
    below: float


def gap_histogram(gap: np.ndarray, bins: int = 60) -> GapHist:
    """The histogram of ``gap`` ``(n,)`` (non-finite values left out) over ``[-m, m]``, ``m``
    the largest ``|gap|``: a one-sided gap fills one half only."""
    d = np.asarray(gap, dtype=np.float64)
    d = d[np.isfinite(d)]
    m = float(np.abs(d).max()) if d.size else 0.0
    m = m or 1e-6
    counts, edges = np.histogram(d, bins=bins, range=(-m, m))
    n = max(d.size, 1)
    return GapHist(counts.astype(np.int64), edges, float((d > 0).sum() / n), float((d < 0).sum() / n))


def gap_figure(tokens: pl.DataFrame, bins: int = 60) -> go.Figure:
    """The gap's histogram (bars), 0 marked, the shares above and below 0 in the title."""
    h = gap_histogram(tokens["gap"].to_numpy(), bins)
    centres = (h.edges[:-1] + h.edges[1:]) / 2
    fig = go.Figure(go.Bar(x=centres, y=h.counts, width=np.diff(h.edges), marker_color=LOGGED_COLOUR, name="tokens",
                           hovertemplate="gap %{x:.2e}<br>%{y} tokens<extra></extra>"))
    fig.add_vline(x=0.0, line=dict(color="#d62728", dash="dash", width=1.5))
    fig.update_layout(title=f"Gap old - rollout: {h.above:.0%} of tokens above 0, {h.below:.0%} below",
                      height=HEIGHT, margin=MARGIN, bargap=0, xaxis_title="old_log_prob - rollout_log_prob",
                      yaxis_title="tokens", showlegend=False)
    return fig


# ---- the gap by position ----------------------------------------------------------------------


def position_profile(position: np.ndarray, gap: np.ndarray, bins: int = 30) -> pl.DataFrame:
    """The mean and 90th percentile of ``|gap|`` per bin of the position in the response:
    ``position_lo, position_hi`` (inclusive, integers), ``tokens``, ``mean_abs_gap``,
    ``p90_abs_gap``; at most ``bins`` bins of equal width over ``[0, max position]``, empty
    ones left out. ``position``, ``gap``: ``(n,)``."""
    pos = np.asarray(position, dtype=np.int64)
    a = np.abs(np.asarray(gap, dtype=np.float64))
    keep = np.isfinite(a)
    pos, a = pos[keep], a[keep]
    cols: dict[str, list] = {"position_lo": [], "position_hi": [], "tokens": [], "mean_abs_gap": [], "p90_abs_gap": []}
    if pos.size:
        top = int(pos.max()) + 1
        edges = np.unique(np.floor(np.linspace(0, top, min(bins, top) + 1)).astype(np.int64))
        which = np.searchsorted(edges, pos, side="right") - 1
        for b in range(len(edges) - 1):
            sel = a[which == b]
            if sel.size:
                cols["position_lo"].append(int(edges[b]))
                cols["position_hi"].append(int(edges[b + 1]) - 1)
                cols["tokens"].append(int(sel.size))
                cols["mean_abs_gap"].append(float(sel.mean()))
                cols["p90_abs_gap"].append(float(np.quantile(sel, 0.9)))
    return pl.DataFrame(cols, schema={"position_lo": pl.Int64, "position_hi": pl.Int64, "tokens": pl.Int64,
                                      "mean_abs_gap": pl.Float64, "p90_abs_gap": pl.Float64})


def position_figure(tokens: pl.DataFrame, bins: int = 30) -> go.Figure:
    """Mean and 90th percentile of ``|gap|`` against the position in the response (each bin
    at its middle): a gap growing along the response, or one at its start, shows here."""
    p = position_profile(tokens["position"].to_numpy(), tokens["gap"].to_numpy(), bins)
    x = ((p["position_lo"] + p["position_hi"]) / 2).to_numpy()
    fig = go.Figure()
    for col, name, colour in (("mean_abs_gap", "mean |gap|", LOGGED_COLOUR), ("p90_abs_gap", "p90 |gap|",
                                                                             SCENARIO_COLOURS[0])):
        fig.add_trace(go.Scatter(x=x, y=p[col].to_numpy(), mode="lines+markers", name=name, line=dict(color=colour),
                                 customdata=p.select("position_lo", "position_hi", "tokens").to_numpy(),
                                 hovertemplate="positions %{customdata[0]}-%{customdata[1]} (%{customdata[2]} tokens)"
                                               "<br>%{y:.3g}<extra>" + name + "</extra>"))
    fig.update_layout(title="|Gap| by position in the response", height=HEIGHT, margin=MARGIN_LEGEND,
                      xaxis_title="position", yaxis_title="|old - rollout|", legend=LEGEND_BELOW)
    return fig


# ---- agreement at shift 0 vs shift ±1 (token positions; "lag" is policy staleness) -------------


def shift_agreement(tokens: pl.DataFrame) -> dict[str, float]:
    """The step's mean ``|rollout - old|`` unshifted and shifted by one position, over pairs of
    neighbouring actor tokens (the step's ``rldiag/mismatch/pair_abs_gap``,
    ``shift_next_abs_gap``, ``shift_prev_abs_gap``): ``unshifted`` the mean ``|gap|`` of both
    tokens of each pair, ``+1`` ``|rollout_t - old_{t+1}|``, ``-1`` ``|rollout_{t+1} - old_t|``;
    NaN without a pair."""
    y = tokens["rollout_log_prob"].to_numpy()
    a = np.abs(tokens["gap"].to_numpy())
    nxt, prv = tokens["old_next"].to_numpy(), tokens["old_prev"].to_numpy()
    has_next, has_prev = np.isfinite(nxt), np.isfinite(prv)
    pairs = int(has_next.sum())
    if not pairs:
        return {"unshifted": float("nan"), "+1": float("nan"), "-1": float("nan")}
    return {
        "unshifted": float((a[has_next].sum() + a[has_prev].sum()) / (2 * pairs)),
        "+1": float(np.abs(y[has_next] - nxt[has_next]).mean()),
        "-1": float(np.abs(y[has_prev] - prv[has_prev]).mean()),
    }


SHIFT_LABELS = {"unshifted": "unshifted", "+1": "old shifted +1", "-1": "old shifted -1"}
SHIFT_OF_METRIC = dict(zip(SHIFT_METRICS, SHIFT_LABELS.values(), strict=True))


def shift_figure(agreement: Mapping[str, float], step: int, over_training: pl.DataFrame | None = None,
                 column: str = "baseline") -> go.Figure:
    """Left: the step's :func:`shift_agreement` as bars. Right: the same three over training,
    from ``over_training`` (the store's joined frame of :data:`SHIFT_METRICS`, values in
    ``column``), the step marked. Misaligned log-probs: a shifted bar far below the unshifted."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.35, 0.65], horizontal_spacing=0.1,
                        subplot_titles=[f"step {step}", "over training"])
    colours = [LOGGED_COLOUR, *SCENARIO_COLOURS[:2]]
    fig.add_trace(go.Bar(x=list(SHIFT_LABELS), y=[agreement.get(k, np.nan) for k in SHIFT_LABELS],
                         marker_color=colours, showlegend=False, hovertemplate="%{x}: %{y:.3g}<extra></extra>"),
                  row=1, col=1)
    if over_training is not None and not over_training.is_empty() and column in over_training.columns:
        for (metric, label), colour in zip(SHIFT_OF_METRIC.items(), colours, strict=True):
            f = over_training.filter((pl.col("metric") == metric) & pl.col(column).is_not_null()).sort("step")
            if f.height:
                fig.add_trace(go.Scatter(x=f["step"].to_numpy(), y=f[column].to_numpy(), mode="lines+markers",
                                         name=label, line=dict(color=colour), marker=dict(size=4)), row=1, col=2)
        fig.add_vline(x=step, line=dict(color="#888", dash="dot", width=1), row=1, col=2)
    fig.update_yaxes(title_text="mean |rollout - old|", row=1, col=1)
    fig.update_xaxes(title_text="old shifted by", type="category", row=1, col=1)
    fig.update_xaxes(title_text="step", row=1, col=2)
    fig.update_layout(height=HEIGHT, margin=dict(l=50, r=20, t=70, b=90), title="Agreement at shift 0 vs shift ±1 (positions)",
                      legend=LEGEND_BELOW)
    return fig


# ---- tokens with the largest shares of the KL ---------------------------------------------------


def top_kl_tokens(tokens: pl.DataFrame, k: int = TOP_TOKENS) -> pl.DataFrame:
    """The ``k`` tokens with the largest share of the step's KL (``gap^2 / 2``), largest first:
    ``row, position[, token], old_log_prob, rollout_log_prob, gap, kl_share[, policy_lag]``."""
    cols = ["row", "position", "token", "old_log_prob", "rollout_log_prob", "gap", "kl_share", "policy_lag"]
    return (tokens.sort(["kl_share", "row", "position"], descending=[True, False, False]).head(k)
            .select([c for c in cols if c in tokens.columns]))


# ---- the gap by policy lag --------------------------------------------------------------------


def lag_profile(tokens: pl.DataFrame) -> pl.DataFrame | None:
    """Mean ``|gap|`` per policy lag: ``policy_lag, tokens, rows, mean_abs_gap``, by lag; None
    when the tokens have no ``policy_lag``."""
    if "policy_lag" not in tokens.columns:
        return None
    return (tokens.group_by("policy_lag")
            .agg(pl.len().alias("tokens"), pl.col("row").n_unique().alias("rows"),
                 pl.col("gap").abs().mean().alias("mean_abs_gap"))
            .sort("policy_lag"))


def lag_figure(profile: pl.DataFrame) -> go.Figure:
    """Bars of mean ``|gap|`` by policy lag (:func:`lag_profile`): growing with the lag, the
    gap comes from stale weights."""
    fig = go.Figure(go.Bar(x=profile["policy_lag"].to_numpy(), y=profile["mean_abs_gap"].to_numpy(),
                           customdata=profile.select("tokens", "rows").to_numpy(), marker_color=LOGGED_COLOUR,
                           hovertemplate="lag %{x}: %{y:.3g}<br>%{customdata[0]} tokens, %{customdata[1]} rows"
                                         "<extra></extra>"))
    fig.update_layout(title="|Gap| by policy lag", height=HEIGHT, margin=MARGIN, xaxis_title="policy lag (steps)",
                      yaxis_title="mean |old - rollout|", xaxis=dict(dtick=1))
    return fig
