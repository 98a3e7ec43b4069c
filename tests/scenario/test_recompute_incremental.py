"""Incremental recompute: unchanged steps are reused, changed ones recomputed; --follow keeps
up with a run that is still writing batches."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from rldiag.io.outputs import read_scenario
from rldiag.scenario.recompute import follow, recompute
from rldiag.synth import SynthSpec, synth_step_table, write_synth_run


def test_second_run_reuses_unchanged_steps(synth_run):
    first = recompute(synth_run, name="s", save_tokens=True)
    assert first.steps_reused == []
    again = recompute(synth_run, name="s", save_tokens=True)
    assert again.steps_reused == [1, 2, 3, 4, 5] and again.tokens == 0
    m1 = {r["step"]: r for r in first.metrics}
    m2 = {r["step"]: r for r in again.metrics}
    for s in m1:
        for k, v in m1[s].items():
            assert m2[s][k] == pytest.approx(v, nan_ok=True)
    assert sorted(p.name for p in (synth_run / "rldiag/scenarios/s/tokens").iterdir())[0] == "step_000001.parquet"
    meta, table = read_scenario(synth_run, "s")
    assert meta["steps_reused"] == [1, 2, 3, 4, 5] and table.num_rows == 5


def test_changed_input_or_settings_are_recomputed(synth_run):
    recompute(synth_run, name="s")
    p = synth_run / "batches" / "step_2.parquet"
    t = pq.read_table(p)
    pq.write_table(t.slice(0, t.num_rows - 1), p)  # one row fewer
    rep = recompute(synth_run, name="s")
    assert rep.steps_reused == [1, 3, 4, 5]
    # other settings under the same name: nothing reused
    rep = recompute(synth_run, {"algorithm.adv_estimator": "rloo"}, name="s")
    assert rep.steps_reused == []
    assert recompute(synth_run, name="s", reuse=False).steps_reused == []


def test_follow_picks_up_new_batches(tmp_path):
    """A batch written while follow runs (here: as it reports its first update, so no timing is
    involved) is recomputed, and the earlier steps are reused."""
    import numpy as np

    run = write_synth_run(tmp_path / "r", SynthSpec(steps=2, seed=1))
    spec = SynthSpec(steps=1, seed=9)
    updates = []

    def on_update(rep):
        updates.append(rep)
        if len(updates) == 1:  # the trainer writes its next step, atomically
            t = synth_step_table(spec, 3, np.random.default_rng(0))
            tmp = run / "batches" / ".step_3.parquet.tmp"
            pq.write_table(t, tmp)
            tmp.rename(run / "batches" / "step_3.parquet")

    rep = follow(run, name="live", poll_seconds=0.05, idle_timeout=0.5, on_update=on_update)
    assert [u.steps_done for u in updates] == [[1, 2], [1, 2, 3]]
    assert rep.steps_done == [1, 2, 3]
    assert rep.steps_reused == [1, 2]


def test_follow_without_batches_times_out(tmp_path):
    from rldiag.errors import RldiagError

    (tmp_path / "r" / "batches").mkdir(parents=True)
    with pytest.raises(RldiagError):
        follow(tmp_path / "r", poll_seconds=0.05, idle_timeout=0.2)
