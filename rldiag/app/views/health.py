"""Health: the doctor's findings, each with the steps behind it (links to the Step page)."""

import streamlit as st

from rldiag import api
from rldiag.app import session
from rldiag.app.main import page_path
from rldiag.viz import health

st.title("Health")
store = session.store_or_stop()


def page() -> None:
    deep = st.toggle("Recompute the run for the doctor's own signals (slower)", key="he_recompute", value=False,
                     disabled=not session.can_write(store))
    key = (str(store.run), deep, store.status().size, tuple(store.steps()), tuple(store.scenario_names()))
    cached = st.session_state.get("he_report")
    if cached is None or cached[0] != key or st.button("Run the doctor again", key="he_again"):
        bar = st.progress(0.0, text="doctor")
        report = api.diagnose(store.run, recompute=deep, device="cpu",
                              progress=session.progress_callback(bar, "doctor"))
        bar.empty()
        st.session_state["he_report"] = (key, report)
    report = st.session_state["he_report"][1]
    views = health.finding_views(report)
    st.caption(health.coverage_line(report))
    if report.recompute_error:
        st.warning(f"Recompute skipped: {report.recompute_error}")
    if report.healthy:
        st.success(f"No finding: {len(report.passed)} rules passed over {report.logged_steps} logged and "
                   f"{report.recomputed_steps} recomputed steps.")
    for v in views:
        with st.container(border=True):
            st.markdown(f"{v.icon} **{v.title}** · `{v.rule}` · {v.severity}")
            st.markdown(v.message)
            st.caption(v.why)
            if v.steps:
                cols = st.columns(min(len(v.steps), 6))
                for i, s in enumerate(v.steps):
                    cols[i % len(cols)].page_link(page_path("step.py"), label=f"step {s}", query_params={"step": str(s)},
                                                  icon=":material/biotech:")
                if v.more_steps:
                    st.caption(f"and {v.more_steps} more steps")
    with st.expander("Rules without a finding"):
        st.dataframe(health.outcome_rows(report), hide_index=True)


with session.guard():
    page()
