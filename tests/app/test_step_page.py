"""The step page: groups under two scenarios, one row's heat strip and text, the debugging checklist."""

from __future__ import annotations

import shutil

import numpy as np

from rldiag.scenario.recompute import recompute
from rldiag.viz.charts import mask_spans
from tests.app.helpers import charts, fresh_sample, open_app, trace_names

PAGE = "views/step.py"
RLOO = "adv_estimator=rloo"


def _checklist(at) -> list[str]:
    return [m.value for m in at.markdown if "**" in m.value and ". " in m.value and "—" in m.value]


def test_groups_strip_and_checklist(app_run):
    recompute(app_run, {"algorithm.adv_estimator": "rloo"}, save_tokens=True, device="cpu")
    at = open_app(app_run, PAGE)
    assert at.selectbox(key="st_a").value == "baseline" and at.selectbox(key="st_b").value == RLOO
    groups, strip = charts(at)
    assert set(trace_names(groups)) == {"advantage · baseline", f"advantage · {RLOO}", "score total"}
    assert len(groups["data"][0]["y"]) == 12  # one bar per row of the step
    strip_rows = [t["y"][0] for t in strip["data"]]
    assert strip_rows[0] == "advantage" and "mask (batch)" in strip_rows
    items = _checklist(at)
    assert len(items) == 8 and [i.split("**")[1].split(".")[0] for i in items] == [str(k) for k in range(1, 9)]


def test_changing_row_and_step_changes_the_charts(app_run):
    at = open_app(app_run, PAGE)
    groups0, strip0 = charts(at)
    rows = at.selectbox(key="st_row").options
    other = 0 if at.selectbox(key="st_row").value != 0 else 5
    at.selectbox(key="st_row").set_value(other).run()
    _, strip1 = charts(at)
    assert strip1["data"][0]["z"] != strip0["data"][0]["z"]
    at.selectbox(key="st_step").set_value(3).run()
    groups3, _ = charts(at)
    assert [t["y"] for t in groups3["data"]] != [t["y"] for t in groups0["data"]]
    assert groups3["data"][0]["x"][0][0].startswith("s3-")  # step 3's uids
    assert len(rows) == 12 and rows[5].startswith("row 5 · uid")
    assert at.selectbox(key="st_row").value == other


def test_a_link_to_a_step_opens_it(app_run):
    at = open_app(app_run, PAGE)
    at.query_params["step"] = "4"
    at.run()
    assert at.selectbox(key="st_step").value == 4


def test_without_tokens_the_step_is_computed_on_demand(app_run):
    """No scenario saved tokens: the baseline is computed on open (without tokens: the
    background worker) and the chosen step's tokens on demand into the token cache; the page
    is drawn whole without a click, and the next step gets its own tokens the same way."""
    shutil.rmtree(app_run / "rldiag")
    at = open_app(app_run, PAGE)
    assert not at.info and not at.get("button")
    assert at.selectbox(key="st_a").value == "baseline"
    assert "advantage · baseline" in trace_names(charts(at)[0])
    cache = app_run / "rldiag" / "cache" / "baseline" / "tokens"
    assert sorted(p.name for p in cache.iterdir()) == ["step_000001.parquet"]
    assert not (app_run / "rldiag" / "scenarios" / "baseline" / "tokens").exists()
    items = _checklist(at)
    assert len(items) == 8 and not any("Needs a scenario with saved tokens" in i for i in items)
    at.selectbox(key="st_step").set_value(4).run()
    assert not at.exception
    assert sorted(p.name for p in cache.iterdir()) == ["step_000001.parquet", "step_000004.parquet"]
    groups = charts(at)[0]
    assert groups["data"][0]["x"][0][0].startswith("s4-") and "advantage · baseline" in trace_names(groups)


def test_a_fresh_copy_of_the_sample_draws_the_step_without_a_click(tmp_path):
    """As a new user opens it: the Step page of a fresh copy of the sample has its groups, the
    heat strip and the checklist, with the baseline's advantages, and no button to press."""

    run = fresh_sample(tmp_path)
    at = open_app(run, PAGE)
    assert not at.get("button") and not at.warning and not at.error
    groups, strip = charts(at)
    assert "advantage · baseline" in trace_names(groups) and strip["data"][0]["y"][0] == "advantage"
    assert len(_checklist(at)) == 8
    meta = (run / "rldiag" / "scenarios" / "baseline" / "scenario.json")
    assert meta.is_file()  # the background baseline (synchronous in tests)


def _add_text(run):
    """Give every batch file a ``response_tokens`` column, as the capture writes it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for f in sorted((run / "batches").glob("step_*.parquet")):
        t = pq.read_table(f)
        texts = [[("<b>&\n" if (r, i) == (0, 1) else f"w{r}_{i} ") for i in range(len(m))]
                 for r, m in enumerate(t["response_mask"].to_pylist())]
        pq.write_table(t.append_column("response_tokens", pa.array(texts, pa.list_(pa.string()))), f)


def test_response_text_coloured_per_token_and_top_tokens(app_run):
    from rldiag.store import Store

    _add_text(app_run)
    recompute(app_run, {"algorithm.rollout_correction.rollout_is": "token"}, name="is", save_tokens=True, device="cpu")
    at = open_app(app_run, PAGE, st_row=0)
    at.selectbox(key="st_a").set_value("is").run()
    html = [el.proto.body for el in at.get("html")]
    assert len(html) == 1
    tokens = Store(app_run).row_tokens(1, 0, "is")
    body = html[0]
    assert body.count("<span title=\"token ") == len(tokens["mask"])
    assert "&lt;b&gt;&amp;⏎<br>" in body and "<b>&" not in body  # token text is escaped
    assert body.count(">tool</span>") == len(mask_spans(tokens["mask"])) > 0  # each tool span marked once
    assert at.radio(key="st_colour").options[:2] == ["advantage", "ratio π/π_old"]
    at.radio(key="st_colour").set_value("rollout_is_weights").run()
    assert "IS weight: blue above 1, red below" in at.get("html")[0].proto.body
    # the step's top tokens by |log ratio|, with their context, in the order of the ranking
    top = at.dataframe[0].value
    assert len(top) == 10 and list(top.columns) == ["row", "position", "token", "value", "in context"]
    scores = np.abs(np.log(top["value"].to_numpy()))
    assert (np.diff(scores) <= 1e-12).all()
    r, p = int(top["row"][0]), int(top["position"][0])
    assert top["token"][0] == f"w{r}_{p} " and f"[w{r}_{p} ]" in top["in context"][0]


def test_without_response_tokens_the_page_says_what_would_show(app_run):
    at = open_app(app_run, PAGE)
    assert any("no `response_tokens` column" in c.value for c in at.caption)
    assert not at.get("html")
