"""What-if: recompute the run under other settings and see baseline, scenario and logged values
side by side, with the compare command's agreement of the advantages."""

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import streamlit as st

from rldiag import api
from rldiag.app import gate, session
from rldiag.config import schema
from rldiag.config.settings import unchanged_overrides, unchanged_warning
from rldiag.errors import RldiagError
from rldiag.io.run_layout import STEP_FILE
from rldiag.store.downsample import DEFAULT_POINTS
from rldiag.viz import comparison, whatif
from rldiag.viz import sweep as vsweep
from rldiag.viz.charts import agreement_figure
from rldiag.viz.echarts import PANEL_HEIGHT, metric_panel
from rldiag.viz.metric_groups import default_selection

BASELINE = "baseline"

st.title("What-if")
store = session.store_or_stop()


def _number(col: Any, key: str, base: dict, widget_key: str) -> float:
    """A number input for ``key`` with the bounds its row of the settings schema declares."""
    w = schema.widget(key)
    return col.number_input(w.label, w.lo, w.hi, float(base[key]), w.step, key=widget_key, format=w.fmt)


def settings_widgets(opts: api.WhatifOptions) -> dict:
    """The widgets, initialised from the run's own settings; returns the chosen values."""
    chosen: dict[str, Any] = {}
    base, choices = opts.base, opts.choices
    with st.expander("Advantage and loss", expanded=True):
        c1, c2, c3 = st.columns(3)
        chosen[whatif.ESTIMATOR] = _select(c1, "Advantage estimator", whatif.ESTIMATOR, opts, "wi_estimator")
        chosen[whatif.AGG] = _select(c2, "loss_agg_mode", whatif.AGG, opts, "wi_agg")
        chosen[whatif.LOSS] = _select(c3, "Policy loss", whatif.LOSS, opts, "wi_loss")
        c1, c2, c3, c4 = st.columns(4)
        chosen[whatif.CLIP_LOW] = _number(c1, whatif.CLIP_LOW, base, "wi_clip_low")
        chosen[whatif.CLIP_HIGH] = _number(c2, whatif.CLIP_HIGH, base, "wi_clip_high")
        chosen[whatif.CLIP_C] = _number(c3, whatif.CLIP_C, base, "wi_clip_c")
        chosen[whatif.NORM_STD] = c4.checkbox("norm_adv_by_std_in_grpo", bool(base[whatif.NORM_STD]), key="wi_norm")

    with st.expander("KL", expanded=bool(base[whatif.KL_IN_REWARD])):
        c1, c2, c3, c4 = st.columns(4)
        chosen[whatif.KL_IN_REWARD] = c1.checkbox("KL in reward", bool(base[whatif.KL_IN_REWARD]), key="wi_kl_reward")
        chosen[whatif.KL_PENALTY] = _select(c2, "kl_penalty", whatif.KL_PENALTY, opts, "wi_kl_penalty")
        chosen[whatif.KL_CTRL] = _select(c3, "kl_ctrl.type", whatif.KL_CTRL, opts, "wi_kl_ctrl")
        chosen[whatif.KL_COEF] = _number(c4, whatif.KL_COEF, base, "wi_kl_coef")
        c1, c2, c3 = st.columns([1, 1, 2])
        chosen[whatif.KL_LOSS] = c1.checkbox("KL loss", bool(base[whatif.KL_LOSS]), key="wi_kl_loss")
        chosen[whatif.KL_LOSS_TYPE] = _select(c2, "kl_loss_type", whatif.KL_LOSS_TYPE, opts, "wi_kl_loss_type")
        chosen[whatif.KL_LOSS_COEF] = _number(c3, whatif.KL_LOSS_COEF, base, "wi_kl_loss_coef")

    uses_rc = bool(base[whatif.IS_LEVEL] or base[whatif.RS] or base[whatif.BYPASS])
    with st.expander("Rollout correction", expanded=uses_rc):
        c1, c2, c3, c4 = st.columns(4)
        levels = ["none"] + choices[whatif.IS_LEVEL]
        level = c1.selectbox("rollout_is", levels, key="wi_is",
                             index=_index(levels, base[whatif.IS_LEVEL] if base[whatif.IS_LEVEL] else "none"))
        chosen[whatif.IS_LEVEL] = None if level == "none" else level
        chosen[whatif.IS_THRESHOLD] = whatif.parse_value(
            c2.text_input("rollout_is_threshold", str(base[whatif.IS_THRESHOLD]), key="wi_is_threshold",
                          help="A number (TIS: truncate above it) or lower_upper (IcePop: zero outside)"))
        chosen[whatif.IS_NORMALIZE] = c3.checkbox("batch-normalize IS", bool(base[whatif.IS_NORMALIZE]),
                                                  key="wi_is_norm")
        chosen[whatif.BYPASS] = c4.checkbox("bypass_mode", bool(base[whatif.BYPASS]), key="wi_bypass")
        c1, c2 = st.columns([3, 1])
        rs = c1.multiselect("rollout_rs (rejection)", choices[whatif.RS], default=whatif.rs_options(base[whatif.RS]),
                            key="wi_rs")
        chosen[whatif.RS] = whatif.rs_value(rs)
        rs_thr = base[whatif.RS_THRESHOLD]
        chosen[whatif.RS_THRESHOLD] = whatif.parse_value(
            c2.text_input("rollout_rs_threshold", "" if rs_thr is None else str(rs_thr), key="wi_rs_threshold"))
    return chosen


def _index(options: list, value) -> int:
    return options.index(value) if value in options else 0


def _select(col: Any, label: str, key: str, opts: api.WhatifOptions, widget_key: str) -> str:
    """A select box of ``key``'s choices, on the run's own value."""
    names = opts.choices[key]
    return col.selectbox(label, names, key=widget_key, index=_index(names, opts.base[key]))


def _cancel(what: str, name: str) -> None:
    st.session_state["wi_cancelled"] = (what, name)


def cancel_button(what: str, name: str) -> None:
    """A Cancel button shown while ``what`` of scenario ``name`` runs: pressing it makes Streamlit
    stop this run at its next progress update (nothing half-written is kept: scenarios and
    comparisons are replaced atomically) and draw the page again."""
    st.button(f"Cancel the {what}", key=f"wi_cancel_{what}", on_click=_cancel, args=(what, name))


def cancelled_note(what: str, name: str) -> None:
    """What a Cancel did, as the run directory shows it: a press that came after the work had
    been written (its last step done, the scenario or comparison already in place) cancelled
    nothing, and the page says so rather than that nothing was written."""
    if what == "recompute":
        written = name in store.scenario_names()
    else:
        saved = store.comparison(BASELINE, name)
        written = saved is not None and not saved.stale
    if written:
        st.info(f"The {what} of `{name}` had finished before Cancel was pressed: it is saved and shown below.")
    else:
        st.info(f"Cancelled: the {what} of `{name}` was not written; the page shows what was saved before.")


def run_scenarios(name: str, ovr: dict) -> None:
    """Recompute the baseline (when missing, or without per-token outputs) and the scenario; the steps that failed are kept
    to leave them out of the compare and to name them."""
    bar = st.progress(0.0, text="starting")
    cancel_button("recompute", name)
    failed: dict[int, str] = {}
    if name != BASELINE:
        # the compare needs the baseline's per-token outputs: the background baseline saves none
        with session.baseline_lock(store):
            if BASELINE not in store.scenario_names() or not store.token_steps(BASELINE):
                base = api.recompute(store.run, name=BASELINE, save_tokens=True,
                                     progress=session.progress_callback(bar, BASELINE))
                failed.update(base.steps_failed)
    with session.baseline_lock(store) if name == BASELINE else contextlib.nullcontext():
        report = api.recompute(store.run, ovr, name=name, save_tokens=True, progress=session.progress_callback(bar, name))
    failed.update(report.steps_failed)
    st.session_state.setdefault("wi_failed", {})[name] = failed
    bar.progress(1.0, text=f"{name}: {len(report.steps_done)} steps in {report.seconds:.1f} s"
                           + (f", {len(failed)} failed" if failed else ""))
    st.session_state["wi_compare_now"] = name


def reward_widget() -> str:
    """The reward function of a reward what-if (``FILE.py:NAME``, ``MODULE:NAME``), or ``""``. Off
    in shared mode: a reward function is code the app would run for whoever opens it."""
    with st.expander("Reward function", expanded=False):
        if gate.policy().shared:
            st.caption("Re-scoring with a reward function is off: this app is shared, and a reward function is code "
                       "it would run (rldiag rescore on the command line does it).")
            return ""
        text = st.text_input("Re-score with (FILE.py:NAME or MODULE:NAME; empty: the captured scores)", "",
                             key="wi_reward", help="Called as verl calls it, in worker processes (docs/rescore.md)")
        return text.strip()


def run_rescore(name: str, ovr: dict, reward: str) -> None:
    """The baseline with tokens (for the compare), then the re-scored scenario with tokens."""
    bar = st.progress(0.0, text="starting")
    with session.baseline_lock(store):
        if BASELINE not in store.scenario_names() or not store.token_steps(BASELINE):
            api.recompute(store.run, name=BASELINE, save_tokens=True, progress=session.progress_callback(bar, BASELINE))
    result = api.rescore(store.run, reward, ovr, name=name, save_tokens=True,
                         progress=session.progress_callback(bar, name))
    st.session_state.setdefault("wi_failed", {})[name] = dict(result.steps_failed)
    bar.progress(1.0, text=f"{name}: {result.rows} rows scored, {result.changed} changed, "
                           f"{result.failures.height} calls failed")
    if result.failures.height:
        st.dataframe(result.failures.head(50), hide_index=True)
    st.session_state["wi_compare_now"] = name


def failed_steps_note(name: str) -> None:
    failed = st.session_state.get("wi_failed", {}).get(name) or {}
    problems = store.batches.problems
    if failed:
        st.warning(f"{len(failed)} step(s) could not be recomputed and are left out: "
                   + "; ".join(f"step {s}: {m}" for s, m in sorted(failed.items())[:5])
                   + (f"; and {len(failed) - 5} more" if len(failed) > 5 else ""))
    elif problems:
        st.warning("Batch files skipped: " + "; ".join(f"{k}: {v}" for k, v in problems.items()))


def fit_warning(settings_chosen: dict, grouped: Sequence[str]) -> None:
    steps = store.steps()
    if not steps:
        return
    rows = store.step_rows(steps[0])
    sizes = rows.group_by("grp").len()["len"].to_list() if not rows.is_empty() else []
    msg = whatif.estimator_fit(settings_chosen[whatif.ESTIMATOR], sizes, steps[0], grouped)
    if msg:
        st.warning(msg, icon=":material/warning:")


def compare_steps(name: str) -> list[int] | None:
    """The steps to compare: every batch step but those that failed (None: all)."""
    failed = set(st.session_state.get("wi_failed", {}).get(name) or {}) | _unreadable()
    if not failed:
        return None
    good = [s for s in store.steps() if s not in failed]
    return good or None


def _unreadable() -> set[int]:
    bad = set()
    for k in store.batches.problems:  # the files skipped, by path
        m = STEP_FILE.match(Path(k).name)
        if m:
            bad.add(int(m.group(1)))
    return bad


def run_compare(name: str) -> bool:
    """Compare the baseline with ``name`` step by step, with progress, a Cancel button and the
    steps compared so far drawn as they come; an error names its step and leaves everything
    else on the page (the steps compared before it included). True when it finished."""
    bar = st.progress(0.0, text="compare: starting")
    cancel_button("compare", name)
    live = st.empty()
    seen: list[api.TokenAgreement] = []
    done: dict[str, str | None] = {"what": None}
    update = session.progress_callback(bar, "compare")

    def progress(i: int, total: int, what: str) -> None:
        done["what"] = what
        update(i, total, what)
        if seen and comparison.redraw_due(i, total):
            rows, frame = comparison.partial_view(seen)
            with live.container():
                st.caption(f"So far: {len(seen)} of {total} steps compared.")
                st.dataframe(rows, hide_index=True, key=f"wi_live_table_{i}")
                st.plotly_chart(agreement_figure(frame), key=f"wi_live_chart_{i}")

    steps = compare_steps(name)
    try:
        report = api.compare(store.run, BASELINE, name, steps=steps, recompute_missing=False, progress=progress,
                             on_step=seen.append)
    except RldiagError as exc:
        after = f" after {done['what']}" if done["what"] is not None else ""
        bar.progress(1.0, text=f"compare stopped{after}")
        st.error(f"The compare stopped{after}: {type(exc).__name__}: {exc}. The values above do not depend on it.")
        return False
    live.empty()
    bar.progress(1.0, text=f"compare: {len(report.token_steps)} steps")
    return True


def metric_panels(metrics: list[str], shown: list[str], prefix: str) -> None:
    """Each metric over the steps for the logged values and the scenarios ``shown``, two panels a row."""
    joined = store.joined(metrics, shown, points=DEFAULT_POINTS)
    columns = store.source_columns(shown)
    grid: Sequence[Any] = ()
    for k, metric in enumerate(metrics):  # ECharts, as on the metrics page: no wait for plotly's bundle
        if k % 2 == 0:
            grid = st.columns(2)
        panel = metric_panel(joined, metric, columns, selectable=False)
        with grid[k % 2]:
            st.echarts_chart(panel.spec, key=f"{prefix}:{metric}", height=PANEL_HEIGHT, renderer="svg")


def results(name: str) -> None:
    scenarios = store.scenario_names()
    shown = [s for s in (BASELINE, name) if s in scenarios]
    shown = list(dict.fromkeys(shown))
    if name not in scenarios:
        st.info(f"Scenario `{name}` is not computed yet: press **Recompute**.")
    names = store.metric_names(shown)
    if "wi_metrics" not in st.session_state:
        st.session_state["wi_metrics"] = default_selection(names) if not shown else [
            m for m in whatif.WHATIF_METRICS if m in names] or default_selection(names)
    st.session_state["wi_metrics"] = [m for m in st.session_state["wi_metrics"] if m in names]
    metrics = st.multiselect("Metrics", names, key="wi_metrics")
    if not metrics:
        return
    metric_panels(metrics, shown, "wi_chart")
    st.caption("Mean over steps of each source; the last columns give the scenario minus the baseline.")
    st.dataframe(store.summary(metrics, shown), hide_index=True)
    if name == BASELINE or name not in scenarios:
        return
    st.subheader(f"Compare `{BASELINE}` → `{name}`")
    saved = store.comparison(BASELINE, name)
    if saved is None or saved.stale:
        now = st.session_state.pop("wi_compare_now", None) == name
        if now or st.button("Compare the advantages", key="wi_compare"):
            with session.heavy_work():
                finished = run_compare(name)
            if not finished:
                return
            saved = store.comparison(BASELINE, name)
        else:
            return
    if saved is None:  # written a moment ago, removed since
        st.warning(f"The comparison of `{BASELINE}` and `{name}` is gone from the run; compare again.")
        return
    st.dataframe(comparison.summary_rows(saved.meta.get("summary", {})), hide_index=True)
    st.plotly_chart(agreement_figure(saved.tokens), key="wi_agreement")
    with st.expander("Per-metric deltas (B − A)"):
        st.dataframe(saved.metrics, hide_index=True)


def sweep_grid(opts: api.WhatifOptions) -> dict[str, list[Any]] | None:
    """The sweep's widgets: one or two keys and each one's values (None: a value list is not valid)."""
    keys = vsweep.sweepable_keys()
    picked = st.multiselect("Keys to sweep (one or two)", keys, max_selections=2, key="wi_sw_keys")
    grid: dict[str, list[Any]] = {}
    ok = True
    cols = st.columns(max(1, len(picked)))
    for col, key in zip(cols, picked):
        if key == whatif.ESTIMATOR:
            names = opts.choices[key]
            grid[key] = col.multiselect(f"{key} values", names, default=[n for n in [opts.base[key]] if n in names],
                                        key="wi_sw_vals_estimator")
            continue
        w = schema.widget(key)
        text = col.text_input(f"{key} values", vsweep.values_text(vsweep.default_values(w.lo, w.hi)),
                              key=f"wi_sw_vals:{key}", help=f"Numbers separated by commas, from {w.lo:g} to {w.hi:g}")
        try:
            grid[key] = vsweep.parse_values(text)
        except ValueError as exc:
            col.error(f"{key}: {exc}")
            ok = False
    if not ok or not grid or not all(grid.values()):
        return None
    return grid


def run_sweep(grid: dict[str, list[Any]]) -> None:
    bar = st.progress(0.0, text="sweep: starting")
    report = api.sweep(store.run, grid, progress=session.progress_callback(bar, "sweep"))
    failed = sum(len(v) for v in report.steps_failed.values())
    bar.progress(1.0, text=f"sweep {report.name}: {len(report.scenarios)} scenarios in {report.seconds:.1f} s"
                           + (f", {failed} step(s) failed" if failed else ""))
    st.session_state["wi_sw_name"] = report.name
    st.session_state.pop("wi_sw_scenario", None)


def _pick_from_chart(event: Any, key: str) -> None:
    """A point or cell clicked in a chart opens its scenario (set before the scenario box is drawn)."""
    picked = vsweep.selected_scenario(event)
    last = st.session_state.get("wi_sw_last_pick", {})
    if picked and last.get(key) != picked:
        st.session_state["wi_sw_scenario"] = picked
    st.session_state["wi_sw_last_pick"] = {**last, key: picked}


def sweep_results() -> None:
    names = api.sweeps(store.run)
    if not names:
        st.caption("No sweep in this run yet: pick keys and values above and press **Run the sweep**.")
        return
    if st.session_state.get("wi_sw_name") not in names:
        st.session_state["wi_sw_name"] = names[0]  # the latest
    name = st.selectbox("Sweep", names, key="wi_sw_name")
    if name is None:
        return
    summary = api.sweep_summary(store.run, name)
    own = api.sweep_own(store.run, name)
    keys = vsweep.swept_keys(summary)
    available = vsweep.metric_names(summary)
    if not available:
        st.info(f"Sweep `{name}` has no metrics.")
        return
    chosen = st.session_state.get("wi_sw_metrics")
    if chosen is None:
        chosen = [m for m in whatif.WHATIF_METRICS if m in available] or available[:2]
    st.session_state["wi_sw_metrics"] = [m for m in chosen if m in available]
    metrics = st.multiselect("Sweep metrics", available, key="wi_sw_metrics")
    st.caption(f"Swept: {', '.join(f'`{k}`' for k in keys)}. Each point is a scenario's mean over its steps; "
               "click one (or pick it below) to see its metrics over the steps."
               + (f" The run's own settings are scenario `{own}` (a star; an outlined cell, the colour scale "
                  "centred on its value: blue above, red below)." if own else " No scenario has the run's own settings."))
    if len(keys) > 2:
        st.info("This sweep has more than two keys: its means are in the table; its scenarios below.")
    grid: Sequence[Any] = ()
    for k, metric in enumerate(metrics if len(keys) <= 2 else []):
        if k % 2 == 0:
            grid = st.columns(2)
        fig = vsweep.line_figure(summary, keys[0], metric, own) if len(keys) == 1 else \
            vsweep.heatmap_figure(summary, keys, metric, own)
        chart_key = f"wi_sw_chart:{metric}"
        with grid[k % 2]:
            event = st.plotly_chart(fig, key=chart_key, on_select="rerun", selection_mode="points")
        _pick_from_chart(event, chart_key)
    if metrics:
        with st.expander("Means over the steps"):
            st.dataframe(vsweep.mark_own(vsweep.means(summary, metrics), own), hide_index=True)
    options = vsweep.scenarios(summary)
    if st.session_state.get("wi_sw_scenario") not in options:
        st.session_state.pop("wi_sw_scenario", None)
    scenario = st.selectbox("Scenario of the sweep", options, index=None, placeholder="click a point or pick one",
                            key="wi_sw_scenario")
    if scenario is None or not metrics:
        return
    if scenario not in store.scenario_names():
        st.warning(f"Scenario `{scenario}` is no longer in the run.")
        return
    shown = list(dict.fromkeys(s for s in (BASELINE, scenario) if s in store.scenario_names()))
    st.markdown(f"**`{scenario}`** over the steps")
    metric_panels([m for m in metrics if m in store.metric_names(shown)], shown, "wi_sw_panel")


def sweep_section(opts: api.WhatifOptions, allowed: bool) -> None:
    """Sweep one or two settings: run one (a button: it may be long), and see the latest one
    written into the run without a click."""
    st.subheader("Sweep")
    grid = sweep_grid(opts)
    if grid:
        st.caption(f"{vsweep.scenario_count(grid)} scenario(s), each recomputed over every step.")
        base = api.settings(store.run)
        own = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, vals in grid.items() for v in vals
               if unchanged_overrides(base, {k: v})]
        if own:
            st.caption("The run's own value" + ("s" if len(own) > 1 else "") + f": {', '.join(own)} "
                       "(that scenario is the run's own settings where every key has it).")
    if st.button("Run the sweep", key="wi_sw_run", disabled=not (allowed and grid)):
        assert grid is not None
        with session.heavy_work():
            run_sweep(grid)
    sweep_results()


opts: api.WhatifOptions | None = None  # the run's own settings and their choices, once read
allowed = False
with session.guard():
    opts = api.whatif_options(api.settings(store.run))
    chosen = settings_widgets(opts)
    ovr = whatif.overrides(opts.base, chosen)
    name = whatif.scenario_name(ovr)
    st.markdown(f"**Scenario:** `{name}`" + (f" — overrides: `{ovr}`" if ovr else " (the run's own settings)"))
    same = unchanged_overrides(api.settings(store.run), ovr)
    if same:
        st.warning(unchanged_warning(same, len(same) == len(ovr)), icon=":material/warning:")
    fit_warning(chosen, opts.grouped)
    cancelled = st.session_state.pop("wi_cancelled", None)
    if cancelled:
        cancelled_note(*cancelled)
    has_batches = bool(store.steps())
    if not has_batches:
        st.caption(f"{store.run} has no batch files (batches/step_<N>.parquet): there is nothing to recompute.")
    allowed = has_batches and session.can_write(store)
    reward = reward_widget()
    if reward:
        name = whatif.rescore_name(reward, name if ovr else None)
        st.markdown(f"**Re-scored by** `{reward}` **as** `{name}` (rldiag rescore: the scores change, then everything "
                    "after them)")
    if st.button("Recompute", type="primary", key="wi_run", disabled=not allowed):
        with session.heavy_work():
            if reward:
                run_rescore(name, ovr, reward)
            else:
                run_scenarios(name, ovr)
    failed_steps_note(name)
    results(name)

if opts is not None:
    with session.guard():
        sweep_section(opts, allowed)
