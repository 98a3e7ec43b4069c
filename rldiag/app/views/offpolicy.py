"""Off-policy: how far the rollout policy is from the trainer's (``rollout_corr/*``): IS weights
and their distribution, effective sample size, KL, chi-squared, PPL gap, rejection fractions."""

import streamlit as st

from rldiag.app import session
from rldiag.store.downsample import DEFAULT_POINTS
from rldiag.viz.charts import histogram, metric_grid, quantile_band
from rldiag.viz.offpolicy import baseline_first, panels

st.title("Off-policy")
store = session.store_or_stop()


def page() -> None:
    scenarios = store.scenario_names()
    with_rc = [s for s in scenarios if panels(store.scenario_metric_names(s))]
    if "op_scenarios" not in st.session_state:
        st.session_state["op_scenarios"] = baseline_first(with_rc)[:2]
    overlay = st.multiselect("Recomputed scenarios on the same axes", with_rc, key="op_scenarios")
    groups = panels(store.metric_names(overlay))
    if not groups:
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
