"""Off-policy: why the rollout engine's log-probs differ from the trainer's (the mismatch
diagnosis, computed on open from the background baseline, and the pictures of its fingerprints on one step), then how far the
rollout policy is from the trainer's (``rollout_corr/*``): IS weights and their distribution,
effective sample size, KL, chi-squared, PPL gap, rejection fractions."""

from __future__ import annotations

import polars as pl
import streamlit as st

from rldiag import api
from rldiag.app import session
from rldiag.errors import RldiagError
from rldiag.store.downsample import DEFAULT_POINTS
from rldiag.viz import mismatch
from rldiag.viz.charts import histogram, metric_grid, quantile_band
from rldiag.viz.offpolicy import baseline_first, has_rollout_corr, panels

BASELINE = "baseline"
DIAGNOSIS = "mismatch diagnosis"

st.title("Off-policy")
store = session.store_or_stop()


def diagnosis() -> api.MismatchResult | None:
    """The run's mismatch diagnosis (:func:`rldiag.api.mismatch`): once the background baseline
    is up to date, from its per-step fingerprints (every unchanged step reused), kept in the
    session until the batch files or the config change; None while the baseline is being
    computed, or when it cannot be had (the error or the reason shown)."""
    key = (str(store.run), store.inputs_sig())
    cached = st.session_state.get("op_mismatch")
    if cached is None or cached[0] != key:
        snap = session.baseline_state(store)
        if snap is not None and snap.busy:
            st.info("The diagnosis reads the baseline's per-step fingerprints: it shows here as soon as the "
                    "baseline (above) is computed. The pictures below are drawn from the batch files meanwhile.")
            return None
        write = session.can_write(store)  # else the statistics alone, streamed, nothing written
        bar = st.progress(0.0, text=DIAGNOSIS)
        progress = session.progress_callback(bar, DIAGNOSIS)
        try:
            with session.baseline_lock(store), session.heavy_work():
                result: api.MismatchResult | str = api.mismatch(store.run, device="cpu", write=write,
                                                                   progress=progress)
        except RldiagError as exc:
            result = f"{type(exc).__name__}: {exc}"
        bar.empty()
        st.session_state["op_mismatch"] = cached = (key, result)
    result = cached[1]
    if isinstance(result, str):
        st.error(result)
        return None
    return result


def show_diagnosis(diag: api.MismatchResult) -> None:
    views = mismatch.cause_views(diag)
    said = mismatch.verdict(diag)
    if said is not None:
        box, text = said
        getattr(st, box)(text)
    for v in views:
        with st.container(border=True):
            st.markdown(f"**{v.title}** · `{v.cause}` · :{v.badge}-badge[{v.severity}] · confidence {v.confidence}")
            getattr(st, v.box)(v.message)
            st.caption(f"Statistic: {v.statistic}")
            st.markdown(f"**Steps:** {v.steps}")
            st.markdown(f"**Remedy:** {v.remedy}")
            if v.examples is not None:
                if v.cause == "outlier_tokens":
                    st.dataframe(v.examples, hide_index=True, key=f"op_mm_examples_{v.cause}")
                else:
                    with st.expander("Tokens with the largest gaps"):
                        st.dataframe(v.examples, hide_index=True, key=f"op_mm_examples_{v.cause}")
    for note in diag.notes:
        st.caption(f"Note: {note}")


@st.cache_data(max_entries=16, show_spinner=False)
def step_tokens(run: str, step: int, sig: tuple) -> pl.DataFrame:
    """One step's actor tokens (:func:`rldiag.api.mismatch_tokens`); ``sig`` keys the cache on
    the batch files."""
    return api.mismatch_tokens(run, step)


def pictures(steps: list[int], preferred: list[int]) -> None:
    """The fingerprints on one step's tokens, the step picked with a slider."""
    over = store.joined([mismatch.KL_METRIC, *mismatch.SHIFT_METRICS], [BASELINE])
    column = store.source_columns([BASELINE])[BASELINE]
    default = mismatch.default_step(steps, mismatch.metric_by_step(over, mismatch.KL_METRIC, column), preferred)
    if st.session_state.get("op_mm_step") not in steps:
        st.session_state["op_mm_step"] = default
    step = st.select_slider("Step of the pictures", steps, key="op_mm_step") if len(steps) > 1 else steps[0]
    try:
        with st.spinner(f"Reading step {step}'s tokens"):
            tokens = step_tokens(str(store.run), int(step), store.inputs_sig())
    except RldiagError as exc:
        session.show_error(exc)
        return
    if tokens.is_empty():
        st.info(f"Step {step} has no actor token with both log-probs.")
        return
    c1, c2 = st.columns(2)
    c1.plotly_chart(mismatch.logprob_figure(tokens), key="op_mm_logprob")
    c2.plotly_chart(mismatch.gap_figure(tokens), key="op_mm_gap")
    c1, c2 = st.columns(2)
    c1.plotly_chart(mismatch.position_figure(tokens), key="op_mm_position")
    c2.plotly_chart(mismatch.shift_figure(mismatch.shift_agreement(tokens), int(step), over, column), key="op_mm_shift")
    lags = mismatch.lag_profile(tokens)
    if lags is not None:
        st.plotly_chart(mismatch.lag_figure(lags), key="op_mm_lag")
    st.markdown(f"**Tokens with the largest shares of step {step}'s KL** (gap² / 2)")
    st.dataframe(mismatch.top_kl_tokens(tokens), hide_index=True, key="op_mm_top")


def mismatch_section() -> None:
    st.subheader("Rollout vs trainer log-probs")
    diag = diagnosis()
    if diag is not None:
        show_diagnosis(diag)
        if not diag.steps:
            return
        steps, preferred = list(diag.steps), list(diag.causes[0].steps) if diag.causes else []
    else:
        steps, preferred = store.steps(), []
    if steps:
        pictures(steps, preferred)


def bands_section() -> None:
    """The run's values placed in their published reference bands (:func:`rldiag.api.reference_bands`:
    the baseline's recomputed values, else the logged ones, under the run's settings)."""
    st.subheader("Reference bands")
    metrics = api.band_metrics()
    joined = store.joined(metrics, [BASELINE])
    columns = store.source_columns([BASELINE])
    values = {}
    for m in metrics:
        by_step = (mismatch.metric_by_step(joined, m, columns.get(BASELINE, BASELINE))
                   or mismatch.metric_by_step(joined, m, columns["logged"]))
        if by_step:
            values[m] = list(by_step.values())
    placed = api.reference_bands(store.run, values)
    if not placed:
        st.caption("No metric with a reference band has a value yet (docs/bands.md lists the bands).")
        return
    for p in placed:
        st.markdown(f"- {p['text']} ({p['statistic']})")
    with st.expander("Where the bands come from"):
        st.dataframe([{"metric": p["metric"], "band": b["band"], "low": b["low"], "high": b["high"],
                       "assumed": ", ".join(f"{k}={b['conditions'][k]}" for k in b["assumed"]), "source": b["source"]}
                      for p in placed for b in p["bands"]], hide_index=True, key="op_bands_sources")


def page() -> None:
    mismatch_section()
    bands_section()
    scenarios = store.scenario_names()
    with_rc = [s for s in scenarios if panels(store.scenario_metric_names(s))]
    key = session.widget_key("op_scenarios")
    if st.session_state.get("op_scenarios_auto", True):
        # until the overlay is changed by hand: the baseline (and one more), as scenarios appear
        # (a new key when it changes: no request sent before cancels it)
        key = session.set_widget("op_scenarios", baseline_first(with_rc)[:2])
    overlay = st.multiselect("Recomputed scenarios on the same axes", with_rc, key=key,
                             on_change=session.by_hand, args=("op_scenarios_auto", "op_scenarios", key))
    groups = panels(store.metric_names(overlay))
    if not has_rollout_corr(groups):
        snap = session.baseline_state(store)
        if snap is not None and snap.busy:
            st.info("No rollout_corr/* metrics yet: the run logged none, and the baseline that computes them is "
                    "under way (above).")
        else:
            st.info("No rollout_corr/* metrics: the run logged none and no scenario computed them. They need the "
                    "batches' rollout_log_probs; recompute on the What-if page (rollout_is=token adds IS weights).")
    for title, metrics in groups.items():
        st.subheader(title)
        joined = store.joined(metrics, overlay, points=DEFAULT_POINTS)
        st.plotly_chart(metric_grid(joined, metrics, store.source_columns(overlay), columns=3, row_height=230),
                        key=f"op_panel_{title}")

    st.subheader("IS weight distribution")
    with_w = store.scenarios_with_token_column("rollout_is_weights")
    if not with_w:
        st.caption("No scenario saved rollout IS weights (recompute with rollout_is=token or sequence on the What-if page).")
        return
    scen = st.selectbox("Scenario", with_w, key="op_is_scenario")
    if scen is None:  # Streamlit's selectbox gives None only without options
        return
    st.plotly_chart(quantile_band(store.is_quantiles(scen), f"IS weight over steps · {scen}"), key="op_is_band")
    token_steps = store.token_steps(scen)
    step = st.select_slider("Step", token_steps, key="op_is_step") if len(token_steps) > 1 else token_steps[0]
    w = store.is_weights(scen, step)
    st.plotly_chart(histogram(w["weight"].to_numpy(), f"IS weights of step {step}", "IS weight"), key="op_is_hist")


with session.guard():
    page()
