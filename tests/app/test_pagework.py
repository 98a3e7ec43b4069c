"""A page's heavy work (rldiag.app.pagework): in a child process, with the background baselines
paused meanwhile (rldiag.app.worker's hold / resume, the child's pause between two steps).
Synchronised on the worker's condition and the children's pipes (never a sleep)."""

from __future__ import annotations

import os

import pytest

from rldiag import api
from rldiag.app import pagework, worker
from rldiag.errors import ComputeError, RunDirError
from rldiag.store import Store
from rldiag.synth import SynthSpec, write_synth_run

SPEC = SynthSpec(steps=3, prompts=2, n=4, seed=7)
WAIT = 120  # seconds: a bound on a hung worker, never a synchronisation


@pytest.fixture
def run(tmp_path):
    return write_synth_run(tmp_path / "run", SPEC)


def test_a_pages_one_off_work_runs_in_a_child_and_comes_back_with_its_errors(run, monkeypatch):
    """pagework.in_child (the Step page's per-token values): the work runs in another process,
    its result is the inline one, an RldiagError comes back as itself, a child that dies is a
    ComputeError; inline in the sync mode."""
    monkeypatch.setattr(worker, "MODE", "thread")
    assert pagework.in_child(os.getpid) != os.getpid()
    got = pagework.in_child(api.step_tokens, run, 2, "baseline", device="cpu")
    assert got.error is None and got.computed and got.path.is_file()
    again = api.step_tokens(run, 2, "baseline", device="cpu")  # the child's cache, read here
    assert (again.path, again.computed) == (got.path, False)
    with pytest.raises(RunDirError, match="nowhere"):
        pagework.in_child(api.step_tokens, run.parent / "nowhere", 1, "baseline")
    with pytest.raises(ComputeError, match="exit code 3"):
        pagework.in_child(os._exit, 3)
    monkeypatch.setattr(worker, "MODE", "sync")
    assert pagework.in_child(os.getpid) == os.getpid()


def test_one_rows_values_come_back_from_the_child(run, monkeypatch):
    """The Rollouts page's transcript colours: the row's values of the step's frame, nothing else."""
    monkeypatch.setattr(worker, "MODE", "thread")
    got = pagework.in_child(pagework.row_token_values, str(run), "baseline", 2, 3, "advantages")
    frame = api.step_token_frame(run, 2, "baseline", columns=["advantages"])
    want = frame.filter(frame["row"] == 3)["advantages"][0].to_list()
    assert got == want and len(got) == len(Store(run).row_tokens(2, 3)["mask"])
    assert pagework.in_child(pagework.row_token_values, str(run), "baseline", 2, 3, "no_such_column") is None


def test_the_baselines_child_pauses_between_two_steps_while_held(run):
    """A cleared ``go`` event: the child's recompute stops after the step it computes, says
    "paused" (nothing else until it may go on), then finishes every step once set again."""
    ctx = worker.mp_context()
    parent, child = ctx.Pipe()
    go = ctx.Event()  # cleared: a page's heavy work holds the baseline
    proc = ctx.Process(target=worker.child_main, args=(child, str(run), "cpu", go), daemon=True)
    proc.start()
    child.close()
    try:
        parent.send((None, False))
        assert parent.recv() == ("progress", 1, 3, "step 1")
        assert parent.recv() == ("paused",)
        assert not parent.poll(0)  # it waits: no step computed, nothing sent
        assert not (run / "rldiag" / "scenarios" / "baseline" / "scenario.json").exists()
        go.set()
        msgs = []
        while not msgs or msgs[-1][0] != "done":
            msgs.append(parent.recv())
        assert msgs[0] == ("resumed",)
        assert [m[1] for m in msgs if m[0] == "progress"] == [2, 3]
        summary, error = msgs[-1][1:]
        assert error is None and summary["steps_done"] == [1, 2, 3]
        parent.send(None)
        proc.join(WAIT)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        parent.close()


def test_no_recompute_starts_while_a_page_holds_the_worker(run):
    """hold(): the worker's pass waits before its recompute (the worker is quiet, nothing
    written); resume(): it computes every step."""
    store = Store(run)
    w = worker.BaselineWorker(store, poll_seconds=3600)
    assert w.isolate
    w.hold()
    try:
        w.ensure()
        w.wait(lambda s: s.state == "running", WAIT)
        assert w.wait_quiet(WAIT) and w.quiet
        assert not (run / "rldiag" / "scenarios" / "baseline" / "scenario.json").exists()
        assert w.snapshot().version == 0
        w.resume()
        snap = w.wait(lambda s: s.passes >= 1, WAIT)
        assert snap.error is None and store.scenario_meta("baseline")["steps_done"] == [1, 2, 3]
    finally:
        w.stop(WAIT)


def test_quiet_baselines_holds_every_worker_of_the_process(run, monkeypatch):
    """The page's side: every registered worker held inside, resumed on the way out (an error
    included)."""
    monkeypatch.setattr(worker, "MODE", "thread")
    w = worker.worker_for(Store(run), poll_seconds=3600)
    try:
        with pytest.raises(RuntimeError, match="page failed"), pagework.quiet_baselines():
            assert w._holds == 1 and w.quiet
            raise RuntimeError("page failed")
        assert w._holds == 0
        w.ensure()
        assert w.wait(lambda s: s.passes >= 1, WAIT).error is None
    finally:
        worker.forget(worker.key_of(Store(run)))


def heaps_after_threads() -> int:
    """glibc's heaps (arenas) of this process after four threads allocated at once (its
    ``malloc_info`` report, one ``<heap nr=...>`` per arena)."""
    import ctypes
    import threading

    libc = ctypes.CDLL(None)
    barrier = threading.Barrier(4)

    def work() -> None:
        barrier.wait()  # all four allocate at the same time: a busy arena makes glibc look for another
        keep = [bytearray(200_000) for _ in range(200)]
        del keep

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    libc.open_memstream.restype = ctypes.c_void_p
    stream = ctypes.c_void_p(libc.open_memstream(ctypes.byref(buf), ctypes.byref(size)))
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    return ctypes.string_at(buf, size.value).decode().count("<heap nr=")


def test_the_fork_servers_children_allocate_from_one_heap(monkeypatch):
    """rldiag.app.forkinit, preloaded first: the children's threads share one arena (the
    recompute's loader thread and its engine; a second arena kept its own high-water mark)."""
    import sys

    if not sys.platform.startswith("linux") or worker.mp_context().get_start_method() != "forkserver":
        pytest.skip("glibc and the fork server only")
    assert worker.PRELOAD[0] == "rldiag.app.forkinit"
    monkeypatch.setattr(worker, "MODE", "thread")
    assert pagework.in_child(heaps_after_threads) == 1


def test_the_child_runs_in_the_environment_of_the_moment_it_was_asked(tmp_path, monkeypatch):
    """The fork server is started once (here by the first call) and keeps the environment of that
    moment; a child asked later adopts the parent's current one, so that ``RLDIAG_HOME`` (where a
    read-only run's outputs go) is the same in the child as inline. Before, a server started by an
    earlier test put this test's outputs in that test's home."""
    monkeypatch.setattr(worker, "MODE", "thread")
    pagework.in_child(os.getpid)  # the fork server runs, with this environment
    monkeypatch.setenv("RLDIAG_HOME", str(tmp_path / "later-home"))
    monkeypatch.setenv("RLDIAG_TEST_ONLY_VAR", "set after the server started")
    assert pagework.in_child(os.getenv, "RLDIAG_HOME") == str(tmp_path / "later-home")
    assert pagework.in_child(os.getenv, "RLDIAG_TEST_ONLY_VAR") == "set after the server started"
    monkeypatch.delenv("RLDIAG_TEST_ONLY_VAR")
    assert pagework.in_child(os.getenv, "RLDIAG_TEST_ONLY_VAR") is None
