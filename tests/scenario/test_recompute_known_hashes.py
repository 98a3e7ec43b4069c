"""A new scenario of a run takes each file's SHA-256 from the run's other scenarios when the
file's size and modification time still match their record, and hashes it otherwise."""

from __future__ import annotations

import hashlib
import json
import os

import pyarrow.parquet as pq
import pytest

from rldiag.executors import steps as steps_mod
from rldiag.scenario.recompute import recompute


def _inputs(run, name) -> dict[str, dict]:
    meta = json.loads((run / "rldiag" / "scenarios" / name / "scenario.json").read_text())
    return {i["file"]: i for i in meta["inputs"]}


@pytest.fixture
def hashed(monkeypatch):
    """The files hashed during the test (by the relative name their record gets)."""
    seen: list[str] = []
    real = steps_mod.hashed_record

    def spy(info, remote, content):
        seen.append(info["file"])
        return real(info, remote, content)

    class SpyPieceHash(steps_mod.PieceHash):  # a local file, hashed in pieces from the open file
        def __init__(self, info, fd):
            seen.append(info["file"])
            super().__init__(info, fd)

    monkeypatch.setattr(steps_mod, "hashed_record", spy)
    monkeypatch.setattr(steps_mod, "PieceHash", SpyPieceHash)
    return seen


def test_second_scenario_hashes_nothing_and_records_the_same_inputs(synth_run, hashed):
    recompute(synth_run, {"algorithm.adv_estimator": "grpo"}, name="a")
    assert len(hashed) == 5
    hashed.clear()
    rep = recompute(synth_run, {"algorithm.adv_estimator": "rloo"}, name="b")
    assert rep.ok and rep.steps_reused == [] and rep.steps_done == [1, 2, 3, 4, 5]
    assert hashed == []
    a, b = _inputs(synth_run, "a"), _inputs(synth_run, "b")
    assert a == b
    for rel, rec in b.items():  # the records are true of the files as they are
        data = (synth_run / rel).read_bytes()
        assert rec["sha256"] == hashlib.sha256(data).hexdigest() and rec["size"] == len(data)


def test_a_file_changed_since_is_hashed_again(synth_run, hashed):
    recompute(synth_run, name="a")
    p = synth_run / "batches" / "step_3.parquet"
    t = pq.read_table(p)
    pq.write_table(t.slice(0, t.num_rows - 1), p)
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a later mtime, whatever the clock
    hashed.clear()
    recompute(synth_run, {"algorithm.adv_estimator": "rloo"}, name="b")
    assert hashed == ["batches/step_3.parquet"]
    rec = _inputs(synth_run, "b")["batches/step_3.parquet"]
    assert rec["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
    assert rec["sha256"] != _inputs(synth_run, "a")["batches/step_3.parquet"]["sha256"]


def test_same_size_and_mtime_is_trusted_like_the_scenario_own_record(synth_run, hashed):
    """The rule is the one a scenario applies to its own previous record: size and mtime."""
    recompute(synth_run, name="a")
    meta_path = synth_run / "rldiag" / "scenarios" / "a" / "scenario.json"
    meta = json.loads(meta_path.read_text())
    meta["inputs"][0]["sha256"] = "0" * 64  # a record that no longer matches the bytes
    meta_path.write_text(json.dumps(meta))
    hashed.clear()
    recompute(synth_run, name="b")
    assert hashed == []
    assert _inputs(synth_run, "b")[meta["inputs"][0]["file"]]["sha256"] == "0" * 64


def test_no_reuse_hashes_every_file(synth_run, hashed):
    recompute(synth_run, name="a")
    hashed.clear()
    recompute(synth_run, name="b", reuse=False)
    assert sorted(hashed) == sorted(_inputs(synth_run, "a"))


def test_unreadable_or_partial_records_of_other_scenarios_are_ignored(synth_run, hashed):
    recompute(synth_run, name="a")
    recompute(synth_run, name="c")
    (synth_run / "rldiag" / "scenarios" / "a" / "scenario.json").write_text("{not json")
    meta_path = synth_run / "rldiag" / "scenarios" / "c" / "scenario.json"
    meta = json.loads(meta_path.read_text())
    for rec in meta["inputs"]:
        del rec["mtime_ns"]  # without its mtime a record cannot be checked: not used
    meta_path.write_text(json.dumps(meta))
    hashed.clear()
    rep = recompute(synth_run, name="b")
    assert rep.ok and len(hashed) == 5
