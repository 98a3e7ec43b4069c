"""The capture never harms training: each fault injected through the writer's one I/O seam
(:class:`rldiag.capture.diskio.WriterDisk`: a patched method raising ENOSPC or EACCES, a slow
write), into the toy trainer and the writer. Under each: training runs every step, the fault is
warned once (cause, path, what is skipped), counted in the logged metrics, nothing half-written
stays, and capture resumes by itself once the fault clears."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import threading
import warnings
from pathlib import Path

import pytest
import torch

from rldiag.capture import RunWriter
from rldiag.capture.diskio import WriterDisk
from rldiag.capture.faults import DROPPED_KEY, ERRORS_KEY, CaptureWarning
from rldiag.io.rundir import RunDir
from rldiag.toy.config import PRESETS
from rldiag.toy.trainer import ToyTrainer

#: the tests wait for the writer (deterministic counts); the slow-writer test sets its own bound
PATIENT = {"max_wait_s": 120.0, "wait_share": None}


def _train(run: Path, steps: int = 6, **kw):
    torch.set_num_threads(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        summary = ToyTrainer(PRESETS["grpo-tool"](steps=steps)).run(run, writer_options=kw.pop("options", PATIENT),
                                                                    **kw)
    faults = [str(w.message) for w in seen if issubclass(w.category, CaptureWarning)]
    return summary, faults


def _batch(rows: int = 4, width: int = 5, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    attn = (torch.arange(width)[None, :] < torch.randint(1, width + 1, (rows, 1), generator=g)).long()
    return {"response_mask": attn, "attention_mask": attn, "token_level_scores": torch.rand(rows, width, generator=g),
            "old_log_probs": -torch.rand(rows, width, generator=g), "uid": [f"u{i // 2}" for i in range(rows)]}


def _lines(run: Path) -> dict[int, dict]:
    return {x["step"]: x["data"] for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _steps(run: Path) -> list[int]:
    return [sf.step for sf in RunDir(run).step_files()]


def _no_temporaries(run: Path) -> None:
    left = [p for p in run.rglob("*") if p.name.startswith(".") or p.name.endswith(".tmp")]
    assert left == [], left


def _oserror(code: int, path: object = None) -> OSError:
    return OSError(code, os.strerror(code), str(path) if path is not None else None)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES])
def test_a_failing_batch_write_skips_those_steps_and_resumes(tmp_path, monkeypatch, code):
    real = WriterDisk.write_step

    def failing(self, payload, compression, token_text):
        if payload.step in (2, 3):
            raise _oserror(code, payload.path)
        return real(self, payload, compression, token_text)

    monkeypatch.setattr(WriterDisk, "write_step", failing)
    run = tmp_path / "run"
    summary, faults = _train(run)
    assert len(summary.step_seconds) == 6  # training ran every step
    assert _steps(run) == [1, 4, 5, 6]  # resumed once the disk had room again
    assert len(faults) == 1, faults
    name = errno.errorcode[code]
    assert f"{name}: " in faults[0] and "step_000002.parquet" in faults[0] and "step 2's batch is not written" in faults[0]
    lines = _lines(run)
    assert sorted(lines) == [1, 2, 3, 4, 5, 6]
    assert DROPPED_KEY not in lines[1]  # nothing counted before the first fault
    # step 2's fault is in the log of step 3 (step 2's barrier waited for it); step 3's own too
    # when the writer got to it before that log
    assert (lines[3][DROPPED_KEY], lines[3][ERRORS_KEY]) in ((1, 1), (2, 2))
    assert (lines[6][DROPPED_KEY], lines[6][ERRORS_KEY]) == (2, 2)
    assert summary.capture.dropped_steps == 2 and summary.capture.errors == 2
    _no_temporaries(run)


def test_a_full_disk_on_metrics_jsonl_leaves_no_torn_line(tmp_path, monkeypatch):
    """The metrics line of steps 3 and 4 fails half-way (part of it written, then ENOSPC): the
    file is cut back to whole lines; the lines after are written again."""
    real = WriterDisk.write
    state = {"line": 0}

    def half_then_full(self, fd, data):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) != "metrics.jsonl":
            return real(self, fd, data)
        state["line"] += 1
        if state["line"] in (3, 4):
            real(self, fd, bytes(data[: len(data) // 2]))
            raise _oserror(errno.ENOSPC)
        return real(self, fd, data)

    monkeypatch.setattr(WriterDisk, "write", half_then_full)
    run = tmp_path / "run"
    summary, faults = _train(run)
    assert len(summary.step_seconds) == 6 and _steps(run) == [1, 2, 3, 4, 5, 6]
    text = (run / "metrics.jsonl").read_text()
    assert text.endswith("\n") and all(json.loads(line) for line in text.splitlines())
    lines = _lines(run)
    assert sorted(lines) == [1, 2, 5, 6]
    assert (lines[5][DROPPED_KEY], lines[5][ERRORS_KEY]) == (0, 2)
    assert len(faults) == 1 and "ENOSPC" in faults[0] and "metrics.jsonl" in faults[0]
    assert "step 3's metrics line is not written" in faults[0]


def test_the_run_directory_removed_while_training_is_made_again(tmp_path):
    """Removed after step 2: made again (run.yaml with it) and the later steps captured; removed
    and replaced by another directory: the metrics go to the new directory's file."""
    run = tmp_path / "run"
    moved = tmp_path / "moved"

    def on_step(step, _):
        if step == 2:
            shutil.rmtree(run)
        if step == 4:
            run.rename(moved)
            run.mkdir()

    summary, faults = _train(run, on_step=on_step)
    assert len(summary.step_seconds) == 6 and faults == []  # nothing was lost: nothing to warn
    assert _steps(run) == [5, 6] and _steps(moved) == [3, 4]
    assert (run / "run.yaml").read_text() == (moved / "run.yaml").read_text()  # made again each time
    assert sorted(_lines(moved)) == [3, 4] and sorted(_lines(run)) == [5, 6]
    _no_temporaries(run)


def test_a_writer_slower_than_training_drops_batches_and_never_holds_it_up(tmp_path, monkeypatch):
    """The disk stalls (the writer held on step 1 until the trainer is done): with room for two
    batches, the steps after are dropped (counted) and the trainer waits at most ``max_wait_s``
    per step."""
    release = _stalled_writes(monkeypatch, steps=(1,))
    run = tmp_path / "run"
    summary, faults = _train(run, steps=6, queue_size=2, options={"max_wait_s": 0.05, "wait_share": None},
                             on_step=lambda step, _: release.set() if step == 6 else None)
    assert len(summary.step_seconds) == 6
    # 1 held on the writer thread, 2 and 3 queued, 4-6 dropped (each waited its 0.05 s bound)
    assert _steps(run) == [1, 2, 3] and summary.capture.dropped_steps == 3
    assert any("the writer is behind" in f and "step 4's batch is dropped" in f for f in faults)
    assert sum("batch is dropped" in f for f in faults) == 1  # once
    lines = _lines(run)
    assert [lines[s].get(DROPPED_KEY, 0) for s in range(1, 7)] == [0, 0, 0, 1, 2, 3]  # each in its own step's log
    assert lines[6][ERRORS_KEY] == 0
    _no_temporaries(run)


def _stalled_writes(monkeypatch, steps: tuple[int, ...] | None = None) -> threading.Event:
    """Batch writes (of ``steps``, else all) wait until the returned event is set: a stalled disk."""
    release = threading.Event()
    real = WriterDisk.write_step

    def stalled(self, payload, compression, token_text):
        if steps is None or payload.step in steps:
            release.wait()
        return real(self, payload, compression, token_text)

    monkeypatch.setattr(WriterDisk, "write_step", stalled)
    return release


def test_the_queue_is_bounded_in_bytes(tmp_path, monkeypatch):
    release = _stalled_writes(monkeypatch)
    one = _batch(rows=64, width=32)
    with pytest.warns(CaptureWarning, match="step 2's batch is dropped"):
        run = RunWriter(tmp_path, queue_size=100, max_queue_bytes=1, max_wait_s=0.01)
        run.write_batch(1, one)  # one batch larger than the bound is let in alone
        run.write_batch(2, one)  # waits for 1 (being written): dropped
        run.write_batch(3, one)
    assert run.stats.dropped_steps == 2 and run.dropped(2) and not run.dropped(1)
    release.set()
    run.close()
    assert _steps(tmp_path) == [1]


def test_raise_keeps_raising_for_callers_who_ask(tmp_path, monkeypatch):
    def full(self, payload, compression, token_text):
        raise _oserror(errno.ENOSPC, payload.path)

    monkeypatch.setattr(WriterDisk, "write_step", full)
    from rldiag.errors import CaptureError

    run = RunWriter(tmp_path, on_error="raise")
    run.write_batch(1, _batch())
    with pytest.raises(CaptureError, match="step 1: OSError: .*No space left on device"):
        run.flush()
    run.close()


def test_sigterm_finishes_pending_writes_then_runs_the_trainers_handler(tmp_path, monkeypatch):
    """Delivered on the main thread while steps are queued behind a slow write: the handler lets
    them finish, then calls the handler that was there before; close puts that one back."""
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        go = _stalled_writes(monkeypatch)
        run = RunWriter(tmp_path, handle_sigterm=True, max_wait_s=120.0)
        for step in (1, 2, 3):
            run.write_batch(step, _batch(seed=step))
        go.set()
        os.kill(os.getpid(), signal.SIGTERM)  # handled on this (the main) thread
        assert calls == [signal.SIGTERM] and _steps(tmp_path) == [1, 2, 3]
        run.close()
        assert signal.getsignal(signal.SIGTERM) is not previous  # the test's own handler is back
        assert getattr(signal.getsignal(signal.SIGTERM), "__self__", None) is None
        _no_temporaries(tmp_path)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_is_left_alone_off_the_main_thread(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    made = []
    t = threading.Thread(target=lambda: made.append(RunWriter(tmp_path, handle_sigterm=True)))
    t.start()
    t.join()
    assert signal.getsignal(signal.SIGTERM) == before
    made[0].close()


def test_a_malformed_rules_file_falls_back_to_the_builtin_rules(tmp_path, caplog):
    bad = tmp_path / "rules.yaml"
    bad.write_text("rules: [ {id: x, kind: nonsense")
    run = tmp_path / "run"
    summary, faults = _train(run, steps=3, doctor=True, rules_files=[bad])
    assert len(summary.step_seconds) == 3 and faults == []
    assert any("rules.yaml cannot be used" in r.getMessage() for r in caplog.records)
    assert any(k.startswith("rldiag/health/") for k in _lines(run)[3])  # the built-in rules ran


def test_a_recompute_raising_memoryerror_is_skipped(tmp_path, monkeypatch, caplog):
    from rldiag.capture import health

    def out_of_memory(self, step):
        raise MemoryError("cannot allocate")

    monkeypatch.setattr(health.StepRecompute, "__call__", out_of_memory)
    run = tmp_path / "run"
    summary, faults = _train(run, steps=4, doctor=True)
    assert len(summary.step_seconds) == 4 and _steps(run) == [1, 2, 3, 4] and faults == []
    failed = [r.getMessage() for r in caplog.records if "recompute of step" in r.getMessage()]
    assert len(failed) == 1 and "MemoryError: cannot allocate" in failed[0]


def test_a_recompute_slower_than_a_step_does_not_hold_training(tmp_path, caplog):
    """A recompute that never ends while training runs: each log waits at most ``wait_s``, the
    steps that end meanwhile get no recompute, each warned once."""
    from concurrent.futures import Future

    from rldiag.capture.health import HealthHook
    from rldiag.doctor.live import LiveDoctor
    from rldiag.doctor.rules import load_rules

    rules = [r for r in load_rules() if r.source == "recomputed" or (r.metric or "").startswith("rldiag/")][:1]
    stuck: list[Future] = []

    def submit(fn):
        f: Future = Future()  # never done: the writer thread is busy with it
        stuck.append(f)
        return f

    hook = HealthHook(LiveDoctor({}, rules), rules, submit=submit, recompute=lambda s: {}, wait_s=0.01)
    for step in range(1, 6):
        hook.on_log(step, {"x": 1.0})
        hook.after_step(step)
    assert len(stuck) == 1  # only step 1's recompute was queued: it never finished
    messages = [r.getMessage() for r in caplog.records]
    assert sum("longer than a training step" in m for m in messages) == 1
    assert sum("still running at the end of step" in m for m in messages) == 1
    stuck[0].set_result({"rldiag/x": 1.0})
    hook.on_log(6, {"x": 1.0})  # taken in now, without waiting
    hook.after_step(6)
    assert len(stuck) == 2  # and the next step's recompute is queued again
