"""The scenario's plan (rldiag/scenario/plan.py), its writer (write.py) and the in-memory door
(memory.py): steps given as numbers are the same steps as their ``--steps`` spec; the steps a
recompute would reuse are those it then reuses; the in-memory recompute gives the written
scenario's metrics, bit for bit; a writer aborted leaves the previous scenario."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rldiag import api
from rldiag.config.settings import resolve_settings
from rldiag.errors import ConfigError
from rldiag.io.outputs import read_scenario
from rldiag.io.run_layout import RunLayout
from rldiag.io.rundir import parse_steps
from rldiag.scenario.memory import recompute_in_memory
from rldiag.scenario.plan import Previous, check_name, reusable_steps
from rldiag.scenario.recompute import recompute
from rldiag.scenario.write import ScenarioReport, ScenarioWriter
from rldiag.synth import SynthSpec, write_synth_run


@pytest.fixture
def run(tmp_path):
    return write_synth_run(tmp_path / "run", SynthSpec(steps=4, prompts=2, n=2, seed=11))


def test_steps_as_numbers_or_as_a_spec():
    have = [1, 2, 3, 5, 8]
    assert parse_steps([5, 1, 1], have) == parse_steps("1,5", have) == [1, 5]
    assert parse_steps((np.int64(8), 2), have) == [2, 8]  # numpy integers are step numbers too
    assert parse_steps(range(1, 4), have) == parse_steps("1:3", have) == [1, 2, 3]
    with pytest.raises(ConfigError, match=r"step 4 has no batch file \(steps 1\.\.8 exist\)"):
        parse_steps([1, 4], have)
    with pytest.raises(ConfigError, match="an empty list selects no step"):
        parse_steps([], have)
    with pytest.raises(ConfigError, match="expected step numbers"):
        parse_steps([1, True], have)
    with pytest.raises(ConfigError, match="expected step numbers"):
        parse_steps([1.0], have)


def test_a_name_is_one_path_component():
    check_name("adv_estimator=rloo")
    for bad in ("a/b", ".hidden", "  "):
        with pytest.raises(ConfigError, match="a sweep name is one path component"):
            check_name(bad, "sweep")


def test_the_steps_to_reuse_are_those_the_recompute_reuses(run):
    settings = resolve_settings(run, {})
    assert reusable_steps(run, "baseline", settings, save_tokens=False) == []
    first = recompute(run, steps=[4, 2], device="cpu")
    assert first.steps_done == [2, 4] and first.steps_reused == []
    assert reusable_steps(run, "baseline", settings, save_tokens=False) == [2, 4]
    assert reusable_steps(run, "baseline", settings, save_tokens=True) == []  # no token files were saved
    assert api.reusable_steps(run) == [2, 4]
    assert api.reusable_steps(run, overrides={"algorithm.gamma": 0.5}) == []  # other settings: nothing
    again = recompute(run, device="cpu")
    assert again.steps_reused == [2, 4] and again.steps_done == [1, 2, 3, 4]


def test_in_memory_gives_the_written_metrics_bit_for_bit(run):
    a, b = resolve_settings(run, {}), resolve_settings(run, {"algorithm.adv_estimator": "rloo"})
    got = recompute_in_memory(run, [a, b], [1, 3])
    assert [g.settings for g in got] == [a, b] and all(not g.failed for g in got)
    for g, overrides in zip(got, ({}, {"algorithm.adv_estimator": "rloo"})):
        rep = recompute(run, overrides, steps="1,3", device="cpu", reuse=False)
        written = {int(r["step"]): r for r in rep.metrics}
        assert sorted(g.metrics) == [1, 3]
        for step, metrics in g.metrics.items():
            want = {k: float(v) for k, v in written[step].items() if k != "step" and v is not None}
            assert metrics.keys() == want.keys()
            assert all(metrics[k] == want[k] or (math.isnan(metrics[k]) and math.isnan(want[k])) for k in want)
    assert got[0].metrics[1]["critic/advantages/max"] != got[1].metrics[1]["critic/advantages/max"]  # two scenarios


def test_an_aborted_writer_leaves_the_previous_scenario(run):
    rep = recompute(run, name="s", device="cpu")
    meta, _ = read_scenario(run, "s")
    layout = RunLayout(run).scenario("s")
    report = ScenarioReport(name="s", path=rep.path, settings=rep.settings, device="cpu")
    with pytest.raises(RuntimeError, match="stop"):
        with ScenarioWriter(layout, report, Previous(), {}, save_tokens=False):
            raise RuntimeError("stop")
    assert read_scenario(run, "s")[0] == meta  # as it was
    writer = ScenarioWriter(layout, report, Previous(), {}, save_tokens=False)
    writer.commit(0.0)
    with pytest.raises(RuntimeError, match="already committed or aborted"):
        writer.commit(0.0)
    writer.abort()  # a no-op once committed
    assert read_scenario(run, "s")[0]["steps_done"] == []
