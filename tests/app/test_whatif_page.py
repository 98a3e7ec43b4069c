"""The what-if page: settings widgets, a recompute with progress, side by side values, compare."""

from __future__ import annotations

import shutil

from tests.app.helpers import charts, open_app, trace_names

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
    assert set(trace_names(charts(at)[0])) == {"logged", "baseline"}


def test_changing_the_estimator_and_recomputing_adds_the_scenario(app_run):
    at = open_app(app_run, PAGE)
    at.selectbox(key="wi_estimator").set_value("rloo").run()
    assert f"`{RLOO}`" in _scenario_line(at)
    assert any("not computed yet" in i.value for i in at.info)
    at.button(key="wi_run").click().run()
    assert not at.exception and not at.error
    assert (app_run / "rldiag" / "scenarios" / RLOO / "tokens").is_dir()
    spec = charts(at)[0]
    assert set(trace_names(spec)) == {"logged", "baseline", RLOO}
    summary = at.dataframe[0].value
    assert f"{RLOO} - baseline" in summary.columns
    # the compare command ran: its summary and per-step agreement are shown
    quantities = at.dataframe[1].value["quantity"].tolist()
    assert "sign agreement" in quantities
    assert len(charts(at)) == 2


def test_recompute_also_makes_a_missing_baseline(app_run):
    shutil.rmtree(app_run / "rldiag")
    at = open_app(app_run, PAGE)
    at.number_input(key="wi_clip_high").set_value(0.28).run()
    name = "clip_ratio_high=0.28"
    assert f"`{name}`" in _scenario_line(at)
    at.button(key="wi_run").click().run()
    assert not at.exception
    assert {p.name for p in (app_run / "rldiag" / "scenarios").iterdir()} == {"baseline", name}
    assert set(trace_names(charts(at)[0])) == {"logged", "baseline", name}


def test_a_bad_setting_is_shown_as_an_error_not_a_traceback(app_run):
    at = open_app(app_run, PAGE)
    at.selectbox(key="wi_is").set_value("token").run()
    at.text_input(key="wi_is_threshold").set_value("two").run()
    at.button(key="wi_run").click().run()
    assert not at.exception
    assert any("rollout_is_threshold" in e.value for e in at.error)
