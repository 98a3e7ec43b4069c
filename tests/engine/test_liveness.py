"""Freeing state fields and batch columns after their last declared reader
(rldiag/engine/liveness.py): the same bits as a recompute that keeps everything, under every
configuration of the stage tests; a read the declarations miss fails loudly; the plan frees what
it should, where it should."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from rldiag.config.settings import resolve_settings
from rldiag.engine.batch import pack
from rldiag.engine.liveness import FREEABLE_COLUMNS, Freed, Release, release_plan
from rldiag.engine.pipeline import recompute_batch
from rldiag.engine.requirements import recompute_columns
from rldiag.engine.stages import STAGES, Stage, State
from rldiag.engine.step_failures import StepErrors
from rldiag.errors import InternalError
from rldiag.io.loader import load_step
from rldiag.io.rundir import RunDir
from tests.engine.test_stages import CASES, EVERYTHING, rich_run  # noqa: F401 - the fixture


def _batch(run, settings):
    return pack([load_step(sf, settings, recompute_columns(settings)).batch for sf in RunDir(run).require_steps()])


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert value.dtype == b[name].dtype, name
        assert np.array_equal(value.numpy(), b[name].numpy(), equal_nan=True), name


@pytest.mark.parametrize("case", list(CASES))
def test_released_recompute_is_bit_equal(rich_run, case):  # noqa: F811 - the fixture
    settings = resolve_settings(rich_run, {**EVERYTHING, **CASES[case]})
    full = recompute_batch(_batch(rich_run, settings), settings)
    batch = _batch(rich_run, settings)
    kept = {c: getattr(batch, c) for c in FREEABLE_COLUMNS}
    released = recompute_batch(batch, settings, release=True)
    _same(full.metrics, released.metrics)
    _same(full.tokens, released.tokens)
    _same(full.rows, released.rows)
    assert full.failed == released.failed
    # the caller's batch keeps its columns (the state's copy lost them)
    assert all(getattr(batch, c) is v for c, v in kept.items())
    quiet = recompute_batch(_batch(rich_run, settings), settings, release=True, keep_tokens=False)
    assert quiet.tokens == {}
    _same(full.metrics, quiet.metrics)
    _same(full.rows, quiet.rows)


def test_the_plan_frees_each_column_after_its_last_declared_reader(rich_run):  # noqa: F811 - the fixture
    settings = resolve_settings(rich_run, EVERYTHING)
    plan = release_plan(STAGES, settings)
    assert len(plan) == len(STAGES)
    where = {c: STAGES[i].name for i, r in enumerate(plan) for c in r.columns}
    for col, stage in where.items():
        i = [s.name for s in STAGES].index(stage)
        assert col in STAGES[i].reads(settings)
        assert not any(col in s.reads(settings) for s in STAGES[i + 1:]), col
    assert where["entropy"] == "old_policy"  # health, mismatch and the rows stages never read it
    assert where["vpreds"] == "critic"
    fields = {f: STAGES[i].name for i, r in enumerate(plan) for f in r.fields}
    assert fields["ret"] == "critic" and fields["turn"] == "turns"
    assert not {"batch", "metrics", "tokens", "rows", "errors", "settings"} & set(fields)
    # without a critic the value columns are not read at all
    assert "values" not in {c for r in release_plan(STAGES, resolve_settings(rich_run, {})) for c in r.columns}


def test_nothing_is_freed_before_an_undeclared_stage(rich_run):  # noqa: F811 - the fixture
    settings = resolve_settings(rich_run, EVERYTHING)
    undeclared = dataclasses.replace(STAGES[-3], uses=None)
    stages = (*STAGES[:-3], undeclared, *STAGES[-2:])
    plan = release_plan(stages, settings)
    assert all(r == Release() for r in plan[:-3])
    assert set(plan[-3].fields) >= {"ret", "turn", "is_weights"}
    assert "entropy" in plan[-3].columns


def test_an_undeclared_read_of_a_freed_value_raises(rich_run):  # noqa: F811 - the fixture
    settings = resolve_settings(rich_run, EVERYTHING)
    state = State(_batch(rich_run, settings), settings, None, StepErrors([1, 2]))
    Release(fields=("is_weights", "adv"), columns=("entropy",)).apply(state, "advantages")
    for use in (lambda: state.adv.sum(), lambda: torch.where(state.is_weights > 0, 1.0, 0.0),
                lambda: torch.exp(state.batch.entropy), lambda: bool(state.is_weights), lambda: state.adv[0],
                lambda: state.adv * 2.0, lambda: len(state.adv)):
        with pytest.raises(InternalError, match="freed after stage advantages"):
            use()
    assert state.is_weights is not None  # never mistaken for an absent value

    def sneaky(st: State) -> None:
        st.metrics["x"] = st.batch.entropy.sum()

    stages = (*STAGES, Stage("sneaky", "reads entropy without declaring it", sneaky, uses=(), sets=()))
    plan = release_plan(stages, settings)
    state = State(_batch(rich_run, settings), settings, None, StepErrors([1, 2]))
    with pytest.raises(InternalError, match="batch column 'entropy'"):
        for i, stage in enumerate(stages):
            stage.run(state)
            plan[i].apply(state, stage.name)
    assert isinstance(state.batch.entropy, Freed)
