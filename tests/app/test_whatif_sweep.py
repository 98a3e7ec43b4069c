"""The What-if page's sweep section: the latest sweep on disk is shown on open, a sweep run from
the widgets is written and drawn, and a scenario of it opens its panels."""

from __future__ import annotations

import json

import pytest

from rldiag import api
from rldiag.synth import SynthSpec, write_synth_run
from tests.app.helpers import charts, open_app, series_names

PAGE = "views/whatif.py"
LOW = "actor_rollout_ref.actor.clip_ratio_low"
HIGH = "actor_rollout_ref.actor.clip_ratio_high"
EST = "algorithm.adv_estimator"


@pytest.fixture
def tiny_run(tmp_path):
    return write_synth_run(tmp_path / "run", SynthSpec(steps=2, prompts=2, n=2, seed=5))


def _sweep_panels(at) -> list[dict]:
    return [json.loads(el.proto.spec) for el in at.get("echarts_chart") if "wi_sw_panel" in str(el.key)]


def _alt(spec: dict) -> str:
    """A panel's description (its option's ``aria.label.description``)."""
    return spec.get("aria", {}).get("label", {}).get("description", "")


def test_an_existing_sweep_is_shown_on_open(tiny_run):
    rep = api.sweep(tiny_run, {LOW: [0.1, 0.3]}, device="cpu")
    at = open_app(tiny_run, PAGE)
    assert not at.exception and not at.error
    assert at.selectbox(key="wi_sw_name").value == rep.name
    figs = charts(at)
    assert figs and all(f["data"][0]["type"] == "scatter" for f in figs)
    table = rep.table_frame(at.multiselect(key="wi_sw_metrics").value)
    first = figs[0]
    metric, scale = first["layout"]["title"]["text"].split("<br>")  # the metric, then the range it spans
    assert scale.startswith("<sup>range ")
    assert first["data"][0]["x"] == [0.1, 0.3]
    assert first["data"][0]["y"] == pytest.approx(table[metric].to_list(), nan_ok=True)
    assert first["data"][0]["customdata"] == list(rep.scenarios)


def test_running_a_sweep_from_the_widgets_writes_it_and_draws_a_heatmap(tiny_run):
    at = open_app(tiny_run, PAGE)
    assert any("No sweep in this run yet" in c.value for c in at.caption)
    assert at.button(key="wi_sw_run").disabled  # no key picked
    at.multiselect(key="wi_sw_keys").set_value([EST, HIGH]).run()
    at.multiselect(key="wi_sw_vals_estimator").set_value(["grpo", "rloo"]).run()
    at.text_input(key=f"wi_sw_vals:{HIGH}").set_value("0.2, 0.28").run()
    assert any("4 scenario(s)" in c.value for c in at.caption)
    at.button(key="wi_sw_run").click().run()
    assert not at.exception and not at.error
    (name,) = api.sweeps(tiny_run)
    assert (tiny_run / "rldiag" / "sweeps" / name / "summary.parquet").is_file()
    assert at.selectbox(key="wi_sw_name").value == name
    figs = charts(at)
    assert figs and all(f["data"][0]["type"] == "heatmap" for f in figs)
    assert figs[0]["data"][0]["x"] == ["grpo", "rloo"] and figs[0]["data"][0]["y"] == ["0.2", "0.28"]
    bars = [el.proto for el in at.get("progress")]
    assert bars and all(b.value == 100 for b in bars)


def test_a_bad_value_list_is_named_and_the_sweep_is_off(tiny_run):
    at = open_app(tiny_run, PAGE)
    at.multiselect(key="wi_sw_keys").set_value([LOW]).run()
    at.text_input(key=f"wi_sw_vals:{LOW}").set_value("0.1, lots").run()
    assert not at.exception
    assert any("lots" in e.value for e in at.error)
    assert at.button(key="wi_sw_run").disabled


def test_choosing_a_scenario_shows_its_panels(tiny_run):
    rep = api.sweep(tiny_run, {LOW: [0.1, 0.3]}, device="cpu")
    at = open_app(tiny_run, PAGE)
    assert not _sweep_panels(at)
    scenario = list(rep.scenarios)[1]
    at.selectbox(key="wi_sw_scenario").set_value(scenario).run()
    assert not at.exception and not at.error
    panels = _sweep_panels(at)
    metrics = at.multiselect(key="wi_sw_metrics").value
    assert len(panels) == len(metrics) > 0
    # each panel draws the scenario, or says its line is the baseline's (a metric clip_ratio_low cannot change)
    assert all((scenario in series_names(p)) != ("(the same as baseline: not drawn)" in _alt(p)) for p in panels)


def test_the_api_lists_and_reads_saved_sweeps(tiny_run):
    from rldiag.errors import ConfigError

    assert api.sweeps(tiny_run) == []
    rep = api.sweep(tiny_run, {LOW: [0.1, 0.3]}, device="cpu")
    assert api.sweeps(tiny_run) == [rep.name]
    assert api.sweep_summary(tiny_run, rep.name).equals(rep.summary_frame())
    with pytest.raises(ConfigError, match="no sweep"):
        api.sweep_summary(tiny_run, "nope")
