"""The app's background baseline (rldiag.app.worker): computed on open, kept current while the run
writes steps, one worker per run, large runs from the latest steps backwards in chunks; and the
plan it follows (rldiag.viz.baseline). Threads are synchronised on the worker's condition (never
a sleep); the idle stop runs on an injected clock."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow.parquet as pq
import pytest

from rldiag import api
from rldiag.app import worker
from rldiag.store import Store
from rldiag.synth import SynthSpec, synth_step_table, write_synth_run
from rldiag.viz import baseline as plan
from rldiag.viz.baseline import plan_baseline, span_text

SPEC = SynthSpec(steps=3, prompts=2, n=4, seed=7)
WAIT = 120  # seconds: a bound on a hung worker, never a synchronisation


@pytest.fixture
def run(tmp_path):
    return write_synth_run(tmp_path / "run", SPEC)


def _add_step(run, step: int) -> None:
    t = synth_step_table(SPEC, step, np.random.default_rng(step))
    tmp = run / "batches" / f".step_{step}.parquet.tmp"
    pq.write_table(t, tmp)
    tmp.rename(run / "batches" / f"step_{step}.parquet")


def _meta(store: Store) -> dict:
    return store.scenario_meta("baseline")


def test_computes_on_open_then_follows_new_steps(run):
    """In the background, as the server runs it: a thread, the recomputes in a child process."""
    store = Store(run)
    w = worker.BaselineWorker(store, poll_seconds=3600)  # looks again only when poked
    assert w.isolate
    children = []
    child_up = w._child_up
    w._child_up = lambda: children.append(child_up()) or children[-1]  # type: ignore[method-assign]
    try:
        first = w.ensure()
        assert first.busy  # nothing done yet: the pages show progress
        snap = w.wait(lambda s: s.passes >= 1, WAIT)
        assert snap.settled and not snap.busy and snap.version == 1 and snap.steps == 3 and snap.error is None
        assert _meta(store)["steps_done"] == [1, 2, 3] and not _meta(store)["save_tokens"]
        w.poke()  # nothing changed: no recompute
        _add_step(run, 4)  # the training job writes a step
        w.poke()
        snap = w.wait(lambda s: s.version >= 2 and s.settled, WAIT)
        assert snap.steps == 4 and _meta(store)["steps_done"] == [1, 2, 3, 4]
        assert _meta(store)["steps_reused"] == [1, 2, 3]
        assert len(children) == 2 and w._child is None  # one child a pass, ended with it
        assert not any(proc.is_alive() for proc, _ in children)
    finally:
        w.stop(WAIT)
    assert not w.alive and w.snapshot().state == "stopped"


def test_one_worker_per_run_whatever_the_sessions(run, monkeypatch):
    monkeypatch.setattr(worker, "MODE", "thread")
    started = []
    real = worker.BaselineWorker._loop

    def loop(self):
        started.append(threading.current_thread().name)
        real(self)

    monkeypatch.setattr(worker.BaselineWorker, "_loop", loop)
    a, b = Store(run), Store(str(run) + "/")  # two sessions' stores of the same run
    got = []
    threads = [threading.Thread(target=lambda s=s: got.append(worker.worker_for(s, poll_seconds=3600, isolate=False)))
               for s in (a, b, a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert len({id(w) for w in got}) == 1
    w = got[0]
    for _ in range(3):
        w.ensure()
    w.wait(lambda s: s.passes >= 1, WAIT)
    assert len(started) == 1
    worker.stop_all(WAIT)
    assert worker.lookup(worker.key_of(a)) is None


def test_a_worker_nobody_asks_about_stops(run):
    now = [0.0]
    w = worker.BaselineWorker(Store(run), poll_seconds=3600, idle_stop=60, clock=lambda: now[0], isolate=False)
    w.ensure()
    w.wait(lambda s: s.passes >= 1, WAIT)
    assert w.alive
    now[0] = 61.0  # a minute without a page asking
    w.poke()
    w.wait(lambda s: s.state == "stopped", WAIT)
    w._thread.join(WAIT)
    assert not w.alive
    w.ensure()  # a page opens the run again: it starts again (nothing new to compute)
    assert w.alive
    w.stop(WAIT)
    assert w.snapshot().version == 1


def test_large_runs_go_backwards_in_chunks(tmp_path, monkeypatch):
    """7 steps, "large" above 4 and chunks of 2: the latest steps first, each recompute covering
    the steps done so far (reused) and the next chunk; the scenario grows after each."""
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=7, prompts=2, n=2, seed=3))
    monkeypatch.setattr(plan, "LARGE_STEPS", 4)
    monkeypatch.setattr(plan, "CHUNK_STEPS", 2)
    calls = []
    real = api.recompute

    def recompute(*a, **kw):
        res = real(*a, **kw)
        calls.append((kw.get("steps"), res.steps_done, res.steps_reused))
        return res

    monkeypatch.setattr(worker.api, "recompute", recompute)
    w = worker.BaselineWorker(Store(run), synchronous=True)
    snap = w.ensure()
    assert [c[0] for c in calls] == [[6, 7], [4, 5, 6, 7], [2, 3, 4, 5, 6, 7], None]
    assert [c[1] for c in calls] == [[6, 7], [4, 5, 6, 7], [2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7]]
    assert [c[2] for c in calls] == [[], [6, 7], [4, 5, 6, 7], [2, 3, 4, 5, 6, 7]]
    assert snap.large and snap.version == 4 and snap.chunks == 4 and snap.covered == 7 and snap.settled
    # a step written later: one chunk, the new step alone computed
    write_synth_run(tmp_path / "more", SynthSpec(steps=8, prompts=2, n=2, seed=3))
    (tmp_path / "more" / "batches" / "step_8.parquet").rename(run / "batches" / "step_8.parquet")
    calls.clear()
    w.ensure()
    assert [(c[0], c[2]) for c in calls] == [(None, [1, 2, 3, 4, 5, 6, 7])]


def test_an_error_is_shown_not_raised(run):
    (run / "run.yaml").write_text("algorithm:\n  adv_estimator: no_such_estimator\n")
    w = worker.BaselineWorker(Store(run), synchronous=True)
    snap = w.ensure()
    assert snap.state == "failed" and "no_such_estimator" in snap.error and snap.settled
    assert w.ensure().passes == 1  # the same files: not tried again


def test_an_error_in_the_child_process_is_shown(run):
    (run / "run.yaml").write_text("algorithm:\n  adv_estimator: no_such_estimator\n")
    w = worker.BaselineWorker(Store(run), poll_seconds=3600)
    try:
        w.ensure()
        snap = w.wait(lambda s: s.passes >= 1, WAIT)
        assert snap.state == "failed" and "no_such_estimator" in snap.error
    finally:
        w.stop(WAIT)


def test_exclusive_keeps_the_worker_out(run):
    """A page writing the baseline holds the worker's lock: the worker's recompute waits for it."""
    w = worker.BaselineWorker(Store(run), poll_seconds=3600, isolate=False)
    with w.exclusive():
        w.ensure()
        w.wait(lambda s: s.state == "running", WAIT)
        assert "baseline" not in Store(run).scenario_names()  # it waits for the lock
    w.wait(lambda s: s.passes >= 1, WAIT)
    w.stop(WAIT)
    assert "baseline" in Store(run).scenario_names()


# -- the plan -------------------------------------------------------------------------------------


def test_plan_small_and_large():
    small = plan_baseline([(s, 10) for s in range(1, 31)])
    assert not small.large and small.chunks == ((),)
    big = plan_baseline([(s, 10) for s in range(1, 11)], done=[9, 10, 42], large_steps=5, chunk_steps=3,
                        first_steps=3)
    assert big.large and big.done == (9, 10) and big.chunks == ((8, 7, 6), (5, 4, 3), (2, 1))
    by_bytes = plan_baseline([(1, 5), (2, 5), (3, 5)], large_bytes=10, chunk_bytes=9, first_bytes=9)
    assert by_bytes.large and by_bytes.chunks == ((3,), (2,), (1,))
    # the chunks grow from the first's limits, doubling, up to the chunk's: steps ...
    grow = plan_baseline([(s, 1) for s in range(1, 21)], large_steps=5, chunk_steps=6, first_steps=1)
    assert grow.chunks == ((20,), (19, 18), (17, 16, 15, 14), (13, 12, 11, 10, 9, 8), (7, 6, 5, 4, 3, 2), (1,))
    # ... and bytes (a step bigger than the limit is a chunk of its own)
    by_size = plan_baseline([(s, 10) for s in range(1, 9)], large_bytes=1, chunk_bytes=40, first_bytes=5,
                            chunk_steps=50, first_steps=50)
    assert by_size.chunks == ((8,), (7,), (6, 5), (4, 3, 2, 1))
    done = plan_baseline([(s, 1) for s in range(1, 4)], done=[1, 2, 3], large_steps=1)
    assert done.large and done.chunks == ((),)  # nothing pending: one recompute, every step reused


def test_span_text():
    assert span_text([5, 1, 2, 3, 9]) == "1-3, 5, 9"
    assert span_text([8, 9, 10, 1]) == "1, 8-10"


def test_the_done_steps_are_those_the_recompute_reuses(tmp_path):
    """The worker plans with the driver's own decision (rldiag.api.reusable_steps): the steps of
    a baseline written under other settings are not counted as done."""
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=3, prompts=2, n=2, seed=3))
    w = worker.BaselineWorker(Store(run), synchronous=True)
    assert w._baseline_record() == ([], False)
    w.ensure()
    assert w._baseline_record() == ([1, 2, 3], False)
    (run / "run.yaml").write_text((run / "run.yaml").read_text().replace("clip_ratio: 0.2", "clip_ratio: 0.3"))
    assert "baseline" in Store(run).scenario_names()
    assert w._baseline_record() == ([], False)  # its meta says 1-3 done, under other settings


def test_rldiag_app_starts_the_baseline_of_its_runs_before_a_page_asks(run, monkeypatch):
    """``rldiag app RUN`` (rldiag.app.serve): each preloaded run's worker starts with the server,
    so the first page finds the baseline done or under way; in ``sync`` / ``off`` mode none does."""
    import rldiag.app as app_pkg

    monkeypatch.setattr(app_pkg, "_preloaded", {})
    app_pkg.preload([run])
    monkeypatch.setattr(worker, "MODE", "sync")
    app_pkg.start_baselines()
    assert worker.lookup(worker.key_of(Store(run))) is None
    monkeypatch.setattr(worker, "MODE", "thread")
    try:
        app_pkg.start_baselines()
        w = worker.lookup(worker.key_of(Store(run)))
        assert w is not None and not w.synchronous
        snap = w.wait(lambda s: s.passes >= 1, WAIT)
        assert snap.error is None and _meta(Store(run))["steps_done"] == [1, 2, 3]
    finally:
        worker.stop_all(WAIT)
