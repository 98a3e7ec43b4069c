"""One step's per-token outputs on demand (rldiag.api.step_tokens): the scenario's own when it
saved them, else a one-step recompute into the scenario's token cache, reused while current."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from rldiag import api
from rldiag.errors import RldiagError
from rldiag.io.run_layout import RunLayout
from rldiag.scenario import tokens as scenarios
from rldiag.synth import SynthSpec, write_synth_run


@pytest.fixture
def run(tmp_path):
    return write_synth_run(tmp_path / "run", SynthSpec(steps=5, prompts=2, n=4, seed=9))


def test_the_cache_computes_one_step_and_keeps_the_nearest(run, monkeypatch):
    cache = RunLayout(run).token_cache("baseline")
    got = api.step_tokens(run, 3)
    assert got.source == "cache" and got.computed and got.path == cache.tokens_file(3)
    assert cache.token_steps() == [3] and not (run / "rldiag" / "scenarios").exists()
    again = api.step_tokens(run, 3)
    assert not again.computed and again.path == got.path
    monkeypatch.setattr(scenarios, "CACHE_STEPS", 2)
    api.step_tokens(run, 1)
    assert cache.token_steps() == [1, 3]
    api.step_tokens(run, 5)  # the nearest to step 5 kept
    assert cache.token_steps() == [3, 5]
    # the same numbers as a full recompute with tokens
    full = api.recompute(run, name="full", save_tokens=True)
    assert pq.read_table(cache.tokens_file(5)).equals(pq.read_table(full.path / "tokens" / "step_000005.parquet"))


def test_a_scenario_with_tokens_is_read_as_it_is(run):
    res = api.recompute(run, save_tokens=True, steps="2:3")
    got = api.step_tokens(run, 2)
    assert got.source == "scenario" and got.path == res.path / "tokens" / "step_000002.parquet"
    other = api.step_tokens(run, 4)  # a step the scenario does not have
    assert other.source == "cache"


def test_a_scenario_of_other_settings_uses_its_overrides(run):
    api.recompute(run, estimator="rloo", steps="1")  # no tokens
    got = api.step_tokens(run, 2, "adv_estimator=rloo")
    meta = RunLayout(run).token_cache("adv_estimator=rloo").meta.read_text()
    assert got.source == "cache" and '"algorithm.adv_estimator": "rloo"' in meta
    with pytest.raises(RldiagError, match="no scenario 'nope'"):
        api.step_tokens(run, 2, "nope")
    with pytest.raises(RldiagError, match="no batch file for step 9"):
        api.step_tokens(run, 9)


def test_the_frame_reads_only_the_columns_asked_for(run):
    whole = api.step_token_frame(run, 2)
    some = api.step_token_frame(run, 2, columns=["ratio", "no_such_column", "row"])
    assert some.columns == ["row", "ratio"] and some.equals(whole.select(["row", "ratio"]))
