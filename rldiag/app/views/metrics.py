"""Training metrics: the logged metrics, live, with recomputed scenarios on the same axes."""

import time

import streamlit as st
from rldiag.app import session

from rldiag.viz.charts import metric_grid
from rldiag.viz.metric_groups import default_selection, filter_names, follow_range, group_by_prefix
from rldiag.viz.smoothing import ema
from rldiag.viz.timefmt import live_line

#: seconds between two looks at metrics.jsonl
REFRESH_S = 2.0

st.title("Training metrics")
store = session.store_or_stop()

def controls():
    """The page's widgets; returns (metrics, scenarios, first step, last step or None, smoothing)."""
    store.refresh()
    scenarios = store.scenario_names()
    names = store.metric_names(scenarios)
    groups = group_by_prefix(names)

    c1, c2 = st.columns([3, 2])
    query = c1.text_input("Search metrics", key="m_query", placeholder="e.g. clipfrac   or   actor/*kl*")
    chosen_groups = c2.multiselect("Groups", list(groups), key="m_groups",
                                   format_func=lambda g: f"{g} ({len(groups[g])})")
    if "m_metrics" not in st.session_state:
        st.session_state["m_metrics"] = default_selection(names)
    current = [m for m in st.session_state["m_metrics"] if m in names]
    st.session_state["m_metrics"] = current
    options = sorted(set(filter_names(names, query, chosen_groups)) | set(current))
    selected = st.multiselect(f"Metrics ({len(options)} of {len(names)} shown)", options, key="m_metrics")

    c3, c4 = st.columns([3, 2])
    if "m_scenarios" not in st.session_state:
        st.session_state["m_scenarios"] = [s for s in scenarios if s == "baseline"]
    overlay = c3.multiselect("Recomputed scenarios on the same axes", scenarios, key="m_scenarios")
    smoothing = c4.slider("EMA smoothing", 0.0, 0.99, 0.0, 0.01, key="m_ema")

    bounds = store.step_bounds(overlay)
    lo = hi = None
    if bounds and bounds[0] < bounds[1]:
        if "m_range" in st.session_state:
            st.session_state["m_range"] = follow_range(st.session_state["m_range"], st.session_state.get("m_range_max"),
                                                       bounds)
        st.session_state["m_range_max"] = bounds[1]
        lo, hi = st.slider("Steps", bounds[0], bounds[1], (bounds[0], bounds[1]), key="m_range")
        if hi == bounds[1]:
            hi = None  # the range reaches the last step: keep following the run
    return selected, overlay, lo, hi, smoothing


@st.fragment(run_every=REFRESH_S)
def live(selected: list[str], overlay: list[str], lo, hi, smoothing: float) -> None:
    with session.guard():
        status = store.status()
        st.markdown(live_line(status.latest_step, status.steps, status.mtime, time.time()))
        if not selected:
            st.info("Pick metrics above (search by name or choose a group).")
            return
        joined = store.joined(selected, overlay, lo, hi)
        columns = store.source_columns(overlay)
        smoothed = ema(joined, list(columns.values()), smoothing) if smoothing > 0 else None
        fig = metric_grid(joined, selected, columns, smoothed)
        st.plotly_chart(fig, key="m_chart", config={"displaylogo": False})
        problems = store.batches.problems
        if problems:
            st.warning("Batch files skipped (cannot be opened, maybe still being written): " + ", ".join(problems))


chosen = None
with session.guard():
    chosen = controls()
if chosen is not None:
    live(*chosen)
