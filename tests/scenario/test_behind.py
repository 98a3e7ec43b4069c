"""rldiag.scenario.behind: a scenario's writes one step behind the engine, on a thread of their own,
in order, at most ``depth`` items pending, errors raised on the caller's thread, nothing written
after an error or a cancel; and a recompute writes the same scenario with it as without."""

from __future__ import annotations

import json
import threading

import pyarrow.parquet as pq
import pytest

from rldiag.errors import OutputError
from rldiag.io.run_layout import ScenarioLayout
from rldiag.scenario.behind import Behind, Inline, behind
from rldiag.synth import SynthSpec, write_synth_run


def test_items_are_done_in_order_on_another_thread():
    done: list[tuple[int, str]] = []
    with behind(lambda i: done.append((i, threading.current_thread().name))) as b:
        for i in range(50):
            b.put(i)
    assert [i for i, _ in done] == list(range(50))
    assert {name for _, name in done} == {"rldiag-write"}


def test_put_waits_while_depth_items_are_pending():
    """depth=1: while the first item is being done there is no room for a second (a put would
    wait); once it is done there is."""
    gate = threading.Event()
    started = threading.Event()

    def fn(i):
        started.set()
        gate.wait()

    b = Behind(fn, depth=1)
    b.put(0)
    started.wait()
    assert not b._room.acquire(blocking=False)  # a second put would wait here
    gate.set()
    b.close()
    assert b._room.acquire(blocking=False)


def test_an_error_is_raised_on_the_callers_thread_and_nothing_after_it_is_done():
    done = []

    def fn(i):
        if i == 1:
            raise OutputError("cannot write step 1")
        done.append(i)

    b = Behind(fn, depth=1)
    b.put(0)
    b.put(1)
    with pytest.raises(OutputError, match="step 1"):
        b.put(2)  # waits for item 1 (depth 1), then raises its error
    with pytest.raises(OutputError, match="step 1"):
        b.close()
    assert done == [0]


def test_a_block_that_raises_cancels_the_items_not_started():
    gate = threading.Event()
    started = threading.Event()
    done = []

    def fn(i):
        started.set()
        gate.wait()
        done.append(i)

    with pytest.raises(KeyboardInterrupt):
        with behind(fn, depth=3) as b:
            b.put(0)
            b.put(1)
            b.put(2)
            started.wait()
            gate.set()
            raise KeyboardInterrupt
    assert done == [0]  # the one being done finished; 1 and 2 dropped


def test_inline_does_each_item_as_it_is_put():
    done = []
    with behind(done.append, threaded=False) as b:
        assert isinstance(b, Inline)
        b.put(1)
        assert done == [1]


def test_depth_below_one_is_refused():
    with pytest.raises(ValueError, match="depth"):
        Behind(lambda i: None, depth=0)


def test_a_recompute_writes_the_same_scenario_with_or_without_its_writes_behind(tmp_path):
    """The per-row files and metrics of a recompute whose writes run behind the engine equal
    those of one with --save-tokens (written on the engine's thread), row for row."""
    from rldiag.scenario.recompute import recompute

    run = write_synth_run(tmp_path / "run", SynthSpec(seed=3, steps=5, prompts=3, n=4, min_len=4, max_len=24))
    a = recompute(run, name="behind", device="cpu")
    b = recompute(run, name="inline", device="cpu", save_tokens=True)
    assert a.steps_done == b.steps_done == [1, 2, 3, 4, 5] and not a.steps_failed
    sa, sb = (run / "rldiag" / "scenarios" / n for n in ("behind", "inline"))
    assert pq.read_table(sa / "metrics.parquet").equals(pq.read_table(sb / "metrics.parquet"))
    for step in a.steps_done:
        rel = ScenarioLayout.rows_rel(step)
        assert pq.read_table(sa / rel).equals(pq.read_table(sb / rel))
    ja, jb = (json.loads((s / "scenario.json").read_text()) for s in (sa, sb))
    assert ja["inputs"] == jb["inputs"] and ja["rows"] == jb["rows"] and ja["tokens"] == jb["tokens"]
