"""rldiag.engine.side: the diagnostics run on a second thread beside verl's stages give the bits,
and the order of names, of a run on one thread, under every estimator, loss and correction
setting, with and without the release plan; a side stage's error is raised on the engine's
thread, and the side thread has ended whenever recompute_batch returns or raises."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from rldiag.config.settings import resolve_settings
from rldiag.engine import pipeline
from rldiag.engine.pipeline import recompute_batch
from rldiag.engine.side import END, SIDES, Side, check, effective_order
from rldiag.engine.stages import STAGES
from rldiag.errors import InternalError
from tests.engine.test_liveness import _batch
from tests.engine.test_stages import CASES, EVERYTHING, rich_run  # noqa: F401 - the fixture


@pytest.fixture
def patch_stage():
    """Replace a stage's ``run`` (a frozen dataclass: set as bench/bench_phases.py does), restored after."""
    saved = []

    def patch(name, fn):
        stage = next(s for s in STAGES if s.name == name)
        saved.append((stage, stage.run))
        object.__setattr__(stage, "run", fn)
        return stage

    yield patch
    for stage, run in reversed(saved):
        object.__setattr__(stage, "run", run)


def _same_in_order(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)  # the same names, in the same order
    for name, value in a.items():
        assert value.dtype == b[name].dtype, name
        assert np.array_equal(value.numpy(), b[name].numpy(), equal_nan=True), name


@pytest.mark.parametrize("case", list(CASES))
def test_side_stages_give_the_one_thread_results(rich_run, case):  # noqa: F811 - the fixture
    settings = resolve_settings(rich_run, {**EVERYTHING, **CASES[case]})
    for release, keep in ((False, True), (True, True), (True, False)):
        one = recompute_batch(_batch(rich_run, settings), settings, release=release, keep_tokens=keep, sides=())
        two = recompute_batch(_batch(rich_run, settings), settings, release=release, keep_tokens=keep)
        _same_in_order(one.metrics, two.metrics)
        _same_in_order(one.tokens, two.tokens)
        _same_in_order(one.rows, two.rows)
        assert one.failed == two.failed


def test_the_groups_are_stages_placed_where_they_can_run():
    """Sanity of the comparison above: every side stage is a stage that writes metrics, starts
    after its group's ``after``, and the release plan's order has each group at its join."""
    names = [s.name for s in STAGES]
    by = {s.name: s for s in STAGES}
    for g in SIDES:
        assert set(g.stages) <= set(names) and g.after in names and (g.before in names or g.before == END)
        assert all(names.index(g.after) < names.index(n) and by[n].metrics for n in g.stages)
    check(STAGES, SIDES)
    order = [s.name for s in effective_order(STAGES, SIDES)]
    assert sorted(order) == sorted(names)
    first = SIDES[0]
    assert order[order.index(first.before) - len(first.stages):order.index(first.before)] == list(first.stages)
    assert order[-len(SIDES[1].stages):] == list(SIDES[1].stages)


def test_an_error_in_a_side_stage_is_raised_and_the_thread_has_ended(rich_run, patch_stage):  # noqa: F811
    settings = resolve_settings(rich_run, EVERYTHING)

    def broken(st):
        raise RuntimeError("the side stage failed")

    patch_stage("mismatch", broken)
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(RuntimeError, match="side stage failed"):
        recompute_batch(_batch(rich_run, settings), settings, release=True)
    assert not [t for t in threading.enumerate() if t.ident not in before and t.name == "rldiag-side-stages"]


def test_an_error_on_the_main_thread_waits_for_the_side_thread(rich_run, patch_stage):  # noqa: F811
    """A main stage fails while the side stages run: the error propagates once the side thread
    is done (it never computes on a state its caller has dropped)."""
    settings = resolve_settings(rich_run, EVERYTHING)
    gate = threading.Event()
    side_done: list[bool] = []
    real = next(s for s in STAGES if s.name == "mismatch").run

    def slow(st):
        gate.wait()
        real(st)
        side_done.append(True)

    def fail(st):
        gate.set()  # the side stage may go on now; the engine's thread raises
        raise RuntimeError("advantages failed")

    patch_stage("mismatch", slow)
    patch_stage("advantages", fail)
    with pytest.raises(RuntimeError, match="advantages failed"):
        recompute_batch(_batch(rich_run, settings), settings, release=True)
    assert side_done == [True]


def test_side_none_runs_every_stage_on_the_callers_thread(rich_run, patch_stage):  # noqa: F811
    settings = resolve_settings(rich_run, EVERYTHING)
    seen: dict[str, str] = {}
    for s in STAGES:
        def spy(st, real=s.run, name=s.name):
            seen[name] = threading.current_thread().name
            return real(st)
        patch_stage(s.name, spy)
    recompute_batch(_batch(rich_run, settings), settings, sides=())
    assert set(seen.values()) == {threading.current_thread().name}
    seen.clear()
    recompute_batch(_batch(rich_run, settings), settings)
    assert {n for n, t in seen.items() if t == "rldiag-side-stages"} == {n for g in SIDES for n in g.stages}


def test_a_side_whose_join_stage_is_absent_is_joined_at_the_end(rich_run):  # noqa: F811
    settings = resolve_settings(rich_run, EVERYTHING)
    one = recompute_batch(_batch(rich_run, settings), settings, sides=())
    for before in ("rows_loss", "no_such_stage"):
        late = Side(stages=("mismatch",), after="anchor", before=before)
        two = recompute_batch(_batch(rich_run, settings), settings, sides=(late,), release=True)
        _same_in_order(one.metrics, two.metrics)
        _same_in_order(one.rows, two.rows)
    assert pipeline.SIDES is SIDES


@pytest.mark.parametrize("side, why", [
    (Side(("diag_is",), after="anchor", before="rows"), "turns"),  # turns reads diag_is_token before the join
    (Side(("diag_is",), after="advantages", before="turns"), "comes before"),
    (Side(("health",), after="anchor", before="rows"), "cannot run beside"),  # reads the mask, the policy loss made meanwhile
    (Side(("mismatch",), after="no_stage", before="rows"), "not a stage"),
    (Side(("no_stage",), after="anchor"), "not a stage"),
])
def test_a_side_that_would_change_a_number_is_refused(side, why):
    with pytest.raises(InternalError, match=why):
        effective_order(STAGES, (side,))


def test_two_groups_that_touch_each_others_fields_are_refused():
    """diag_is sets diag_is_token, which rows reads: the two may not run at once."""
    with pytest.raises(InternalError, match="may run at once"):
        check(STAGES, (Side(("diag_is",), after="anchor", before="turns"), Side(("rows",), after="actor_loss")))
