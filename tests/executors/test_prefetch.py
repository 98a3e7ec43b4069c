"""The loader's read-ahead (Prefetched) and the local executor's use of every core at the end."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rldiag.executors import allocator
from rldiag.executors import steps as steps_mod
from rldiag.executors.steps import Prefetched
from rldiag.scenario.recompute import recompute


def test_yields_in_order_and_reads_at_most_depth_ahead():
    started: list[int] = []
    lock = threading.Lock()

    def fn(task):
        with lock:
            started.append(task)
        return task * 10

    p = Prefetched(range(6), fn, depth=2)
    out = []
    for item in p:
        time.sleep(0.02)  # the loader has time to run ahead, if it could
        with lock:
            assert len(started) <= len(out) + 3  # this one, and at most depth more
        out.append(item)
    assert out == [0, 10, 20, 30, 40, 50]


def test_a_held_result_reads_nothing_ahead_until_the_consumer_asks_again():
    """``hold``: while the consumer has a held result (a step too large to decode beside its
    computation), no task is started; the others are read ahead as before. Deterministic: the
    consumer waits for the loader to have started the next task where it may."""
    started: list[int] = []
    cond = threading.Condition()

    def fn(task):
        with cond:
            started.append(task)
            cond.notify_all()
        return task

    p = Prefetched(range(5), fn, depth=1, hold=lambda r: r in (1, 2))
    seen = []
    for item in p:
        with cond:
            if item in (1, 2):
                assert not cond.wait_for(lambda n=item + 1: len(started) > n, timeout=0.2)  # nothing ahead
                assert started == list(range(item + 1))
            elif item < 4:
                assert cond.wait_for(lambda n=item + 1: len(started) > n, timeout=10)  # the next one read ahead
        seen.append(item)
    assert seen == [0, 1, 2, 3, 4] and started == [0, 1, 2, 3, 4]


def test_a_large_step_is_held():
    """The local executor holds a step of READ_AHEAD_MAX_TOKENS or more (and never a failed one)."""
    from types import SimpleNamespace

    from rldiag.executors.steps import READ_AHEAD_MAX_TOKENS, large_step

    def fetched(tokens):
        return SimpleNamespace(data=None if tokens is None else SimpleNamespace(n_tokens=tokens))

    assert large_step(fetched(READ_AHEAD_MAX_TOKENS)) and large_step(fetched(3_000_000))
    assert not large_step(fetched(READ_AHEAD_MAX_TOKENS - 1)) and not large_step(fetched(None))
    assert READ_AHEAD_MAX_TOKENS > 512 * 1024  # the uniform bench's steps keep their read-ahead


def test_idle_only_when_every_task_is_read():
    gate = threading.Event()

    def fn(task):
        if task == 2:
            gate.wait()
        return task

    p = Prefetched([0, 1, 2], fn, depth=3)
    idle_at = {}
    for item in p:
        idle_at[item] = p.idle
        if item == 0:
            gate.set()  # task 2 was blocked until now: not idle when 0 came out
    assert idle_at[0] is False
    assert idle_at[2] is True  # the last one out: every task submitted and finished


def test_error_of_a_task_surfaces_and_the_thread_stops():
    def fn(task):
        if task == 1:
            raise ValueError("bad step")
        return task

    p = Prefetched(range(5), fn, depth=2)
    with pytest.raises(ValueError, match="bad step"):
        list(p)
    assert p.idle
    assert not any(t.name.startswith("rldiag-load") and t.is_alive() for t in threading.enumerate())


def test_abandoned_iteration_stops_the_thread():
    p = Prefetched(range(100), lambda t: t, depth=2)
    it = iter(p)
    next(it)
    it.close()
    assert not any(t.name.startswith("rldiag-load") and t.is_alive() for t in threading.enumerate())


def _threads_per_pack(synth_run, monkeypatch, spare: float, hold) -> list[int]:
    """torch's thread count as each pack of a recompute of ``synth_run`` (one step a pack) starts,
    on a machine of 3 usable cores with ``spare`` idle; ``hold(fetched)``: the local executor's
    read-ahead rule. Deterministic: the loader's read of each step after the first waits until the
    pack before it has started, so the loader is busy exactly where a step is read ahead."""
    import rldiag.executors.local as local_mod

    seen: list[int] = []
    started = {}
    real = steps_mod.recompute_batch
    real_fetch = local_mod.fetch

    def spy(batch, settings, kl_state, **how):
        seen.append(torch.get_num_threads())
        started[batch.steps[0]].set()  # the next step may be read now
        return real(batch, settings, kl_state, **how)

    def gated_fetch(task, job, **kw):
        before = [s for s in started if s < task.step]
        if before:
            started[max(before)].wait(timeout=30)
        return real_fetch(task, job, **kw)

    monkeypatch.setattr(steps_mod, "recompute_batch", spy)
    monkeypatch.setattr(local_mod, "fetch", gated_fetch)
    monkeypatch.setattr(local_mod, "large_step", hold)
    monkeypatch.setattr(allocator, "usable_cores", lambda: 3)
    monkeypatch.setattr(allocator, "idle_cores", lambda: spare)
    monkeypatch.setattr(allocator, "SpareCores", lambda fewer: (lambda: spare))  # what the others leave
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        from rldiag.io.rundir import RunDir

        started.update({sf.step: threading.Event() for sf in RunDir(synth_run).require_steps()})
        rep = recompute(synth_run, name="t", pack_tokens=1, reuse=False)  # one step per pack
        assert rep.ok and len(seen) == 5
        assert torch.get_num_threads() == 3  # the caller's count back
    finally:
        torch.set_num_threads(before)
    return seen


@pytest.mark.parametrize("spare, last", [(1.0, 3), (0.2, 2)])
def test_local_executor_widens_for_the_last_packs_only_with_a_core_to_spare(synth_run, monkeypatch, spare, last):
    """While steps remain to be read the engine has one core fewer; once the loader is done it
    gets them all where the machine has a core to spare, and keeps one fewer where it is busy."""
    seen = _threads_per_pack(synth_run, monkeypatch, spare, hold=lambda f: False)
    assert seen == [2, 2, 2, 2, last]  # the loader busy with the next step but for the last pack


@pytest.mark.parametrize("spare, counts", [(1.0, [3, 3, 3, 3, 3]), (0.2, [2, 2, 2, 2, 2])])
def test_a_held_step_is_computed_on_every_core_with_one_to_spare(synth_run, monkeypatch, spare, counts):
    """A step held (too large to read the next one beside it) is computed while the loader reads
    nothing: every core, where the machine has one to spare; the narrower count comes back for a
    pack computed beside a read."""
    assert _threads_per_pack(synth_run, monkeypatch, spare, hold=lambda f: True) == counts
    held = {2, 4}  # steps 2 and 4 held, the others read ahead (the synth run's steps are 1..5)
    seen = _threads_per_pack(synth_run, monkeypatch, spare, hold=lambda f: f.task.step in held)
    wide = counts[0]
    assert seen == [2, wide, 2, wide, wide]  # step 5, the last, has nothing after it
