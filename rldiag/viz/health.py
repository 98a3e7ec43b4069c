"""The doctor seen from the app: findings laid out with the steps behind them (:func:`rldiag.api.diagnose`
runs it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import plotly.graph_objects as go

from rldiag import api

SEVERITY_ICONS = {"critical": ":red[:material/report:]", "warning": ":orange[:material/warning:]",
                  "info": ":blue[:material/info:]"}
#: at most this many steps of a finding get a link
MAX_LINKS = 12


@dataclass(frozen=True)
class FindingView:
    icon: str
    title: str
    rule: str
    severity: str
    message: str
    why: str  # why it matters; for a rule naming causes, what to do
    metric: str | None
    statistic: str
    steps: list[int]  # the steps to link (at most MAX_LINKS)
    more_steps: int
    # the finding's counterfactual (the doctor computed it): a sentence per alternative, a row per entry
    counterfactual: list[str] = field(default_factory=list)
    counterfactual_rows: list[dict[str, Any]] = field(default_factory=list)
    # its trend state in words ("resolved since step 16"), and its metric's series with the threshold
    state: str = ""
    sparkline: dict[str, Any] | None = None
    # the alternatives not tried, or lines left out because they change nothing, and why
    skipped: list[str] = field(default_factory=list)
    # causes this one implies (kept inside it, not a second finding): a sentence each
    implies: list[str] = field(default_factory=list)


def counterfactual_rows(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A finding's counterfactual as table rows: the settings (``key=value``, comma-joined), the
    metric, its statistic, the steps, with and without (as the doctor reported them)."""
    return [{"settings": ", ".join(f"{k}={v}" for k, v in e["settings"].items()), "metric": e["metric"],
             "statistic": e["statistic"], "steps": f"{e['window'][0]}-{e['window'][1]}", "with": e["with"],
             "without": e["without"]} for e in entries]


def finding_views(report) -> list[FindingView]:
    out = []
    for f in report.findings:
        ev = f.evidence
        steps = sorted({int(s) for s in (ev.steps or [])})
        out.append(FindingView(
            icon=SEVERITY_ICONS.get(f.severity, ":material/info:"), title=f.title, rule=f.rule, severity=f.severity,
            message=f.message, why=f.remedy or f.why, metric=ev.metric, statistic=ev.statistic,
            steps=steps[:MAX_LINKS], more_steps=max(0, len(steps) - MAX_LINKS),
            counterfactual=api.describe_counterfactual(f.counterfactual, report.settings),
            counterfactual_rows=counterfactual_rows(f.counterfactual),
            state=state_words(ev), sparkline=ev.sparkline,
            skipped=list(ev.details.get("counterfactual_skipped", [])),
            implies=[f"{i['cause']} (confidence {i['confidence']:.2f}): {i['message']}"
                     for i in ev.details.get("implies", [])],
        ))
    return out


def state_words(ev) -> str:
    """``resolved since step 16``: a finding's trend state (empty without one)."""
    if ev.state is None:
        return ""
    return ev.state if ev.state_since is None else f"{ev.state} since step {ev.state_since}"


#: a finding's state, as a coloured word on the Health page
STATE_COLOURS = {"resolved": "green", "improving": "blue", "ongoing": "orange", "worsening": "red"}


def sparkline_figure(spark: dict[str, Any], state_since: int | None = None) -> go.Figure:
    """The finding's metric over its window (a line) with the rule's threshold (dashed), the
    unhealthy side shaded, and the step its state began (a dotted line); small enough for a row."""
    fig = go.Figure(go.Scatter(x=spark["steps"], y=spark["values"], mode="lines", name=spark.get("metric") or "value",
                               line={"width": 1.5, "color": "#4c78a8"},
                               hovertemplate="step %{x}: %{y:.4g}<extra></extra>"))
    thr = spark.get("threshold")
    if thr is not None:
        fig.add_hline(y=thr, line={"dash": "dash", "width": 1, "color": "#d62728"},
                      annotation_text=f"threshold {thr:.3g}", annotation_position="top left",
                      annotation_font_size=10)
    if state_since is not None:
        fig.add_vline(x=state_since, line={"dash": "dot", "width": 1, "color": "#7f7f7f"})
    fig.update_layout(height=140, margin={"l": 40, "r": 10, "t": 10, "b": 25}, showlegend=False,
                      yaxis={"tickformat": ".3~g", "nticks": 4}, xaxis={"title": None})
    return fig


def outcome_rows(report) -> list[dict]:
    """Every rule that did not give a finding: passed, not evaluated, not applicable."""
    rows = [{"rule": k, "outcome": "passed", "detail": v} for k, v in sorted(report.passed.items())]
    rows += [{"rule": k, "outcome": "not evaluated", "detail": v} for k, v in sorted(report.not_evaluated.items())]
    rows += [{"rule": k, "outcome": "not applicable", "detail": v} for k, v in sorted(report.not_applicable.items())]
    return rows


def coverage_line(report) -> str:
    """What the doctor looked at, in one line (an info finding is not counted as a finding)."""
    n_info = sum(f.severity == "info" for f in report.findings)
    info = f" (and {n_info} for information)" if n_info else ""
    return (f"{len(report.findings) - n_info} findings{info}, {len(report.passed)} rules passed, {len(report.not_evaluated)} not "
            f"evaluated, {len(report.not_applicable)} not applicable; over {report.logged_steps} logged and "
            f"{report.recomputed_steps} recomputed steps.")
