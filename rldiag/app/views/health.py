"""Health: the doctor's findings, each with the steps behind it (links to the Step page); the layout
audit (which metrics are artefacts of the parallel layout)."""

import streamlit as st

from rldiag import api
from rldiag.app import session
from rldiag.app.main import page_path
from rldiag.errors import RldiagError
from rldiag.viz import health, layout_audit

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
    layout_audit_section()


def layout_audit_section() -> None:
    """The layout audit, computed on open (when the run has batches and rldiag may write into it),
    kept for the session while the batch files stay the same."""
    st.subheader("Layout audit")
    st.caption(layout_audit.ABOUT)
    files = store.batches.files()
    if not files:
        st.info("No batch files: the layout audit recomputes the run's batches under other layouts.")
        return
    if not session.can_write(store):
        return
    key = (str(store.run), layout_audit.batch_key(files))
    cached = st.session_state.get("he_layout_audit")
    if cached is None or cached[0] != key or st.button("Audit the layouts again", key="he_layout_again"):
        bar = st.progress(0.0, text="layout audit")
        try:
            result = api.layout_audit(store.run, device="cpu", progress=session.progress_callback(bar, "layout audit"))
        except RldiagError as exc:  # the doctor's findings above stay on the page
            bar.empty()
            st.warning(f"The layout audit could not run: {type(exc).__name__}: {exc}")
            return
        bar.empty()
        st.session_state["he_layout_audit"] = (key, result)
    result = st.session_state["he_layout_audit"][1]
    st.caption(layout_audit.summary_line(result))
    rows = layout_audit.dependent_rows(result)
    if rows:
        st.markdown("**Layout-dependent metrics**")
        st.table(rows)
    else:
        st.success("No metric depends on the layout under the layouts recomputed.")
    st.markdown("**Layouts recomputed**")
    st.table(layout_audit.layout_rows(result))
    skipped = layout_audit.skipped_rows(result)
    if skipped:
        st.markdown("**Layouts skipped**")
        st.table(skipped)


with session.guard():
    page()
