"""What-ifs that change nothing say so, and a scenario equal to another by resolved settings reuses
it whatever its name: ``recompute --set`` of a run's own value warns and reuses the baseline
(the requested name written too, hard-linked or copied, ``reused_from`` in its scenario.json);
``sweep`` notes a swept value equal to the run's own and marks the run's own scenario."""

from __future__ import annotations

import json

import polars as pl
import pytest

from rldiag.cli.main import main
from rldiag.config.settings import resolve_settings, unchanged_overrides
from rldiag.io.run_layout import RunLayout
from rldiag.scenario.recompute import recompute
from rldiag.scenario.sweep import sweep
from rldiag.synth import SynthSpec, write_synth_run

CLIP = "actor_rollout_ref.actor.clip_ratio"
HIGH = "actor_rollout_ref.actor.clip_ratio_high"


@pytest.fixture
def run(tmp_path):
    return write_synth_run(tmp_path / "run", SynthSpec(steps=3, prompts=3, n=4, min_len=6, max_len=20, seed=11))


def test_unchanged_overrides_read_values_as_verl_does(run):
    base = resolve_settings(run, {})
    assert base.effective(HIGH) == base[CLIP] == 0.2  # clip_ratio_high null: clip_ratio's
    assert unchanged_overrides(base, {HIGH: 0.2, CLIP: "0.2", "algorithm.gamma": 0.9}) == {HIGH: 0.2, CLIP: "0.2"}
    assert unchanged_overrides(base, {"algorithm.adv_estimator": base["algorithm.adv_estimator"]}) != {}


def test_recompute_of_the_runs_own_value_warns_and_reuses_the_baseline(run, capsys):
    base = recompute(run, device="cpu")
    assert base.warnings == [] and base.reused_from is None
    rep = recompute(run, {HIGH: 0.2}, name="same", device="cpu")
    assert rep.warnings == [f"{HIGH}=0.2: the run already has this value; the scenario equals the run's own "
                            "settings (baseline)"]
    assert rep.reused_from == "baseline" and rep.steps_reused == [1, 2, 3] and rep.rows == 0
    layout = RunLayout(run)
    meta = json.loads(layout.scenario("same").meta.read_text())
    assert meta["reused_from"] == "baseline" and meta["steps_reused"] == [1, 2, 3]
    a = pl.read_parquet(layout.scenario("baseline").dir / "metrics.parquet")
    b = pl.read_parquet(layout.scenario("same").dir / "metrics.parquet")
    assert a.equals(b)
    for step in (1, 2, 3):
        src, dst = layout.scenario("baseline").rows_file(step), layout.scenario("same").rows_file(step)
        assert dst.read_bytes() == src.read_bytes()  # hard-linked where the filesystem allows, else copied
    # the CLI says both
    assert main(["recompute", str(run), "--set", f"{HIGH}=0.2", "--name", "again", "--no-progress"]) == 0
    out = capsys.readouterr()
    assert "the run already has this value" in out.err
    assert "3 reused from scenario baseline (the same resolved settings)" in out.out


def test_a_scenario_of_another_name_and_other_overrides_is_reused_when_settings_agree(run):
    """clip_ratio_low=0.2 and clip_ratio_high=0.3 spelled two ways resolve alike."""
    first = recompute(run, {HIGH: 0.3}, name="high", device="cpu")
    assert first.reused_from is None and first.steps_reused == []
    again = recompute(run, {HIGH: 0.3, "actor_rollout_ref.actor.clip_ratio_low": 0.2}, name="spelled", device="cpu")
    assert again.warnings == ["actor_rollout_ref.actor.clip_ratio_low=0.2: the run already has this value"]
    assert again.reused_from == "high" and again.steps_reused == [1, 2, 3]
    other = recompute(run, {HIGH: 0.35}, name="other", device="cpu")
    assert other.reused_from is None and other.steps_reused == []  # different settings: computed


def test_sweep_notes_the_runs_own_value_and_marks_its_scenario(run, capsys):
    rep = sweep(run, {CLIP: [0.1, 0.2, 0.3]}, device="cpu")
    own = "clip_ratio=0.2"
    assert rep.own == own and f"{CLIP}=0.2 is the run's own value" in rep.notes
    assert f"scenario {own} has the run's own settings (marked *)" in rep.notes
    meta = json.loads(RunLayout(run).sweep(rep.name).meta.read_text())
    assert meta["own"] == own
    from rldiag import api

    assert api.sweep_own(run, rep.name) == own
    # a later recompute of the run's own settings under another name reuses the swept scenario
    later = recompute(run, name="mine", device="cpu")
    assert later.reused_from == own and later.steps_reused == [1, 2, 3]
    assert main(["sweep", str(run), "--grid", f"{CLIP}=0.2,0.3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"* {own}" in out and f"note: {CLIP}=0.2 is the run's own value" in out
    assert "(2 scenarios x 3 steps, 6 reused," in out  # both written by the first sweep
