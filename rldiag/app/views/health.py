"""Health: the doctor's findings over the logged metrics and the background baseline, each with the
steps behind it (links to the Step page); the layout audit (which metrics are artefacts of the
parallel layout)."""

from __future__ import annotations

import contextlib

import streamlit as st

from rldiag import api
from rldiag.app import session
from rldiag.app.main import page_path
from rldiag.errors import RldiagError
from rldiag.viz import health, layout_audit

st.title("Health")
store = session.store_or_stop()


def doctor() -> tuple[api.DiagnoseResult, bool]:
    """The doctor's report and whether it has the recomputed signals: the run's logged metrics
    and the background baseline's (read back by :func:`rldiag.api.diagnose`, every unchanged step
    reused) once the baseline is up to date; until then the last full report of the session, else
    the logged metrics alone. Kept until the logged metrics, the batch files, the config or the
    baseline change, or "Run the doctor again"."""
    snap = session.baseline_state(store)
    waiting = snap is not None and snap.busy
    full = not waiting and session.can_write(store)
    key = (str(store.run), full, store.status().size, store.inputs_sig(), snap.version if snap else 0)
    cached = st.session_state.get("he_report")
    if waiting and cached is not None and cached[2]:
        return cached[1], True  # the last full report, while the baseline catches up
    if cached is None or cached[0] != key or st.button("Run the doctor again", key="he_again"):
        bar = st.progress(0.0, text="doctor")
        with session.baseline_lock(store) if full else contextlib.nullcontext():
            report = api.diagnose(store.run, recompute=full, device="cpu",
                                  progress=session.progress_callback(bar, "doctor"))
        bar.empty()
        st.session_state["he_report"] = cached = (key, report, full)
    return cached[1], bool(cached[2])


def page() -> None:
    report, full = doctor()
    snap = session.baseline_state(store)
    if snap is not None and snap.busy:
        st.info("The baseline is being computed (above): the findings below "
                + ("are those of its last version" if full else "are the logged metrics' alone")
                + "; the doctor's own signals join when it is done.")
    views = health.finding_views(report)
    st.caption(health.coverage_line(report))
    if report.recompute_error:
        st.warning(f"Recompute skipped: {report.recompute_error}")
    for rid, why in report.counterfactual_errors.items():
        st.caption(f"Counterfactual of `{rid}` not computed: {why}")
    if report.healthy:
        st.success(f"No finding: {len(report.passed)} rules passed over {report.logged_steps} logged and "
                   f"{report.recomputed_steps} recomputed steps.")
    for f, v in zip(report.findings, views, strict=True):
        with st.container(border=True):
            st.markdown(f"{v.icon} **{v.title}** · `{v.rule}` · {v.severity}")
            st.markdown(v.message)
            if v.state:
                colour = health.STATE_COLOURS.get(f.evidence.state or "", "gray")
                st.markdown(f"State: :{colour}[**{v.state}**]")
            if v.sparkline and v.sparkline.get("steps"):
                st.caption(f"{v.sparkline.get('metric')} over the window, with the rule's threshold (dashed)")
                st.plotly_chart(health.sparkline_figure(v.sparkline, f.evidence.state_since),
                                key=f"he_spark_{v.rule}_{f.evidence.cause or ''}", config={"displayModeBar": False})
            if f.evidence.band is not None:
                st.markdown(f"Reference band ({f.evidence.band['statistic']}): {f.evidence.band['text']}")
            if f.evidence.calibration is not None:
                st.caption(f"Calibration: {f.evidence.calibration['text']}")
            st.caption(v.why)
            if v.steps:
                cols = st.columns(min(len(v.steps), 6))
                for i, s in enumerate(v.steps):
                    cols[i % len(cols)].page_link(page_path("step.py"), label=f"step {s}", query_params={"step": str(s)},
                                                  icon=":material/biotech:")
                if v.more_steps:
                    st.caption(f"and {v.more_steps} more steps")
            if v.counterfactual:
                st.markdown("**What the settings that address it change on these batches**")
                for line in v.counterfactual:
                    st.markdown(f"- {line}")
                st.dataframe(v.counterfactual_rows, hide_index=True)
                st.caption(f"Counterfactual: {api.COUNTERFACTUAL_CAVEAT}.")
            for line in v.skipped:
                st.caption(f"Not tried: {line}")
            for line in v.implies:
                st.markdown(f"Implies (a consequence of this cause, not a second one): {line}")
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
    snap = session.baseline_state(store)
    busy = snap is not None and snap.busy  # the baseline first: then the audit (both take the CPU)
    if busy and "he_layout_audit" not in st.session_state:
        st.info("The layout audit runs once the baseline (above) is computed.")
        return
    key = (str(store.run), layout_audit.batch_key(files))
    cached = st.session_state.get("he_layout_audit")
    if (not busy and (cached is None or cached[0] != key)) or st.button("Audit the layouts again", key="he_layout_again"):
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
