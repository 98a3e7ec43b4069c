"""Rollouts: every row of every step in one table (the scenario's per-row tables, paged through
:func:`rldiag.api.rows`, never loaded whole), filtered and sorted by any column; one row's
transcript (prompt, then the response turn by turn, each token coloured by the quantity picked),
its group's other responses, and for step-level agent runs its trajectory's steps in order."""

from __future__ import annotations

import polars as pl
import streamlit as st

from rldiag import api
from rldiag.app import pagework, session
from rldiag.errors import RldiagError
from rldiag.store import file_sig
from rldiag.viz.transcript import (
    DEFAULT_TABLE_COLUMNS,
    GAP,
    GROUP_COLUMNS,
    GROUP_TABLE_COLUMNS,
    PREVIEW_COLUMN,
    QUANTITIES,
    TRAJECTORY_COLUMNS,
    filter_expression,
    pages,
    row_label,
    shown,
    sql_string,
    table_columns,
    transcript_html,
    values_at,
    visible_columns,
)

#: rows per page of the table
PAGE_SIZE = 50
#: characters of each row's response shown in the table
PREVIEW = 120
#: groups shown in the Groups table
GROUP_PAGE = 20
NONE = "(none)"

st.title("Rollouts")
store = session.store_or_stop()


@st.cache_data(max_entries=256, show_spinner=False)
def row_values(run: str, scenario: str, step: int, row: int, column: str, sig: tuple) -> list | None:
    """One row's per-token ``column`` under ``scenario`` (None: the scenario has none):
    :func:`rldiag.app.pagework.row_token_values` in a child process (the step's frame, its
    recompute when the token cache lacks it, stay there: 1,024 rows of a long-tailed step are a
    million tokens), with the background baseline paused meanwhile; only the row's values are
    kept in memory. ``sig`` keys the cache on the run's files."""
    return pagework.in_child(pagework.row_token_values, run, scenario, step, row, column)


@st.cache_data(max_entries=256, show_spinner=False)
def row_gaps(run: str, step: int, row: int, n: int, sig: tuple) -> list:
    """One row's rollout-vs-trainer gap per token (``n`` of them; None off the actor tokens),
    from :func:`rldiag.api.mismatch_tokens`; only the row's values are kept in memory."""
    with session.heavy_work():
        gaps = api.mismatch_tokens(run, step)
        mine = gaps.filter(pl.col("row") == row)
        del gaps
    return values_at(n, mine["position"].to_list(), mine["gap"].to_list())


def filters(scenario: str, other: str | None, columns: dict[str, pl.DataType]) -> tuple[str | None, str | None, str | None]:
    """The widgets: (the ``where`` they make, the sort, the search text)."""
    cap = api.settings(store.run)["data.max_response_length"]
    numeric = [c for c, t in columns.items() if t.is_numeric() and c not in ("step", "row")]
    c1, c2, c3 = st.columns(3)
    at_cap = c1.checkbox(f"Length at the cap ({cap})" if cap else "Length at the cap", key="ro_cap",
                         disabled=not cap, help="length == data.max_response_length" if cap else
                         "The run's config sets no data.max_response_length.")
    no_signal = c2.checkbox("Group has no signal", key="ro_nosignal",
                            help="group_has_signal = 0: every row of the prompt's group has the same reward")
    differs = c3.checkbox(f"Advantage sign differs under {other}" if other else "Advantage sign differs",
                          key="ro_sign", disabled=other is None,
                          help="Pick a scenario to compare with first." if other is None else api.SIGN_DIFFERS)
    chosen = st.multiselect("Range filters", numeric, key="ro_ranges",
                            help="A minimum and a maximum for each column picked (empty: open), e.g. is_weight_seq >= 5")
    ranges = {}
    for col in chosen:
        a, b = st.columns(2)
        lo = a.number_input(f"{col} ≥", value=None, key=f"ro_min_{col}", format="%g")
        hi = b.number_input(f"{col} ≤", value=None, key=f"ro_max_{col}", format="%g")
        ranges[col] = (lo, hi)
    s1, s2, s3 = st.columns([3, 2, 1], vertical_alignment="bottom")
    search = s1.text_input("Search the responses", key="ro_search", placeholder="text in the response (any case)")
    sort = s2.selectbox("Sort by", list(columns), key="ro_sort")
    desc = s3.toggle("Descending", key="ro_desc", value=True,
                     help="On by default: the latest steps first (those of a run still training, and the first the "
                          "background baseline computes)")
    typed = st.text_input("Filter (SQL expression)", key="ro_where",
                          placeholder="is_weight_seq > 5 AND length >= 512",
                          help="One boolean expression over the table's columns: comparisons, AND / OR / NOT, "
                               "IN, BETWEEN, LIKE, IS NULL, abs(), sign(), ...")
    where = filter_expression(ranges, cap=int(cap) if at_cap and cap else None, no_signal=no_signal,
                              sign_differs=api.SIGN_DIFFERS if differs and other else None, where=typed)
    order = None if sort in (None, "step") and not desc else f"{'-' if desc else ''}{sort}"
    return where, order, (search or None)


def table(scenario: str, other: str | None, where, sort, search) -> pl.DataFrame | None:
    """The page of the table, with the page picker; None when the filter is refused (said why)."""
    try:
        n = api.rows_count(store.run, where, scenario, search, other=other)
    except RldiagError as exc:
        session.show_error(exc)
        return None
    last = pages(n, PAGE_SIZE)
    query = (scenario, other, where, sort, search)
    if st.session_state.get("ro_query") != query or not 1 <= int(st.session_state.get("ro_page", 1)) <= last:
        st.session_state["ro_page"] = 1  # a new filter or order starts at its first page
    st.session_state["ro_query"] = query
    c1, c2 = st.columns([1, 4], vertical_alignment="bottom")
    page = int(c1.number_input(f"Page (of {last})", min_value=1, max_value=last, step=1, key="ro_page"))
    frame = api.rows(store.run, where, sort, PAGE_SIZE, (page - 1) * PAGE_SIZE, scenario, search, other=other,
                     preview=PREVIEW)
    span = f"rows {(page - 1) * PAGE_SIZE + 1}-{(page - 1) * PAGE_SIZE + len(frame)}" if len(frame) else "no rows"
    c2.caption(f"{n} rows match · {span}" + (f" · filter: `{where}`" if where else ""))
    if frame.is_empty():
        st.info("No row matches the filters.")
        return frame
    rest = [c for c in table_columns(frame.columns) if c not in DEFAULT_TABLE_COLUMNS]
    more = st.multiselect("More columns", rest, key="ro_more",
                          help="The table shows the columns that fit the page; add any other here")
    cols = visible_columns(frame.columns, DEFAULT_TABLE_COLUMNS, more, sort)
    event = st.dataframe(shown(frame, cols), key="ro_table", hide_index=True, column_config=column_widths(cols),
                         on_select="rerun", selection_mode="single-row")
    picked = list(getattr(getattr(event, "selection", None), "rows", []) or [])
    if picked and picked != st.session_state.get("ro_seen"):
        st.session_state["ro_open"] = int(picked[0])  # a row clicked in the table opens it
    st.session_state["ro_seen"] = picked
    return frame


def column_widths(cols: list[str]) -> dict:
    """Narrow number columns and a medium response column: the table fits a 1,400 px page."""
    config: dict = {c: st.column_config.Column(width="small") for c in cols if c != PREVIEW_COLUMN}
    if PREVIEW_COLUMN in cols:
        config[PREVIEW_COLUMN] = st.column_config.TextColumn(width="medium")
    return config


def groups(scenario: str, where: str | None, search: str | None, columns: list[str], other_note: bool = False) -> None:
    """The Groups table: the matching rows grouped by uid (a prompt group of a step), step or
    data_source, counts summed and the rest averaged (:func:`rldiag.api.rows` with ``group_by``),
    sorted by the column picked: "which groups drive the clipping" is the default order."""
    st.subheader("Groups")
    keys = [k for k in ("uid", "step", "data_source") if k in columns]
    c1, c2, c3 = st.columns([1, 2, 1], vertical_alignment="bottom")
    by = c1.selectbox("Group by", keys, key="ro_group_by")
    if by is None:
        return
    numeric = [c for c in ("clipped_tokens", "length", "score", "advantage_mean", "is_weight_seq",
                           "group_has_signal", "rows") if c in columns or c == "rows"]
    numeric += [c for c in columns if c not in numeric and c not in ("step", "row", "uid", "data_source")]
    sort = c2.selectbox("Sort groups by (counts: their sum; others: their mean)", numeric, key="ro_group_sort")
    desc = c3.toggle("Descending", key="ro_group_desc", value=True)
    order = f"{'-' if desc else ''}{sort}" if sort else None
    try:
        n = api.rows_count(store.run, where, scenario, search, group_by=by)
        frame = api.rows(store.run, where, order, GROUP_PAGE, 0, scenario, search, preview=PREVIEW, group_by=by)
    except RldiagError as exc:
        session.show_error(exc)
        return
    st.caption(f"{n} groups of the matching rows; the first {len(frame)} by {order or 'their keys'}"
               + (f" · filter: `{where}`" if where else "")
               + (" · the comparison's filters apply to the rows table only" if other_note else ""))
    cols = visible_columns(frame.columns, GROUP_TABLE_COLUMNS, [], order)
    st.dataframe(shown(frame, cols), key="ro_groups", hide_index=True, column_config=column_widths(cols))


def transcript(scenario: str, step: int, row: int) -> None:
    st.subheader(f"Step {step}, row {row}")
    have = list(QUANTITIES)
    kind = st.radio("Colour tokens by", have, key="ro_colour", horizontal=True,
                    format_func=lambda k: QUANTITIES[k].label, help=" · ".join(
                        f"{q.label}: {q.help}" for q in QUANTITIES.values())) or have[0]
    q = QUANTITIES[kind]
    mask = store.row_tokens(step, row).get("mask", [])
    values = None
    note = None
    try:
        if q.column == GAP:
            with st.spinner(f"Reading step {step}'s log-prob gaps"):
                values = row_gaps(str(store.run), step, row, len(mask), store.inputs_sig())
        else:
            sig = (store.inputs_sig(), file_sig(store.scenarios.layout(scenario).meta))
            with st.spinner(f"Computing step {step}'s per-token values under {scenario}"):
                values = row_values(str(store.run), scenario, step, row, q.column, sig)
            if values is None:
                note = f"Scenario `{scenario}` has no {q.label} for this step ({q.help})."
    except RldiagError as exc:
        note = f"No {q.label}: {type(exc).__name__}: {exc}"
    if note:
        st.caption(note)
    text = store.row_text(step, row)
    if text is None:
        st.caption("The batch has no `response_tokens` column: each token shows as `·`.")
    st.html(transcript_html(store.row_prompt(step, row), text, mask, values, kind))


def group(scenario: str, other: str | None, step: int, r: dict) -> None:
    uid = r.get("uid")
    if uid is None:
        return
    st.subheader("Its group")
    frame = api.rows(store.run, f"step = {int(step)} AND uid = {sql_string(uid)}", "row", None, 0, scenario,
                     other=other, preview=PREVIEW)
    st.caption(f"The {len(frame)} responses to the same prompt (uid `{uid}`) at step {step}; this row is {r['row']}.")
    st.dataframe(shown(frame, GROUP_COLUMNS), hide_index=True, key="ro_group")


def trajectory(scenario: str, other: str | None, step: int, r: dict) -> None:
    traj = r.get("traj_uid")
    if traj is None or "step_index" not in r:
        return
    st.subheader("Its trajectory")
    frame = api.rows(store.run, f"step = {int(step)} AND traj_uid = {sql_string(traj)}", "step_index", None, 0,
                     scenario, other=other, preview=PREVIEW)
    st.caption(f"The {len(frame)} rows of trajectory `{traj}` at step {step}, in step_index order.")
    st.dataframe(shown(frame, TRAJECTORY_COLUMNS), hide_index=True, key="ro_traj")


def page() -> None:
    scenarios = store.scenarios_with_rows()
    if not scenarios:
        st.info("No per-row tables yet: every recompute writes them (`rldiag recompute RUN`, or the What-if "
                "page). The baseline is recomputed in the background when the app opens a run it may write "
                "into; this page shows the rows as soon as they are written.")
        st.button("Look again", key="ro_again")
        return
    c1, c2 = st.columns(2)
    if st.session_state.get("ro_scenario") not in scenarios:
        st.session_state["ro_scenario"] = scenarios[0]
    scenario = c1.selectbox("Scenario", scenarios, key="ro_scenario")
    if scenario is None:  # Streamlit's selectbox gives None only without options
        return
    others = [NONE] + [s for s in scenarios if s != scenario]
    if st.session_state.get("ro_other") not in others:
        st.session_state["ro_other"] = NONE
    picked = c2.selectbox("Compare with", others, key="ro_other",
                          help="A second scenario joined row by row: its values as other_<column>")
    other = None if picked == NONE else picked
    schema = api.rows(store.run, limit=0, scenario=scenario, other=other).schema
    where, sort, search = filters(scenario, other, dict(schema))
    frame = table(scenario, other, where, sort, search)
    if frame is None or frame.is_empty():
        return
    labels = [row_label(r) for r in frame.iter_rows(named=True)]
    if st.session_state.get("ro_open") not in range(len(labels)):
        st.session_state["ro_open"] = 0
    i = st.selectbox("Open row", range(len(labels)), key="ro_open", format_func=lambda k: labels[k],
                     help="Or click a row of the table")
    r = frame.row(int(i or 0), named=True)
    step, row = int(r["step"]), int(r["row"])
    with session.guard():
        transcript(scenario, step, row)
    with session.guard():
        group(scenario, other, step, r)
    with session.guard():
        trajectory(scenario, other, step, r)
    with session.guard():
        groups(scenario, where if other is None else None, search, list(schema), other is not None)


with session.guard():
    page()
