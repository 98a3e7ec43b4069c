"""Step: one step's groups under two scenarios, one row's tokens as a heat strip, and the
debugging checklist (scores, rewards, masks, groups, advantages, then ratios) evaluated on the step."""

import streamlit as st

from rldiag import api
from rldiag.app import pagework, session
from rldiag.store.tokentext import RANKINGS
from rldiag.viz.charts import group_figure, heat_strip
from rldiag.viz.checklist import RATIO_METRICS, evaluate
from rldiag.viz.stepview import interesting_row, rollout_n, row_label, scenario_settings
from rldiag.viz.tokentext import COLOURINGS, token_html, top_rows

#: tokens listed per ranking
TOP_K = 10
BASELINE = "baseline"

st.title("Step")
store = session.store_or_stop()


def pick_step(steps: list[int]) -> int:
    wanted = st.query_params.get("step")
    if wanted is not None and wanted != st.session_state.get("st_link_seen"):
        # arrived from a link (the Health page): show the linked step once
        st.session_state["st_link_seen"] = wanted
        if wanted.lstrip("-").isdigit() and int(wanted) in steps:
            st.session_state["st_step"] = int(wanted)
    if st.session_state.get("st_step") not in steps:
        st.session_state["st_step"] = steps[0]
    step = st.selectbox("Step", steps, key="st_step")
    if step is None:  # Streamlit's selectbox gives None only without options
        st.stop()
    st.query_params["step"] = str(step)  # the view is in the URL
    st.session_state["st_link_seen"] = str(step)
    return step


def step_tokens(step: int) -> None:
    """The baseline's per-token values of ``step``, computed on demand when no scenario has them
    (a one-step recompute into the baseline's token cache: well under a second for a step of a
    thousand rows); a step that failed is not tried again until the run's files change."""
    key = (str(store.run), step, store.inputs_sig())
    failed = st.session_state.setdefault("st_tokens_failed", {})
    if key in failed:
        st.warning(f"Step {step}'s per-token values could not be computed: {failed[key]}")
        return
    with st.spinner(f"Computing step {step}'s per-token values (the run's own settings)"):
        with session.tokens_lock(store), session.heavy_work():
            # in a child process (a large step's recompute does not stay in the server's memory),
            # the background baseline paused meanwhile (never two steps' peaks at once)
            got = pagework.in_child(api.step_tokens, store.run, step, BASELINE, device="cpu")
    if got.error:
        failed[key] = got.error
        st.warning(f"Step {step}'s per-token values could not be computed: {got.error}")


def pick_scenarios(step: int) -> tuple[str | None, str | None]:
    have = store.scenarios_with_tokens(step)
    if BASELINE not in have and session.can_write(store):
        step_tokens(step)
        have = store.scenarios_with_tokens(step)
    if not have:
        st.info("No scenario has per-token outputs for this step, so advantages, ratios and IS weights are "
                "not available (rldiag cannot write this run's outputs).")
        return None, None
    c1, c2 = st.columns(2)
    a = c1.selectbox("Scenario A", have, key="st_a", index=have.index(BASELINE) if BASELINE in have else 0)
    rest = [s for s in have if s != a]
    b = c2.selectbox("Scenario B", ["(none)"] + rest, key="st_b", index=1 if rest else 0)
    return a, (None if b == "(none)" else b)


def response_text(step: int, row: int, scenario: str | None, tokens: dict) -> None:
    """The row's response as text coloured per token, and the step's tokens that stand out."""
    st.subheader("Response text")
    text = store.row_text(step, row)
    if text is None:
        st.caption("The batch has no `response_tokens` column (one string per response token). With it, the "
                   "response shows here as text, each token coloured by its advantage, ratio, IS weight or KL.")
        return
    have = [k for k in COLOURINGS if tokens.get(k) is not None]
    kind = st.radio("Colour by", have, key="st_colour", horizontal=True, format_func=lambda k: COLOURINGS[k][0]) if have else None
    if not have:
        st.caption("No scenario saved per-token values for this step: the text is shown uncoloured.")
    st.html(token_html(text, tokens.get("mask", []), tokens.get(kind) if kind else None, kind))
    if scenario is None:
        return
    st.subheader("Tokens that stand out in this step")
    for tab, k in zip(st.tabs(list(RANKINGS)), RANKINGS):
        top = store.top_tokens(step, scenario, k, TOP_K)
        with tab:
            if top is None or top.is_empty():
                st.caption(f"Scenario `{scenario}` saved no {k} for this step.")
            else:
                st.dataframe(top_rows(top), hide_index=True, key=f"st_top_{k}")


def page() -> None:
    steps = store.steps()
    if not steps:
        st.info(f"{store.run} has no batch files (batches/step_<N>.parquet).")
        return
    step = pick_step(steps)
    a, b = pick_scenarios(step)
    scen = [s for s in (a, b) if s]

    st.subheader("Groups")
    rows = store.step_rows(step, scen)
    st.plotly_chart(group_figure(rows, scen), key="st_groups")

    st.subheader("One row's tokens")
    labels = {r["row"]: row_label(r) for r in rows.iter_rows(named=True)}
    if st.session_state.get("st_row") not in labels:
        st.session_state["st_row"] = interesting_row(rows)
    row = st.selectbox("Row", list(labels), format_func=lambda r: labels[r], key="st_row")
    if row is None:  # a step without rows
        st.stop()
    tokens = store.row_tokens(step, row, a)
    st.plotly_chart(heat_strip(tokens), key="st_strip")
    response_text(step, row, a, tokens)

    st.subheader("Debugging checklist")
    settings = scenario_settings(store.scenario_meta(a) if a else None, api.settings(store.run).values)
    facts = store.step_facts(step, a)
    at_step = {}
    if a:
        values = store.metrics_at(step, list(RATIO_METRICS), [a])
        for source in ("logged", a):
            if source in values.columns:
                at_step[source] = dict(zip(values["metric"].to_list(), values[source].to_list()))
    checks = evaluate(facts, settings.get("algorithm.adv_estimator", "gae"),
                      rollout_n(settings), at_step, api.rule_limits())
    for c in checks:
        st.markdown(c.markdown)
    problems = store.batches.problems
    if problems:
        st.warning("Batch files skipped: " + "; ".join(f"{k}: {v}" for k, v in problems.items()))


with session.guard():
    page()
