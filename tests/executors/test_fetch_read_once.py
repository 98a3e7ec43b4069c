"""A step's batch file is read at most once per recompute: its SHA-256 is taken from the bytes the
loader parses (a local file: from the one open file the loader parses, in pieces), and not at all
when its size and mtime match the previous scenario's record."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import threading

import pytest

from rldiag.config.settings import resolve_settings
from rldiag.executors import steps as steps_mod
from rldiag.io import file_hash
from rldiag.executors.steps import Job, StepTask, fetch, hashed_record, known_hash
from rldiag.io.rundir import RunDir
from rldiag.scenario.recompute import recompute
from rldiag.synth import SynthSpec, write_synth_run

SPEC = dict(steps=3, prompts=2, n=4, min_len=8, max_len=16)


@pytest.fixture
def run(tmp_path):
    return write_synth_run(tmp_path / "run", SynthSpec(seed=5, **SPEC))


def _scenario(run, name="x") -> dict:
    return json.loads((run / "rldiag" / "scenarios" / name / "scenario.json").read_text())


def _inputs(run, name="x") -> dict[int, dict]:
    return {int(i["step"]): i for i in _scenario(run, name)["inputs"]}


def _batch_files(run) -> dict[int, pathlib.Path]:
    return {sf.step: sf.path for sf in RunDir(run).step_files()}


class _Spy:
    """Records reads of batch files (Path.read_bytes, or the one open of a local file the fetcher
    hashes and parses), loads (load_step) and hashes (sha256) made by the step fetcher, from any
    thread."""

    def __init__(self, monkeypatch, run):
        self.lock = threading.Lock()
        self.reads: list[pathlib.Path] = []
        self.loads: list[tuple[int, bool]] = []
        self.hashes = 0
        batches = (run / "batches").resolve()
        real_read = pathlib.Path.read_bytes
        real_open = steps_mod.open_step_file
        real_load = steps_mod.load_step
        real_sha = hashlib.sha256

        def read_bytes(path):
            if pathlib.Path(path).resolve().parent == batches:
                with self.lock:
                    self.reads.append(pathlib.Path(path))
            return real_read(path)

        def open_step_file(sf):  # a local file is opened once: hashed and parsed from that open file
            with self.lock:
                self.reads.append(pathlib.Path(sf.path))
            return real_open(sf)

        def load_step(sf, settings, columns, source=None, threads=True):
            with self.lock:
                self.loads.append((sf.step, source is not None))
            return real_load(sf, settings, columns, source, threads)

        spy = self

        class _Hashlib:
            @staticmethod
            def sha256(*a, **k):
                with spy.lock:
                    spy.hashes += 1
                return real_sha(*a, **k)

        monkeypatch.setattr(pathlib.Path, "read_bytes", read_bytes)
        monkeypatch.setattr(steps_mod, "load_step", load_step)
        monkeypatch.setattr(steps_mod, "open_step_file", open_step_file)
        monkeypatch.setattr(steps_mod, "hashlib", _Hashlib)
        monkeypatch.setattr(file_hash, "hashlib", _Hashlib)  # a local file's pieces (PieceHash)

    def read_names(self) -> list[str]:
        return sorted(p.name for p in self.reads)


def test_first_recompute_records_sha256_and_size_of_each_file(run, monkeypatch):
    spy = _Spy(monkeypatch, run)
    rep = recompute(run, name="x", device="cpu")
    assert rep.ok and rep.steps_done == [1, 2, 3] and rep.steps_reused == []
    reads, loads, hashes = spy.read_names(), sorted(spy.loads), spy.hashes
    files = _batch_files(run)
    inputs = _inputs(run)
    assert sorted(inputs) == [1, 2, 3]
    for step, path in files.items():
        data = path.read_bytes()
        rec = inputs[step]
        assert rec["sha256"] == hashlib.sha256(data).hexdigest()
        assert rec["size"] == len(data) == path.stat().st_size
        assert rec["mtime_ns"] == path.stat().st_mtime_ns
        assert rec["file"] == str(path.relative_to(run))
    # each file opened once, and parsed from that open file (not opened a second time by the loader)
    assert reads == sorted(p.name for p in files.values())
    assert loads == [(1, True), (2, True), (3, True)]
    assert hashes == 3


def test_untouched_files_keep_their_hash_without_reading(run, monkeypatch):
    recompute(run, name="x", device="cpu")
    first = _inputs(run)
    spy = _Spy(monkeypatch, run)
    rep = recompute(run, name="x", device="cpu")
    assert rep.steps_reused == [1, 2, 3] and rep.tokens == 0
    assert spy.reads == [] and spy.loads == [] and spy.hashes == 0
    again = _inputs(run)
    for step in (1, 2, 3):
        assert again[step]["sha256"] == first[step]["sha256"]
        assert again[step]["size"] == first[step]["size"]
        assert again[step]["mtime_ns"] == first[step]["mtime_ns"]


def test_rewritten_file_is_rehashed_and_recomputed(run, tmp_path, monkeypatch):
    recompute(run, name="x", device="cpu")
    first = _inputs(run)
    other = write_synth_run(tmp_path / "other", SynthSpec(seed=11, **SPEC))
    target = _batch_files(run)[2]
    st0 = target.stat()
    shutil.copyfile(_batch_files(other)[2], target)
    os.utime(target, ns=(st0.st_atime_ns, st0.st_mtime_ns + 2_000_000_000))
    new_bytes = target.read_bytes()
    assert hashlib.sha256(new_bytes).hexdigest() != first[2]["sha256"]

    spy = _Spy(monkeypatch, run)
    rep = recompute(run, name="x", device="cpu")
    assert rep.ok
    assert rep.steps_reused == [1, 3]
    assert sorted(rep.steps_done) == [1, 2, 3]
    assert spy.read_names() == [target.name]  # only the changed file is read, once
    assert spy.loads == [(2, True)]  # and parsed from the bytes that were hashed
    assert spy.hashes == 1
    inputs = _inputs(run)
    assert inputs[2]["sha256"] == hashlib.sha256(new_bytes).hexdigest()
    assert inputs[2]["size"] == len(new_bytes)
    assert inputs[2]["mtime_ns"] == target.stat().st_mtime_ns
    for step in (1, 3):
        assert inputs[step]["sha256"] == first[step]["sha256"]
    # the recomputed step's metrics are those of the new file: same as a fresh recompute
    fresh = {r["step"]: r for r in recompute(run, name="fresh", device="cpu", reuse=False).metrics}
    got = {r["step"]: r for r in rep.metrics}
    for k, v in fresh[2].items():
        assert got[2][k] == pytest.approx(v, nan_ok=True), k


def test_touched_but_identical_file_is_rehashed_and_reused(run, monkeypatch):
    recompute(run, name="x", device="cpu")
    first = _inputs(run)
    target = _batch_files(run)[3]
    st0 = target.stat()
    os.utime(target, ns=(st0.st_atime_ns, st0.st_mtime_ns + 3_000_000_000))
    spy = _Spy(monkeypatch, run)
    rep = recompute(run, name="x", device="cpu")
    assert rep.steps_reused == [1, 2, 3]
    assert spy.read_names() == [target.name]  # hashed again (mtime moved) ...
    assert spy.loads == []  # ... but not parsed: the hash is unchanged
    inputs = _inputs(run)
    assert inputs[3]["sha256"] == first[3]["sha256"]
    assert inputs[3]["mtime_ns"] == target.stat().st_mtime_ns != first[3]["mtime_ns"]


def test_no_reuse_rehashes_every_file(run, monkeypatch):
    recompute(run, name="x", device="cpu")
    first = _inputs(run)
    spy = _Spy(monkeypatch, run)
    rep = recompute(run, name="x", device="cpu", reuse=False)
    assert rep.steps_reused == []
    assert len(spy.reads) == 3 and sorted(spy.loads) == [(1, True), (2, True), (3, True)]
    assert {s: i["sha256"] for s, i in _inputs(run).items()} == {s: i["sha256"] for s, i in first.items()}


# ---- fetch itself --------------------------------------------------------------------------


def _task(run, step: int, previous=None, reusable=False) -> StepTask:
    path = _batch_files(run)[step]
    return StepTask(step=step, file=str(path), rel=str(path.relative_to(run)), chunk=0,
                    previous=previous, reusable=reusable)


def _job(run) -> Job:
    return Job(settings=resolve_settings(run, {}), device="cpu", save_tokens=False)


def test_fetch_without_hash_returns_empty_info_and_data(run, monkeypatch):
    spy = _Spy(monkeypatch, run)
    f = fetch(_task(run, 1), _job(run), hash_file=False)
    assert f.record() == {}
    assert f.error is None and f.data is not None
    assert f.data.step == 1 and f.data.n_rows == SPEC["prompts"] * SPEC["n"]
    assert spy.reads == [] and spy.hashes == 0
    assert spy.loads == [(1, False)]
    # the same data as a hashed fetch
    g = fetch(_task(run, 1), _job(run))
    assert g.data.n_tokens == f.data.n_tokens
    assert g.data.batch.response_mask.equal(f.data.batch.response_mask)


def test_fetch_hashes_the_bytes_it_loads(run):
    path = _batch_files(run)[2]
    data = path.read_bytes()
    f = fetch(_task(run, 2), _job(run))
    assert f.data is not None and f.error is None
    assert f.record()["sha256"] == hashlib.sha256(data).hexdigest()
    assert f.record()["size"] == len(data)
    assert f.record()["step"] == 2 and f.record()["file"] == str(path.relative_to(run))
    assert "hashed_ns" not in f.record()  # local files: mtime is precise enough


def test_fetch_reusable_with_matching_record_skips_load(run, monkeypatch):
    job = _job(run)
    rec = fetch(_task(run, 1), job).record()
    spy = _Spy(monkeypatch, run)
    f = fetch(_task(run, 1, previous=dict(rec), reusable=True), job)
    assert f.data is None and f.error is None
    assert f.outcome().status == "reused"
    assert f.record()["sha256"] == rec["sha256"]
    assert spy.reads == [] and spy.loads == [] and spy.hashes == 0


def test_fetch_not_reusable_loads_even_with_a_known_hash(run, monkeypatch):
    job = _job(run)
    rec = fetch(_task(run, 1), job).record()
    spy = _Spy(monkeypatch, run)
    f = fetch(_task(run, 1, previous=dict(rec), reusable=False), job)
    assert f.data is not None
    assert f.record()["sha256"] == rec["sha256"]
    assert spy.reads == [] and spy.hashes == 0  # hash kept from the record
    assert spy.loads == [(1, False)]  # the loader reads the file itself


def test_fetch_stale_record_same_stat_different_hash_is_loaded(run):
    # a record whose size and mtime match but whose hash is another file's: the hash is trusted
    # (stat decides), so the previous hash is kept; reuse follows that hash
    job = _job(run)
    rec = fetch(_task(run, 1), job).record()
    prev = dict(rec, sha256="0" * 64)
    f = fetch(_task(run, 1, previous=prev, reusable=True), job)
    assert f.record()["sha256"] == "0" * 64
    assert f.data is None  # reused: same stat, same (recorded) hash


def test_fetch_changed_size_record_is_rehashed_and_loaded(run, monkeypatch):
    job = _job(run)
    rec = fetch(_task(run, 2), job).record()
    prev = dict(rec, size=rec["size"] + 1)
    spy = _Spy(monkeypatch, run)
    f = fetch(_task(run, 2, previous=prev, reusable=True), job)
    assert f.data is not None
    assert f.record()["sha256"] == rec["sha256"] and f.record()["size"] == rec["size"]
    assert len(spy.reads) == 1 and spy.loads == [(2, True)] and spy.hashes == 1


def test_fetch_unreadable_file_fails_with_hash(run, tmp_path):
    path = _batch_files(run)[3]
    path.write_bytes(b"not a parquet file")
    f = fetch(_task(run, 3), _job(run))
    assert f.data is None and f.error
    assert f.outcome().status == "failed"
    assert f.record()["sha256"] == hashlib.sha256(b"not a parquet file").hexdigest()
    assert f.record()["size"] == len(b"not a parquet file")


# ---- known_hash / hashed_record -----------------------------------------------------------------


def _info(size=10, mtime=5_000_000_000):
    return {"step": 1, "file": "batches/step_1.parquet", "size": size, "mtime_ns": mtime}


def test_known_hash_local():
    prev = dict(_info(), sha256="ab" * 32)
    info = _info()
    assert known_hash(info, False, prev) is True and info["sha256"] == "ab" * 32
    assert "hashed_ns" not in info
    for bad in (None, {}, dict(prev, size=11), dict(prev, mtime_ns=5_000_000_001), dict(prev, sha256=None),
                {k: v for k, v in prev.items() if k != "sha256"}):
        info = _info()
        assert known_hash(info, False, bad) is False
        assert "sha256" not in info


def test_known_hash_remote_needs_hash_a_second_after_mtime():
    mtime = 5_000_000_000
    for hashed, ok in ((mtime + 1_000_000_000, True), (mtime + 2_000_000_000, True), (mtime + 999_999_999, False),
                       (mtime, False), (None, False)):
        prev = dict(_info(mtime=mtime), sha256="cd" * 32)
        if hashed is not None:
            prev["hashed_ns"] = hashed
        info = _info(mtime=mtime)
        assert known_hash(info, True, prev) is ok, hashed
        if ok:
            assert info["sha256"] == "cd" * 32 and info["hashed_ns"] == hashed
        else:
            assert "sha256" not in info and "hashed_ns" not in info


def test_hashed_records_size_and_digest():
    content = b"hello world" * 7
    info = hashed_record(_info(size=0), False, content)
    assert info["sha256"] == hashlib.sha256(content).hexdigest()
    assert info["size"] == len(content)
    assert "hashed_ns" not in info
    info = hashed_record(_info(size=0), True, content)
    assert info["hashed_ns"] > 0 and info["sha256"] == hashlib.sha256(content).hexdigest()


def _hash_thread_held(monkeypatch):
    """The hash thread gets no core until ``release`` is set (a loaded machine); ``order`` gets
    "hashed" when it has run. Other threads advance a :class:`PieceHash` as usual."""
    release = threading.Event()
    order: list[str] = []
    real = steps_mod.PieceHash.run  # a local file: hashed in pieces from the open file

    def held(self):
        if threading.current_thread().name.startswith("rldiag-hash"):
            release.wait()
            out = real(self)
            order.append("hashed")
            return out
        return real(self)

    monkeypatch.setattr(steps_mod.PieceHash, "run", held)
    return release, order


def test_the_record_is_read_only_through_its_accessor_which_finishes_the_hash(run, monkeypatch):
    """The hash runs on a background thread into an object of its own: a record read at any time,
    from any thread, has the file's hash, and the fetch exposes no dict the thread writes into. A
    reader that finds the hash unfinished (the low-priority hash thread not run yet, as on a loaded
    machine) hashes the rest itself rather than wait for that thread."""
    release, order = _hash_thread_held(monkeypatch)
    path = _batch_files(run)[1]
    f = fetch(_task(run, 1), _job(run))
    assert not hasattr(f, "info")
    got = []
    reader = threading.Thread(target=lambda: (got.append(f.record()), order.append("read")))
    reader.start()
    reader.join()  # done while the hash thread is still held
    assert order == ["read"]
    release.set()
    steps_mod.hash_pool().submit(lambda: None).result()  # the one hash thread: done with the file
    assert order == ["read", "hashed"]
    assert got[0]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    rec = f.record()
    rec["sha256"] = "changed by the caller"
    assert f.record()["sha256"] == got[0]["sha256"]  # each reader gets a copy


def test_a_sweeps_records_finish_the_hash_without_waiting_for_the_hash_thread(run, monkeypatch):
    """A sweep's fetch (one read for every scenario) hashes a local file as a recompute's does:
    every scenario's record, read while the hash thread has no core, has the file's hash, hashed
    on the reader's thread, and the hash thread later finds it done."""
    from rldiag.executors.sweep import fetch_many

    release, order = _hash_thread_held(monkeypatch)
    path = _batch_files(run)[1]
    got = fetch_many([_task(run, 1)] * 2, [_job(run)] * 2)
    records = [f.record() for f in got]  # on this thread, the hash thread still held
    assert order == []
    release.set()
    steps_mod.hash_pool().submit(lambda: None).result()
    assert order == ["hashed"]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert [r["sha256"] for r in records] == [digest, digest] and records[0]["size"] == path.stat().st_size
