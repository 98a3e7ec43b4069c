"""Every recompute writes one per-row table per step (``rows/step_<N:06d>.parquet``): the engine's
per-row values, then the batch file's own per-row columns (uid, reward components); reused steps
keep theirs, and a scenario written before the tables existed is recomputed."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from rldiag.io.run_layout import RunLayout
from rldiag.scenario.recompute import recompute
from rldiag.synth import SynthSpec, write_synth_run


@pytest.fixture
def run(tmp_path):
    return write_synth_run(tmp_path / "run", SynthSpec(steps=3, prompts=3, n=4, max_len=24, seed=2, extra_columns=True))


def test_each_step_has_its_row_table(run):
    rep = recompute(run)
    sc = RunLayout(run).scenario("baseline")
    assert sc.row_steps() == [1, 2, 3] == rep.steps_done
    batch = pq.read_table(run / "batches" / "step_2.parquet")
    t = pq.read_table(sc.rows_file(2))
    assert t.num_rows == batch.num_rows
    assert t["step"].to_pylist() == [2] * batch.num_rows and t["row"].to_pylist() == list(range(batch.num_rows))
    # the batch file's own per-row columns, in its row order; no list column
    assert t["uid"].to_pylist() == batch["uid"].to_pylist()
    assert t["acc"].to_pylist() == pytest.approx(batch["acc"].to_pylist())
    assert "response_mask" not in t.column_names and "old_log_probs" not in t.column_names
    # the engine's values: lengths, the actor tokens, the summed score
    lengths = [len(m) for m in batch["response_mask"].to_pylist()]
    assert t["length"].to_pylist() == lengths
    assert t["actor_tokens"].to_pylist() == [int(sum(m)) for m in batch["response_mask"].to_pylist()]
    np.testing.assert_allclose(t["score"].to_numpy(), batch["score"].to_numpy(), rtol=1e-6)


def test_reused_steps_keep_their_tables_and_old_scenarios_are_recomputed(run):
    recompute(run)
    sc = RunLayout(run).scenario("baseline")
    before = pq.read_table(sc.rows_file(1))
    again = recompute(run)
    assert again.steps_reused == [1, 2, 3] and pq.read_table(sc.rows_file(1)).equals(before)
    # a scenario from before the per-row tables: its steps are recomputed, so every step gets one
    shutil.rmtree(sc.rows_dir)
    third = recompute(run)
    assert third.steps_reused == [] and sc.row_steps() == [1, 2, 3]
