"""Training metrics: the logged metrics, live, with recomputed scenarios and other runs on the
same axes; downsampled in DuckDB to what the panels can draw; drawn with ECharts
(:mod:`rldiag.viz.echarts`)."""

import time
from collections.abc import Sequence
from typing import Any

import polars as pl
import streamlit as st

from rldiag.app import gate, session
from rldiag.app.main import page_path
from rldiag.errors import RldiagError
from rldiag.store.downsample import DEFAULT_POINTS
from rldiag.viz.capture_note import capture_note
from rldiag.viz.echarts import PANEL_HEIGHT, Panel, metric_panel, panel_action
from rldiag.viz.metric_groups import default_selection, filter_names, follow_range, group_by_prefix
from rldiag.viz.panels import identical_sources, merge_runs, overlap_note, panel_csv, run_labels
from rldiag.viz.smoothing import ema
from rldiag.viz.timefmt import live_line

#: seconds between two looks at metrics.jsonl
REFRESH_S = 1.0

st.title("Training metrics")
store = session.store_or_stop()


def _initial_metrics(names: list[str]) -> list[str]:
    wanted = [m for m in st.query_params.get_all("metrics") if m in names]
    return wanted or default_selection(names)


def _capture_note(scenarios: list[str]) -> str | None:
    """Which steps the run captured, from the first scenario (baseline first) that says so."""
    for name in sorted(scenarios, key=lambda n: n != "baseline"):
        try:
            note = capture_note(store.scenario_meta(name))
        except RldiagError:
            continue
        if note:
            return note
    return None


def controls():
    """The page's widgets; returns the view to draw (a dict) or None."""
    store.refresh()
    scenarios = store.scenario_names()
    names = store.metric_names(scenarios)
    if not names:
        st.info(f"No metrics logged yet: {store.rd.metrics_file} is missing or holds no numeric value, and no "
                "scenario was recomputed. The page follows the file and shows metrics as soon as they are logged.")
        return None
    if not store.logged_names():
        st.info(f"No metrics logged yet: {store.rd.metrics_file} is missing or holds no numeric value. The panels "
                "show the recomputed ones; the page follows the file and adds the logged ones as they come.")
    note = _capture_note(scenarios)
    if note:
        st.caption(note)
    groups = group_by_prefix(names)

    c1, c2 = st.columns([3, 2])
    query = c1.text_input("Search metrics", key="m_query", placeholder="e.g. clipfrac   or   actor/*kl*")
    chosen_groups = c2.multiselect("Groups", list(groups), key="m_groups",
                                   format_func=lambda g: f"{g} ({len(groups[g])})")
    if "m_metrics" not in st.session_state:
        st.session_state["m_metrics"] = _initial_metrics(names)
    current = [m for m in st.session_state["m_metrics"] if m in names]
    st.session_state["m_metrics"] = current
    options = sorted(set(filter_names(names, query, chosen_groups)) | set(current))
    selected = st.multiselect(f"Metrics ({len(options)} of {len(names)} shown)", options, key="m_metrics")
    st.query_params["metrics"] = selected

    c3, c4 = st.columns([3, 2])
    key = session.widget_key("m_scenarios")
    picked = st.session_state.get(key, [])
    if st.session_state.get("m_scenarios_auto", True) and "baseline" in scenarios and "baseline" not in picked:
        # the baseline joins the panels when the background worker has written it, until the
        # overlay is changed by hand (a new key: no request sent before cancels it)
        key = session.set_widget("m_scenarios", ["baseline", *picked])
    elif key not in st.session_state:
        st.session_state[key] = []
    overlay = c3.multiselect("Recomputed scenarios on the same axes", scenarios, key=key,
                             on_change=session.by_hand, args=("m_scenarios_auto", "m_scenarios", key))
    smoothing = c4.slider("EMA smoothing", 0.0, 0.99, 0.0, 0.01, key="m_ema")

    c5, c6, c7 = st.columns([1, 1, 2])
    log_y = c5.toggle("Log scale", key="m_log", help="Logarithmic y axes (values at or below 0 are not drawn).")
    clip = c6.toggle("Clip outliers", key="m_clip",
                     help="Each panel's y range from the 1st to the 99th percentile of its values; a spike no "
                          "longer flattens the rest.")
    # toggles, not a radio: the page's first draw then loads one kind of widget less (docs/app.md)
    timed = store.wall_time_metric() is not None
    wall = c7.toggle("Wall time on x", key="m_wall", disabled=not timed,
                     help="The x axis by the logged time instead of the step. Needs a logged timestamp (`_timestamp` or "
                          "`timestamp`, seconds since the epoch)" + ("." if timed else ": this run logs none."))
    x = "wall_time" if wall and timed else "step"

    bounds = store.step_bounds(overlay)
    lo = hi = None
    if bounds and bounds[0] < bounds[1]:
        key = session.widget_key("m_range")
        pending = st.session_state.pop("m_zoom", None)
        if pending is not None:  # a box drawn on a panel: zoom to its steps, at full resolution
            key = session.set_widget("m_range", (max(bounds[0], pending[0]), min(bounds[1], pending[1])))
        elif key in st.session_state:
            # changed only with the bounds, which make the slider a new widget of its own
            st.session_state[key] = follow_range(st.session_state[key], st.session_state.get("m_range_max"), bounds)
        else:
            st.session_state[key] = (bounds[0], bounds[1])
        st.session_state["m_range_max"] = bounds[1]
        # the value lives in the session state only: a default passed as well makes Streamlit log a
        # warning with a stack trace whenever the state was set above
        lo, hi = st.slider("Steps", bounds[0], bounds[1], key=key,
                           help="Narrow it (or draw a box on a panel) to see every step of a range.")
        if hi == bounds[1]:
            hi = None  # the range reaches the last step: keep following the run
    return dict(selected=selected, overlay=overlay, lo=lo, hi=hi, smoothing=smoothing, log_y=log_y, clip=clip, x=x)


def _frames(s, metrics, overlay, lo, hi, smoothing):
    """Per metric (raw, smoothed or None) of one run, downsampled in DuckDB to the panels' width,
    and the legend. Each metric is its own (cached) query: adding a metric queries only that one."""
    overlay = [o for o in overlay if o in s.scenario_names()]
    columns = s.source_columns(overlay)
    cols = list(columns.values())
    out = {}
    for m in metrics:
        if smoothing <= 0:
            out[m] = (s.joined([m], overlay, lo, hi, points=DEFAULT_POINTS), None)
            continue
        full = s.joined([m], overlay, lo, hi)  # EMA runs over every step, then both lines are downsampled
        out[m] = (s.downsample(full, cols), s.downsample(ema(full, cols, smoothing), cols))
    return out, columns


def _concat(frames) -> pl.DataFrame:
    frames = [f for f in frames if f is not None]
    return pl.concat(frames, how="diagonal_relaxed") if frames else pl.DataFrame(schema={"step": pl.Int64,
                                                                                        "metric": pl.String})


def _split(frame: pl.DataFrame | None) -> dict:
    return {} if frame is None else {m: f for (m,), f in frame.partition_by("metric", as_dict=True).items()}


def _panel(metric: str, raw: pl.DataFrame, smooth, columns: dict, options: tuple, cache: bool) -> Panel:
    """The metric's panel; while its frames are the store's cached ones (same objects) and the
    options the same, the panel built last time (the live refresh redraws nothing new)."""
    log_y, y_range, x = options
    build = lambda: metric_panel(raw, metric, columns, smooth, log_y=log_y, y_range=y_range, x=x)  # noqa: E731
    if not cache:
        return build()
    panels = st.session_state.setdefault("m_panels", {})
    key = (metric, id(raw), id(smooth), tuple(columns.items()), options)
    got = panels.get(metric)
    if got is None or got[0] != key:
        panels[metric] = got = (key, build(), raw, smooth)  # the frames are kept: their ids stay theirs
    for gone in [m for m in panels if m not in st.session_state.get("m_metrics", [])]:
        del panels[gone]  # only the panels on the page are kept
    return got[1]


def _on_select(metric: str, panel: Panel, event) -> None:
    sel = dict(getattr(event, "selection", None) or {})
    seen = st.session_state.setdefault("m_sel_seen", {})
    action = panel_action(sel, panel) if repr(sel) != seen.get(metric) else None
    seen[metric] = repr(sel)
    if action is None:
        return
    kind, arg = action
    if kind == "zoom":  # an x range brushed on a panel
        st.session_state["m_zoom"] = arg
        st.rerun()
    # the URL keeps the open run (and the rest of the view) beside the step: switching pages from
    # the live fragment can leave the run box's widget state behind, and the Step page then
    # reopens the run from the URL rather than showing the picker
    st.switch_page(page_path("step.py"), query_params={**st.query_params.to_dict(), "step": str(arg)})


@st.fragment(run_every=REFRESH_S)
def live(view: dict) -> None:
    with session.guard():
        status = store.status()
        st.markdown(live_line(status.latest_step, status.steps, status.mtime, time.time()))
        selected, overlay = view["selected"], view["overlay"]
        if not selected:
            st.info("Pick metrics above (search by name or choose a group).")
            return
        lo, hi, smoothing = view["lo"], view["hi"], view["smoothing"]
        frames, columns = _frames(store, selected, overlay, lo, hi, smoothing)
        others = session.other_stores()
        x = view["x"] if not others else "step"
        cache = not others and x == "step"
        if others or x != "step":
            joined = _concat(f for f, _ in frames.values())
            smoothed = _concat(f for _, f in frames.values()) if smoothing > 0 else None
            if others:
                labels = run_labels([str(store.run), *others])
                rest = {labels[p]: _frames(s, selected, overlay, lo, hi, smoothing) for p, s in others.items()}
                main = {f"{labels[str(store.run)]} · {n}": c for n, c in columns.items()}
                legends = {k: v[1] for k, v in rest.items()}
                joined, all_columns = merge_runs(joined, main, {
                    k: (_concat(f for f, _ in v[0].values()), legends[k]) for k, v in rest.items()})
                if smoothed is not None:
                    smoothed, _ = merge_runs(smoothed, main, {
                        k: (_concat(f for _, f in v[0].values()), legends[k]) for k, v in rest.items()})
                columns = all_columns
            if x != "step":
                joined = store.with_wall_time(joined)
                smoothed = store.with_wall_time(smoothed) if smoothed is not None else None
            raw_by, sm_by = _split(joined), _split(smoothed)
            frames = {m: (raw_by.get(m, joined.clear()), sm_by.get(m)) for m in selected}
        ranges = store.clip_bounds(selected, overlay, lo, hi) if view["clip"] else {}
        grid: Sequence[Any] = ()
        for k, metric in enumerate(selected):
            if k % 2 == 0:
                grid = st.columns(2)  # row by row: a new metric adds a panel after the others
            # one chart per panel: adding a metric draws one new panel, the others stay as they are
            raw, smooth = frames[metric]
            panel = _panel(metric, raw, smooth, columns, (view["log_y"], ranges.get(metric), x), cache)
            with grid[k % 2]:
                event = st.echarts_chart(panel.spec, key=f"m_chart:{metric}", on_select="rerun",
                                         height=PANEL_HEIGHT, renderer="svg")
            _on_select(metric, panel, event)
        joined = _concat(f for f, _ in frames.values())
        note = overlap_note(identical_sources(joined, columns))
        if note:
            st.caption(note)
        st.caption("Click a point to open its step. To zoom into steps at full resolution, pick a panel's brush "
                   "(top right) and drag over them.")
        problems = store.batches.problems
        if problems:
            st.warning("Batch files skipped (cannot be opened, maybe still being written): " + ", ".join(problems))


def export(view: dict) -> None:
    """A panel's data, at full resolution, as CSV (its widgets drawn once asked for: the page's
    first draw waits for the code of every kind of widget on it)."""
    if not view["selected"] or not st.toggle("Export a panel's data (CSV)", key="m_export_on"):
        return
    with st.container(border=True):
        metric = st.selectbox("Panel", view["selected"], key="m_export")
        full = store.joined([metric], view["overlay"], view["lo"], view["hi"])
        if view["x"] != "step":
            full = store.with_wall_time(full)
        if gate.policy().shared:  # a download is served by Streamlit's media endpoint, which asks no token
            st.caption("Downloads are off in shared mode: Streamlit serves them without asking for the token.")
            return
        st.download_button("Download CSV", panel_csv(full, metric, store.source_columns(view["overlay"])),
                           file_name=f"{metric.replace('/', '_')}.csv", mime="text/csv", key="m_csv")


chosen = None
with session.guard():
    chosen = controls()
if chosen is not None:
    live(chosen)
    with session.guard():
        export(chosen)
