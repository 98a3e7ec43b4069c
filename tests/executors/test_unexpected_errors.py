"""An exception rldiag does not foresee, in loading one step or in computing one pack, fails those
steps alone: every other step is computed and written, and the error names the step."""

from __future__ import annotations

from rldiag.executors import steps as steps_mod
from rldiag.io.outputs import read_scenario
from rldiag.scenario.recompute import recompute


def test_an_unforeseen_load_error_fails_only_its_step(synth_run, monkeypatch):
    real = steps_mod.load_step

    def load(sf, *a, **k):
        if sf.step == 2:
            raise OverflowError("Python int too large to convert to C long")
        return real(sf, *a, **k)

    monkeypatch.setattr(steps_mod, "load_step", load)
    rep = recompute(synth_run, name="x", device="cpu", reuse=False)
    assert rep.steps_done == [1, 3, 4, 5]
    assert list(rep.steps_failed) == [2]
    err = rep.steps_failed[2]
    assert "step 2" in err and "step_" in err and "OverflowError" in err
    meta, table = read_scenario(synth_run, "x")
    assert table.column("step").to_pylist() == [1, 3, 4, 5]


def test_an_unforeseen_compute_error_fails_only_its_pack(synth_run, monkeypatch):
    real = steps_mod.recompute_batch

    def compute(batch, settings, kl_state, **how):
        if 3 in batch.steps:
            raise RuntimeError("shape mismatch")
        return real(batch, settings, kl_state, **how)

    monkeypatch.setattr(steps_mod, "recompute_batch", compute)
    rep = recompute(synth_run, name="x", device="cpu", reuse=False, pack_tokens=1)  # one step per pack
    assert rep.steps_done == [1, 2, 4, 5]
    assert rep.steps_failed[3] == "InternalError: steps 3: RuntimeError: shape mismatch"  # a bug, not bad input
    assert list(rep.internal) == [3] and "raise RuntimeError" in rep.internal[3]  # its traceback kept
    _, table = read_scenario(synth_run, "x")
    assert table.column("step").to_pylist() == [1, 2, 4, 5]
