"""The Rollouts page: every row of every step in one paged table, shown on open; filters that
reduce it; one row's transcript, its group and its trajectory."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.parquet as pq

import rldiag
from rldiag.scenario.recompute import recompute
from rldiag.synth import SynthSpec, write_synth_run
from tests.app.helpers import open_app

PAGE = "views/rollouts.py"
RLOO = "adv_estimator=rloo"


def _caption(at) -> str:
    return next(c.value for c in at.caption if "rows match" in c.value)


def _html(at) -> str:
    bodies = [el.proto.body for el in at.get("html")]
    assert len(bodies) == 1
    return bodies[0]


def test_the_table_opens_on_the_latest_step_first(app_run):
    at = open_app(app_run, PAGE)
    table = at.dataframe[0].value
    last = max(rldiag.rows(app_run, limit=None)["step"].to_list())
    assert table[["step", "row"]].values.tolist()[:2] == [[last, 0], [last, 1]]  # then the step's rows in order
    assert any(f"Step {last}, row 0" in h.value for h in at.subheader)


def test_the_table_shows_on_open_with_the_first_rows_transcript_and_group(app_run):
    at = open_app(app_run, PAGE)
    at.toggle(key="ro_desc").set_value(False).run()  # oldest first
    table = at.dataframe[0].value
    assert len(table) == 50 and list(table.columns[:3]) == ["step", "row", "uid"]  # 72 rows: page 1 of 2
    assert table[["step", "row"]].values.tolist()[:2] == [[1, 0], [1, 1]]
    assert "72 rows match" in _caption(at) and at.number_input(key="ro_page").max == 2
    body = _html(at)  # the first row, opened without a click
    length = int(table["length"][0])
    assert body.count('class="tok') == length and "no prompt text" in body
    group = at.dataframe[1].value  # the group table
    assert len(group) == 4 and 0 in group["row"].tolist()
    at.number_input(key="ro_page").set_value(2).run()
    assert len(at.dataframe[0].value) == 22 and "rows 51-72" in _caption(at)
    at.selectbox(key="ro_open").set_value(3).run()  # a row of page 2
    assert at.dataframe[0].value["row"].tolist()[3] == 5 and any("Step 5, row 5" in h.value for h in at.subheader)
    at.toggle(key="ro_desc").set_value(True).run()  # a new order starts at its first page
    assert at.number_input(key="ro_page").value == 1 and "rows 1-50" in _caption(at)


def test_filters_reduce_the_rows(app_run):
    at = open_app(app_run, PAGE)
    every = rldiag.rows(app_run, limit=None)
    at.text_input(key="ro_where").set_value("length > 20").run()
    want = every.filter(every["length"] > 20)
    assert f"{len(want)} rows match" in _caption(at) and (at.dataframe[0].value["length"] > 20).all()
    at.text_input(key="ro_where").set_value("").run()
    at.multiselect(key="ro_ranges").set_value(["advantage_mean"]).run()
    at.number_input(key="ro_min_advantage_mean").set_value(0.5).run()
    want = every.filter(every["advantage_mean"] >= 0.5)
    assert f"{len(want)} rows match" in _caption(at) and (at.dataframe[0].value["advantage_mean"] >= 0.5).all()
    at.multiselect(key="ro_ranges").set_value([]).run()
    at.checkbox(key="ro_nosignal").check().run()
    want = every.filter(every["group_has_signal"] == 0)
    assert f"{len(want)} rows match" in _caption(at) or "No row matches" in at.info[0].value
    at.checkbox(key="ro_nosignal").uncheck().run()
    cap = rldiag.settings(app_run)["data.max_response_length"]
    at.checkbox(key="ro_cap").check().run()
    want = every.filter(every["length"] == cap)
    assert f"{len(want)} rows match" in _caption(at) and len(want) > 0
    at.checkbox(key="ro_cap").uncheck().run()
    at.selectbox(key="ro_sort").set_value("advantage_mean").run()
    at.toggle(key="ro_desc").set_value(True).run()
    shown = at.dataframe[0].value["advantage_mean"].tolist()
    assert shown == sorted(shown, reverse=True) and shown[0] == every["advantage_mean"].max()


def test_a_bad_filter_names_the_column_and_the_page_goes_on(app_run):
    at = open_app(app_run, PAGE)
    at.text_input(key="ro_where").set_value("lenght > 3").run()
    assert not at.exception
    assert any("no column 'lenght'" in e.value and "did you mean 'length'" in e.value for e in at.error)
    assert not at.dataframe


def test_opening_a_row_shows_its_transcript_and_group(app_run):
    at = open_app(app_run, PAGE)
    at.toggle(key="ro_desc").set_value(False).run()
    table = at.dataframe[0].value
    at.selectbox(key="ro_open").set_value(6).run()
    step, row, uid = int(table["step"][6]), int(table["row"][6]), table["uid"][6]
    assert any(f"Step {step}, row {row}" in h.value for h in at.subheader)
    tokens = rldiag.step_token_frame(app_run, step)  # the baseline's saved tokens
    assert _html(at).count('class="tok') == len(tokens["advantages"][row])
    group = at.dataframe[1].value  # the group table
    assert row in group["row"].tolist() and len(group) == 4
    assert any(f"uid `{uid}`" in c.value for c in at.caption)
    at.radio(key="ro_colour").set_value("ratio").run()
    assert "ratio π/π_old: blue above 1, red below" in _html(at)  # the app's one convention (viz/colours.py)
    at.radio(key="ro_colour").set_value("loss_weight").run()
    assert "loss weight: orange above 0" in _html(at)


def test_without_per_row_tables_the_baseline_computed_on_open_fills_the_table(app_run):
    shutil.rmtree(app_run / "rldiag")
    at = open_app(app_run, PAGE)  # the app computes the baseline on open, which writes the per-row tables
    assert not at.exception
    assert len(at.dataframe[0].value) == 50
    # the baseline saved no tokens: the step's per-token values come from the token cache
    assert _html(at).count('class="tok') == int(at.dataframe[0].value["length"][0])
    assert not (app_run / "rldiag" / "scenarios" / "baseline" / "tokens").exists()


def _agent_run(tmp_path):
    """A step-level agent run (traj_uid, step_index) with response text and prompts."""
    run = write_synth_run(tmp_path / "agent", SynthSpec(steps=2, prompts=3, n=4, extra_columns=True, seed=4))
    for f in sorted((run / "batches").glob("step_*.parquet")):
        t = pq.read_table(f)
        texts = [[f"<script>r{r}</script>" if i == 0 else ("needle " if r == 5 else "w ") for i in range(len(m))]
                 for r, m in enumerate(t["response_mask"].to_pylist())]
        prompts = [["What ", "is ", f"{r}?"] for r in range(t.num_rows)]
        t = t.append_column("response_tokens", pa.array(texts, pa.list_(pa.string())))
        pq.write_table(t.append_column("prompt_tokens", pa.array(prompts, pa.list_(pa.string()))), f)
    recompute(run, device="cpu")
    recompute(run, {"algorithm.adv_estimator": "rloo"}, device="cpu")
    return run


def test_search_sign_differs_text_and_trajectory(tmp_path):
    run = _agent_run(tmp_path)
    at = open_app(run, PAGE)
    body = _html(at)
    assert "What is 0?" in body and "&lt;script&gt;r0&lt;/script&gt;" in body and "<script>" not in body
    assert "response" in at.dataframe[0].value.columns
    traj = at.dataframe[2].value  # the trajectory table
    first = rldiag.rows(run, limit=1)
    same = rldiag.rows(run, where=f"step = 1 AND traj_uid = '{first['traj_uid'][0]}'", limit=None)
    assert sorted(traj["row"].tolist()) == sorted(same["row"].to_list())
    assert traj["step_index"].tolist() == sorted(traj["step_index"].tolist())
    at.text_input(key="ro_search").set_value("NEEDLE").run()
    assert "2 rows match" in _caption(at) and at.dataframe[0].value["row"].tolist() == [5, 5]
    at.text_input(key="ro_search").set_value("").run()
    assert at.checkbox(key="ro_sign").disabled
    at.selectbox(key="ro_other").set_value(RLOO).run()
    assert "other_advantage_mean" in at.dataframe[0].value.columns
    at.checkbox(key="ro_sign").check().run()
    n = rldiag.rows_count(run, where=rldiag.api.SIGN_DIFFERS, other=RLOO)
    if n:
        assert f"{n} rows match" in _caption(at)
    else:
        assert "No row matches" in at.info[0].value


def test_the_groups_table_answers_which_groups_drive_the_clipping(app_run):
    """The Groups table: the matching rows grouped by uid, by default sorted by their clipped
    tokens' sum, as `rldiag rows RUN --group-by uid --sort -clipped_tokens` gives them."""
    at = open_app(app_run, PAGE)
    assert any(h.value == "Groups" for h in at.subheader)
    assert at.selectbox(key="ro_group_by").value == "uid"
    assert at.selectbox(key="ro_group_sort").value == "clipped_tokens"
    groups = at.dataframe[-1].value
    want = rldiag.rows(app_run, group_by="uid", sort="-clipped_tokens", limit=20)
    assert groups[["step", "uid"]].values.tolist() == [list(r) for r in want.select("step", "uid").rows()]
    assert groups["clipped_tokens_sum"].tolist() == want["clipped_tokens_sum"].to_list()
    assert list(groups.columns[:3]) == ["step", "uid", "rows"]
    n = rldiag.rows_count(app_run, group_by="uid")
    assert any(f"{n} groups of the matching rows" in c.value for c in at.caption)
    at.selectbox(key="ro_group_by").set_value("step").run()
    by_step = at.dataframe[-1].value
    assert by_step["rows"].sum() == rldiag.rows_count(app_run)


def test_the_table_shows_the_columns_that_fit_and_the_rest_on_demand(app_run):
    at = open_app(app_run, PAGE)
    table = at.dataframe[0].value
    assert "turns" not in table.columns and "loss_weight" not in table.columns
    assert "turns" in at.multiselect(key="ro_more").options
    at.multiselect(key="ro_more").set_value(["turns"]).run()
    assert "turns" in at.dataframe[0].value.columns
    at.selectbox(key="ro_sort").set_value("loss_weight").run()  # the sort column is always shown
    assert "loss_weight" in at.dataframe[0].value.columns
