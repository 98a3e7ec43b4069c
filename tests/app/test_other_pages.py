"""Off-policy and Health pages, and how the app opens (default run, a bad run, no run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rldiag.scenario.recompute import recompute
from rldiag.viz import runs
from rldiag.viz.runs import default_run
from tests.app.helpers import charts, fresh_sample, open_app, panels, request_sent_now, subplot_titles

OFF = "views/offpolicy.py"
HEALTH = "views/health.py"


def test_offpolicy_panels_and_is_weights(app_run):
    recompute(app_run, {"algorithm.rollout_correction.rollout_is": "token"}, name="is", save_tokens=True, device="cpu")
    at = open_app(app_run, OFF)
    headers = [h.value for h in at.subheader]
    for panel in ("Effective sample size", "IS weights", "Chi-squared", "Rollout vs train KL", "PPL gap",
                  "IS weight distribution"):
        assert panel in headers
    specs = charts(at)
    ess = [s for s in specs if "rollout_corr/rollout_is_eff_sample_size" in subplot_titles(s)]
    assert ess and {t["name"] for t in ess[0]["data"]} == {"is"}  # logged has no IS (it was off)
    kl = [s for s in specs if "rollout_corr/kl" in subplot_titles(s)][0]
    assert {t["name"] for t in kl["data"]} == {"logged", "baseline", "is"}
    hist0 = specs[-1]["data"][0]["x"]
    at.select_slider(key="op_is_step").set_value(5).run()
    hist5 = charts(at)[-1]["data"][0]["x"]
    assert hist0 != hist5 and len(hist5) > 0


def _kl_sources(at) -> set[str]:
    return {t["name"] for s in charts(at) if "rollout_corr/kl" in subplot_titles(s) for t in s["data"]}


def test_offpolicy_overlay_keeps_a_scenario_past_a_request_sent_before_it(app_run, tmp_path):
    """The overlay follows the scenarios as they are written (the baseline and one more) until it
    is changed by hand; a request the browser sent before it drew the new scenario in the overlay
    (its widget states as they were) changes neither (see test_metrics_page for the mechanism)."""
    recompute(app_run, {"algorithm.rollout_correction.rollout_is": "token"}, name="is", device="cpu")
    scenario = app_run / "rldiag" / "scenarios" / "is"
    scenario.rename(tmp_path / "away")
    at = open_app(app_run, OFF)
    assert _kl_sources(at) == {"logged", "baseline"}
    sent = request_sent_now(at)  # a request on its way, sent with the overlay as first drawn
    (tmp_path / "away").rename(scenario)  # a second scenario is written
    at.run()
    assert _kl_sources(at) == {"logged", "baseline", "is"}
    sent()
    at.run()
    assert _kl_sources(at) == {"logged", "baseline", "is"}
    assert at.multiselect[-1].value == ["baseline", "is"]
    assert "op_scenarios_auto" not in at.session_state  # the overlay was not changed by hand


def test_offpolicy_places_the_run_in_its_reference_bands(app_run):
    """The baseline's mean over steps of each banded metric, placed under the run's settings (the
    run does not say dense or MoE: both k3 bands, each named), with where each band comes from."""
    import polars as pl

    at = open_app(app_run, OFF)
    assert "Reference bands" in [h.value for h in at.subheader]
    base = pl.read_parquet(app_run / "rldiag" / "scenarios" / "baseline" / "metrics.parquet")
    k3 = float(base["rollout_corr/k3_kl"].mean())
    line = next(m.value for m in at.markdown if m.value.startswith("- rollout_corr/k3_kl"))
    assert line.startswith(f"- rollout_corr/k3_kl {k3:.3g}: ")
    assert "the dense band [1e-05, 0.001]" in line and "the MoE band [0.001, 0.1]" in line
    assert line.endswith("(mean over 6 steps)")
    gap = next(m.value for m in at.markdown if m.value.startswith("- rldiag/mismatch/gap_abs_mean"))
    assert "inside the slime CI gate band [0, 0.1]" in gap
    sources = next(d.value for d in at.dataframe if "assumed" in d.value.columns)
    assert set(sources["band"]) >= {"dense", "MoE", "slime CI gate", "NeMo RL CI gate"}
    assert set(sources.loc[sources["band"] == "dense", "assumed"]) == {"model=dense"}


def test_health_findings_place_their_value_in_the_band(tmp_path):
    from tests.doctor.runs import write_run

    run = write_run(tmp_path / "run", steps=8,
                    logged=lambda step, s: {"rollout_corr/rollout_is_eff_sample_size": 0.97 if step <= 4 else 0.15})
    at = open_app(run, HEALTH)
    report = at.session_state["he_report"][1]
    ess = next(f for f in report.findings if f.rule == "rollout_is_ess_low")
    assert ess.evidence.band is not None
    lines = [m.value for m in at.markdown if m.value.startswith("Reference band")]
    assert lines == ["Reference band (mean of the evidence values): rollout_corr/rollout_is_eff_sample_size 0.15: "
                     "below the verl health check band [0.3, 1]"]


def test_offpolicy_without_rollout_metrics_says_what_to_do(tmp_path):
    """Batches without rollout_log_probs: the diagnosis says what it needs and what to set in
    verl, the rollout_corr panels what they need; nothing raises, no picture is drawn."""
    import pyarrow.parquet as pq

    from rldiag.synth import SynthSpec, write_synth_run

    run = write_synth_run(tmp_path / "r", SynthSpec(steps=2))
    for f in (run / "batches").iterdir():
        pq.write_table(pq.read_table(f).drop_columns(["rollout_log_probs"]), f)
    at = open_app(run, OFF)
    infos = [i.value for i in at.info]
    assert any("actor_rollout_ref.rollout.calculate_log_probs=True" in i and "rollout_log_probs" in i for i in infos)
    assert any("No rollout_corr/* metrics" in i for i in infos)
    assert not at.error and not at.get("plotly_chart")
    assert at.session_state["op_mismatch"][1].causes == []


def test_offpolicy_diagnosis_and_pictures_on_open(tmp_path):
    """On a copy of the sample, with no button pressed: the precision cause at severity info,
    its evidence and remedy, and the pictures of the step with the largest KL among its steps;
    kept over reruns, computed again when the batch files change."""

    import pyarrow.parquet as pq

    run = fresh_sample(tmp_path)
    at = open_app(run, OFF)
    diag = at.session_state["op_mismatch"][1]
    assert [c.cause for c in diag.causes] == ["precision"] and diag.causes[0].severity == "info"
    assert any("precision" in i.value and "symmetric" in i.value for i in at.info)
    md = [m.value for m in at.markdown]
    assert any("`precision`" in m and ":blue-badge[info]" in m and "confidence 0.9" in m for m in md)
    assert any(m.startswith("**Remedy:**") for m in md) and any(m.startswith("**Steps:** 1-") for m in md)
    assert any(c.value.startswith("Statistic: gap_std") for c in at.caption)
    titles = [(s["layout"].get("title") or {}).get("text", "") for s in charts(at)]
    for picture in ("Rollout vs trainer log-prob", "Gap old - rollout", "|Gap| by position", "Agreement at shift 0 vs shift ±1"):
        assert any(t.startswith(picture) for t in titles), titles
    metrics = pq.read_table(run / "rldiag" / "scenarios" / "baseline" / "metrics.parquet").to_pylist()
    kl = {r["step"]: r["rldiag/mismatch/kl_k2"] for r in metrics}
    step = at.select_slider(key="op_mm_step").value
    assert step == max(diag.causes[0].steps, key=kl.__getitem__)
    top = [d.value for d in at.dataframe if "kl_share" in d.value.columns][-1]  # the pictures' table (the bands' follows)
    assert len(top) == 20 and list(top["kl_share"]) == sorted(top["kl_share"], reverse=True)
    assert "Mismatch fingerprints" in [h.value for h in at.subheader]
    # the slider shows another step's tokens
    other = diag.steps[0] if step != diag.steps[0] else diag.steps[1]
    at.select_slider(key="op_mm_step").set_value(other).run()
    assert not at.exception
    assert any(t.startswith(f"step {other}") for s in charts(at) for t in subplot_titles(s))
    # a rerun keeps the diagnosis; a change to the batch files has it computed again
    at.run()
    assert at.session_state["op_mismatch"][1] is diag
    (run / "batches" / "step_000030.parquet").unlink()
    at.run()
    assert not at.exception
    assert at.session_state["op_mismatch"][1].steps == diag.steps[:-1]


def test_offpolicy_on_a_read_only_run_computes_into_its_mirror(rldiag_home):
    """The bundled sample itself (inside the install, never written): the baseline and the
    diagnosis are computed into its mirror under $RLDIAG_HOME, and drawn."""
    from rldiag.io.run_layout import mirror_dir

    sample = default_run()
    if sample is None:
        pytest.skip("no bundled sample in this checkout")
    before = sorted(p.name for p in sample.iterdir())
    at = open_app(sample, OFF)
    assert not at.exception
    diag = at.session_state["op_mismatch"][1]
    assert [(c.cause, c.severity) for c in diag.causes] == [("precision", "info")]
    assert any((s["layout"].get("title") or {}).get("text", "").startswith("Rollout vs trainer") for s in charts(at))
    assert sorted(p.name for p in sample.iterdir()) == before
    mirror = mirror_dir(sample)
    assert mirror.is_relative_to(rldiag_home / "runs") and (mirror / "scenarios" / "baseline" / "scenario.json").is_file()
    assert any(str(mirror) in c.value for c in at.sidebar.caption)  # the page says where its outputs are


def test_health_findings_with_the_baseline_on_open(app_run):
    """No toggle, no click: the doctor reads the logged metrics and the background baseline's."""
    at = open_app(app_run, HEALTH)
    assert not at.toggle and not at.info
    line = next(c.value for c in at.caption if "recomputed steps" in c.value)
    assert "over 4 logged and 6 recomputed steps" in line
    report = at.session_state["he_report"][1]
    shown = [m.value for m in at.markdown if "`" in m.value and "·" in m.value]
    assert len(shown) == len(report.findings)
    rules = at.dataframe[-1].value["rule"].tolist()
    assert set(rules) == set(report.passed) | set(report.not_evaluated) | set(report.not_applicable)
    at.run()
    assert at.session_state["he_report"][1] is report  # nothing changed: not run again


def test_health_on_a_fresh_copy_of_the_sample(tmp_path):

    run = fresh_sample(tmp_path)
    at = open_app(run, HEALTH)
    report = at.session_state["he_report"][1]
    assert report.recomputed_steps == 30 and report.recompute_error is None
    assert any("over 30 logged and 30 recomputed steps" in c.value for c in at.caption)
    assert at.get("page_link")  # its findings' steps, linked
    meta = json.loads((run / "rldiag" / "scenarios" / "baseline" / "scenario.json").read_text())
    assert meta["steps_reused"] == list(range(1, 31))  # the doctor read back what the worker wrote
    # length_clipped's state (its clip ratio under 0.1 from step 16 on) and its sparkline: the
    # logged clip ratio at every step with the rule's threshold, the state's first step marked
    assert "State: :green[**resolved since step 16**]" in [m.value for m in at.markdown]
    logged = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        logged[rec["step"]] = rec.get("data", rec)["response_length/clip_ratio"]
    spark = next(c for c in charts(at) if c["data"][0].get("name") == "response_length/clip_ratio")
    assert spark["data"][0]["x"] == list(range(1, 31)) and spark["data"][0]["y"] == [logged[s] for s in range(1, 31)]
    lines = {(sh["type"], sh["line"]["dash"]): sh for sh in spark["layout"]["shapes"]}
    assert lines[("line", "dash")]["y0"] == 0.1 and lines[("line", "dot")]["x0"] == 16


def test_health_links_open_the_step_page(tmp_path):
    """A planted failure (aborted responses) gives a finding whose steps link to the Step page,
    with its calibration line."""
    from rldiag.synth import SynthSpec, write_synth_run

    run = write_synth_run(tmp_path / "r", SynthSpec(steps=3))
    lines = [{"step": s, "data": {"response/aborted_ratio": 0.5, "critic/score/mean": 0.5}} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    at = open_app(run, HEALTH)
    assert any("aborted_responses" in m.value for m in at.markdown)
    assert any(c.value.startswith("Calibration: ") for c in at.caption)
    links = [el.proto for el in at.get("page_link")]
    # (the baseline's signals may add findings on the same steps)
    assert {(p.page, p.label, p.query_string) for p in links} == {("step", f"step {s}", f"step={s}") for s in (1, 2, 3)}


def test_a_broken_run_is_an_error_in_the_page(tmp_path):
    at = open_app(tmp_path / "nope")
    assert not at.exception
    assert any("RunDirError" in e.value and "does not exist" in e.value for e in at.error)


def test_no_run_opens_the_picker():
    at = open_app("")
    assert any("rldiag app /path/to/RUN" in i.value for i in at.info)
    assert at.text_input(key="pk_path").value in ("", None)
    assert not panels(at) and not charts(at)


def test_the_picker_opens_a_typed_path_and_remembers_it(app_run, rldiag_home):
    at = open_app("")
    at.text_input(key="pk_path").set_value(str(app_run))
    at.button(key="pk_open").click().run()
    assert not at.exception
    assert at.text_input(key="run_path").value == str(app_run)
    assert panels(at), "the run's metrics panels"
    assert at.query_params["run"] == str(app_run)  # the view is in the URL
    again = open_app("")
    assert again.button(key="pk_recent_0").label == str(app_run.resolve())
    again.button(key="pk_recent_0").click().run()
    assert again.text_input(key="run_path").value == str(app_run.resolve())


def test_the_bundled_sample_opens_in_place_with_its_outputs_in_the_mirror(rldiag_home):
    from rldiag.io.run_layout import mirror_dir

    sample = default_run()
    if sample is None:
        pytest.skip("no bundled sample in this checkout")
    before = sorted(p.name for p in sample.iterdir())
    at = open_app(None)
    assert not panels(at)  # no run given: the picker
    at.button(key="pk_sample").click().run()
    opened = Path(at.text_input(key="run_path").value)
    assert opened == sample and runs.is_bundled(opened) and runs.writable(opened)
    assert panels(at), "the sample's metrics panels"
    assert (mirror_dir(sample) / "scenarios" / "baseline").is_dir()  # the baseline, computed on open
    assert sorted(p.name for p in sample.iterdir()) == before  # the install is untouched


def test_the_bundled_sample_recomputes_into_its_mirror(rldiag_home):
    sample = default_run()
    if sample is None:
        pytest.skip("no bundled sample in this checkout")
    assert runs.is_bundled(sample) and runs.writable(sample)
    at = open_app(sample, "views/whatif.py")
    assert not at.button(key="wi_run").disabled
    assert any("read-only here" in c.value for c in at.sidebar.caption)


def test_a_run_rldiag_can_write_nowhere_has_recomputing_off(app_run, monkeypatch):
    monkeypatch.setattr(runs, "writable", lambda run: False)
    at = open_app(app_run, "views/whatif.py")
    assert at.button(key="wi_run").disabled
    assert any("can write neither" in c.value for c in at.caption)


def test_health_layout_audit_on_open_cached_on_the_batch_files(app_run):
    """The Health page audits the layouts on open (the synthetic run: DP 2 and 4 move
    actor/ppo_kl), shows the layout-dependent metrics and the skipped layouts, and keeps the
    result while the batch files stay the same."""
    import os

    at = open_app(app_run, HEALTH)
    assert "Layout audit" in [h.value for h in at.subheader]
    key, result = at.session_state["he_layout_audit"]
    assert (app_run / "rldiag" / "sweeps" / "layout-audit" / "audit.json").is_file()
    tables = [t.value for t in at.table]
    dependent = next(t for t in tables if "relative spread" in t.columns)
    assert dependent["metric"].tolist() == [m.metric for m in result.dependent] and "actor/ppo_kl" in set(dependent["metric"])
    assert all(dependent["why"].str.len() > 0)
    skipped = next(t for t in tables if "why skipped" in t.columns)
    assert set(skipped["layout"]) == {x.name for x in result.skipped} and "balance_batch=off" in set(skipped["layout"])
    recomputed = next(t for t in tables if "batch layout" in t.columns)
    assert recomputed["layout"].tolist()[0] == "own" and "one_batch" in recomputed["same as"].tolist()[0]
    at.run()
    assert at.session_state["he_layout_audit"][1] is result  # the same batch files: not audited again
    batch = sorted((app_run / "batches").iterdir())[0]
    st = batch.stat()
    os.utime(batch, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    at.run()
    assert not at.exception
    new_key, new_result = at.session_state["he_layout_audit"]
    assert new_key != key and new_result is not result
