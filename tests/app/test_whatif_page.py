"""The what-if page: settings widgets, a recompute with progress, side by side values, compare."""

from __future__ import annotations

import shutil

from tests.app.helpers import charts, open_app, panels, series_names, xs

PAGE = "views/whatif.py"
RLOO = "adv_estimator=rloo"


def _scenario_line(at) -> str:
    return next(m.value for m in at.markdown if m.value.startswith("**Scenario:**"))


def test_widgets_start_from_the_runs_settings(app_run):
    at = open_app(app_run, PAGE)
    assert at.selectbox(key="wi_estimator").value == "grpo"  # the synthetic run's run.yaml
    assert at.selectbox(key="wi_agg").value == "token-mean"
    assert at.number_input(key="wi_clip_low").value == 0.2
    assert "`baseline`" in _scenario_line(at)
    assert all(series_names(p) == ["logged", "baseline"] for p in panels(at).values()) and panels(at)
    assert not charts(at)  # nothing on the page waits for plotly before a compare


def test_changing_the_estimator_and_recomputing_adds_the_scenario(app_run):
    at = open_app(app_run, PAGE)
    at.selectbox(key="wi_estimator").set_value("rloo").run()
    assert f"`{RLOO}`" in _scenario_line(at)
    assert any("not computed yet" in i.value for i in at.info)
    at.button(key="wi_run").click().run()
    assert not at.exception and not at.error
    assert (app_run / "rldiag" / "scenarios" / RLOO / "tokens").is_dir()
    spec = next(iter(panels(at).values()))
    assert series_names(spec) == ["logged", "baseline", RLOO]
    assert "brush" not in spec and all("selectedMode" not in s for s in spec["series"])  # shown, not picked
    summary = at.dataframe[0].value
    assert f"{RLOO} - baseline" in summary.columns
    # the compare command ran: its summary and per-step agreement are shown
    quantities = at.dataframe[1].value["quantity"].tolist()
    assert "sign agreement" in quantities
    assert len(charts(at)) == 1  # the agreement per step


def test_recompute_also_makes_a_missing_baseline(app_run):
    shutil.rmtree(app_run / "rldiag")
    at = open_app(app_run, PAGE)
    at.number_input(key="wi_clip_high").set_value(0.28).run()
    name = "clip_ratio_high=0.28"
    assert f"`{name}`" in _scenario_line(at)
    at.button(key="wi_run").click().run()
    assert not at.exception
    assert {p.name for p in (app_run / "rldiag" / "scenarios").iterdir()} == {"baseline", name}
    # each panel draws the scenario, or says it is the baseline's line (a clip ratio cannot change
    # the advantages: drawn, it would hide the baseline's)
    drawn = panels(at)
    for metric, p in drawn.items():
        same = f"{name} steps 1-6 (the same as baseline: not drawn)" in p["alt"]
        assert (name in series_names(p)) != same, metric
    adv = drawn["critic/advantages/mean"]
    assert set(series_names(adv)) == {"logged", "baseline"} and "(the same as baseline: not drawn)" in adv["alt"]


def test_a_bad_setting_is_shown_as_an_error_not_a_traceback(app_run):
    at = open_app(app_run, PAGE)
    at.selectbox(key="wi_is").set_value("token").run()
    at.text_input(key="wi_is_threshold").set_value("two").run()
    at.button(key="wi_run").click().run()
    assert not at.exception
    assert any("rollout_is_threshold" in e.value for e in at.error)


def test_a_truncated_batch_file_leaves_the_rest_of_the_page(app_run):
    """One truncated batch file: the other steps are recomputed, compared and drawn, the bad step
    is named, and the progress bars finish."""
    bad = sorted((app_run / "batches").iterdir())[3]  # step 4
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    at = open_app(app_run, PAGE)
    at.selectbox(key="wi_estimator").set_value("rloo").run()
    at.button(key="wi_run").click().run()
    assert not at.exception
    warnings = " ".join(w.value for w in at.warning)
    assert "step 4" in warnings and "left out" in warnings
    spec = next(iter(panels(at).values()))
    assert series_names(spec) == ["logged", "baseline", RLOO]
    assert xs(spec, RLOO) == [1, 2, 3, 5, 6]
    quantities = at.dataframe[1].value
    assert quantities.set_index("quantity").loc["steps compared", "value"] == 5
    assert len(charts(at)) == 1  # the agreement per step
    bars = [el.proto for el in at.get("progress")]
    assert bars and all(b.value == 100 for b in bars)
    assert not at.error


def test_rloo_on_one_response_per_prompt_is_warned(tmp_path):
    from rldiag.synth import SynthSpec, write_synth_run

    run = write_synth_run(tmp_path / "r", SynthSpec(steps=2, prompts=6, n=1))
    at = open_app(run, PAGE)
    assert any("`grpo`" in w.value for w in at.warning)  # the run's own setting does not fit either
    at.selectbox(key="wi_estimator").set_value("rloo").run()
    msg = next(w.value for w in at.warning if "single response" in w.value)
    assert "`rloo`" in msg and "6 groups of 1" in msg
    at.selectbox(key="wi_estimator").set_value("reinforce_plus_plus").run()
    assert not any("single response" in w.value for w in at.warning)


def test_recompute_is_off_without_batches(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "data": {"actor/pg_loss": 0.5}}\n')
    at = open_app(run, PAGE)
    assert at.button(key="wi_run").disabled
    assert any("no batch files" in c.value for c in at.caption)


def test_the_compare_shows_its_steps_as_they_come_and_keeps_them_on_an_error(app_run):
    """The compare draws the steps compared so far while it runs; a scenario file that stops it
    at step 4 leaves steps 1-3 on the page, with the error naming the step before it."""
    import pyarrow.parquet as pq

    from rldiag.scenario.recompute import recompute

    recompute(app_run, {"algorithm.adv_estimator": "rloo"}, name=RLOO, save_tokens=True, device="cpu")
    bad = app_run / "rldiag" / "scenarios" / RLOO / "tokens" / "step_000004.parquet"
    pq.write_table(pq.read_table(bad).slice(0, 2), bad)  # fewer rows than the batch
    at = open_app(app_run, PAGE)
    at.selectbox(key="wi_estimator").set_value("rloo").run()
    at.button(key="wi_compare").click().run()
    assert not at.exception
    assert any("after step 3" in e.value and "rows do not match" in e.value for e in at.error)
    assert any(c.value == "So far: 3 of 6 steps compared." for c in at.caption)
    live = at.dataframe[1].value.set_index("quantity")
    assert live.loc["steps compared", "value"] == 3
    (agreement,) = charts(at)
    assert sorted({x for t in agreement["data"] for x in t["x"]}) == [1, 2, 3]


def test_a_cancel_says_what_it_did_as_the_run_directory_shows_it(app_run):
    """A Cancel pressed after the scenario was written cancelled nothing, and the page says so;
    one that stopped the work says nothing was written (the two cases a click can land in)."""
    at = open_app(app_run, PAGE)
    assert not (app_run / "rldiag" / "scenarios" / RLOO).exists()
    at.session_state["wi_cancelled"] = ("recompute", RLOO)
    at.run()
    assert any(f"Cancelled: the recompute of `{RLOO}` was not written" in i.value for i in at.info)
    at.selectbox(key="wi_estimator").set_value("rloo").run()
    at.button(key="wi_run").click().run()
    assert (app_run / "rldiag" / "scenarios" / RLOO / "scenario.json").is_file()
    at.session_state["wi_cancelled"] = ("recompute", RLOO)
    at.run()
    assert any(f"The recompute of `{RLOO}` had finished before Cancel was pressed" in i.value for i in at.info)
    assert not any("Cancelled:" in i.value for i in at.info)
    at.session_state["wi_cancelled"] = ("compare", RLOO)  # the compare ran after the recompute
    at.run()
    assert any(f"The compare of `{RLOO}` had finished before Cancel" in i.value for i in at.info)
