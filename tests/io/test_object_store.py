"""Runs in object storage (``s3://bucket/run``) against a local S3 server (moto): batches are
listed, read and hashed there; the scenario is written there with ``scenario.json`` last, stale
objects removed, and read back; ``rldiag check`` and ``--follow`` work; an unreachable endpoint is
a clear error, fast; ``rldiag doctor`` reads the logged metrics there."""

from __future__ import annotations

import hashlib
import json
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rldiag.analysis.check import check_run
from rldiag.cli.main import main
from rldiag.doctor import diagnose
from rldiag.errors import OutputError, RunDirError, StorageError
from rldiag.io.fs import RemotePath, as_path
from rldiag.io.outputs import list_scenarios, read_scenario
from rldiag.io.rundir import RunDir
from rldiag.io.staged import open_staged
from rldiag.scenario.recompute import follow, recompute
from rldiag.synth import SynthSpec, write_synth_run
from tests.s3server import fail_uploads


@pytest.fixture
def run(tmp_path):
    return write_synth_run(tmp_path / "run", SynthSpec(steps=4, seed=3))


@pytest.fixture
def uri(s3, run):
    return s3.upload_dir(run, f"runs/{uuid.uuid4().hex[:8]}")


def _prefix(uri: str) -> str:
    return uri.split("/", 3)[3]


def test_recompute_cli_writes_a_scenario_read_back(s3, run, uri, capsys):
    assert main(["recompute", uri, "--save-tokens", "--no-progress"]) == 0
    assert f"wrote {uri}/rldiag/scenarios/baseline" in capsys.readouterr().out
    meta, table = read_scenario(uri, "baseline")
    local = recompute(run, save_tokens=True)
    local_meta, local_table = read_scenario(run, "baseline")
    assert table.equals(local_table) and table.num_rows == 4
    assert meta["steps_done"] == local.steps_done == [1, 2, 3, 4]
    assert [(i["file"], i["size"], i["sha256"]) for i in meta["inputs"]] == [
        (i["file"], i["size"], i["sha256"]) for i in local_meta["inputs"]]
    assert meta["config_sha256"] == local_meta["config_sha256"]
    scen = f"{_prefix(uri)}/rldiag/scenarios/baseline"
    # every object is listed in scenario.json with its size and SHA-256
    fs = s3.fs()
    for rel, rec in meta["outputs"].items():
        data = fs.open_input_stream(f"{s3.bucket}/{scen}/{rel}").read()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (rec["size"], rec["sha256"])
    assert sorted(meta["outputs"]) == (["metrics.parquet"] + [f"rows/step_{s:06d}.parquet" for s in range(1, 5)]
                                       + [f"tokens/step_{s:06d}.parquet" for s in range(1, 5)])
    for s in range(1, 5):
        remote = pq.read_table(f"{s3.bucket}/{scen}/tokens/step_{s:06d}.parquet", filesystem=fs)
        assert remote.equals(pq.read_table(run / "rldiag" / "scenarios" / "baseline" / "tokens" / f"step_{s:06d}.parquet"))
    assert list_scenarios(uri) == ["baseline"]


def test_check_reads_the_run(run, uri):
    assert main(["check", uri, "--no-progress"]) == 0
    remote, local = check_run(uri), check_run(run)
    assert [(s.step, s.file, s.rows, s.tokens, s.actor_tokens) for s in remote.steps] == [
        (s.step, s.file, s.rows, s.tokens, s.actor_tokens) for s in local.steps]
    assert remote.config_file == "run.yaml" and remote.metrics_lines == local.metrics_lines == 4


def test_reuse_and_stale_objects_are_removed(s3, uri):
    first = recompute(uri, name="s", save_tokens=True)
    assert first.steps_reused == []
    again = recompute(uri, name="s", save_tokens=True, steps="1:2")
    assert again.steps_reused == [1, 2] and again.tokens == 0
    scen = f"{_prefix(uri)}/rldiag/scenarios/s"
    assert s3.keys(scen) == [f"{scen}/{rel}" for rel in
                             ("metrics.parquet", "rows/step_000001.parquet", "rows/step_000002.parquet", "scenario.json",
                              "tokens/step_000001.parquet", "tokens/step_000002.parquet")]
    meta, table = read_scenario(uri, "s")
    assert table["step"].to_pylist() == [1, 2]
    assert {r["step"]: r for r in table.to_pylist()} == {
        r["step"]: {k: r.get(k) for k in table.column_names} for r in first.metrics if r["step"] <= 2}
    assert sorted(meta["outputs"]) == ["metrics.parquet", "rows/step_000001.parquet", "rows/step_000002.parquet",
                                       "tokens/step_000001.parquet", "tokens/step_000002.parquet"]


def test_rewrite_in_the_same_second_with_the_same_size_is_noticed(s3, run, uri):
    p = run / "batches" / "step_2.parquet"
    t = pq.read_table(p)
    plain = {"compression": "none", "use_dictionary": False, "write_statistics": False}
    key = f"{s3.bucket}/{_prefix(uri)}/batches/step_2.parquet"
    pq.write_table(t, key, filesystem=s3.fs(), **plain)
    before = {r["step"]: r for r in recompute(uri, name="r").metrics}
    scores = t["score"].to_numpy().copy()
    scores[0] = 1.0 - scores[0]  # same size, other content
    pq.write_table(t.set_column(t.schema.get_field_index("score"), "score", pa.array(scores, t["score"].type)),
                   key, filesystem=s3.fs(), **plain)
    after = recompute(uri, name="r")
    assert 2 not in after.steps_reused and after.steps_reused == [1, 3, 4]
    assert {r["step"]: r for r in after.metrics}[2]["critic/score/mean"] == pytest.approx(
        before[2]["critic/score/mean"] + (1.0 - 2 * float(t["score"].to_numpy()[0])) / 16)


def test_scenario_json_marks_a_complete_scenario(s3, uri, monkeypatch):
    recompute(uri, name="c")
    target = as_path(uri) / "rldiag" / "scenarios" / "c"
    assert isinstance(target, RemotePath)
    before = read_scenario(uri, "c")
    keys = s3.keys(f"{_prefix(uri)}/rldiag/scenarios/c")
    writer = open_staged(target, marker="scenario.json")
    writer.write_table("metrics.parquet", pa.table({"step": pa.array([1], pa.int64())}))
    # staged locally: nothing in the store changes before the commit, and an abort keeps the old scenario
    assert read_scenario(uri, "c")[1].equals(before[1])
    writer.abort()
    assert s3.keys(f"{_prefix(uri)}/rldiag/scenarios/c") == keys and read_scenario(uri, "c")[0] == before[0]
    # a commit interrupted after its first upload: the old scenario.json went before it, so
    # there is no scenario, never a mixed one
    writer = open_staged(target, marker="scenario.json")
    writer.write_table("metrics.parquet", pa.table({"step": pa.array([1], pa.int64())}))
    writer.write_table("extra.parquet", pa.table({"row": pa.array([0], pa.int64())}))  # uploaded first
    tried = fail_uploads(monkeypatch, "metrics.parquet")
    with pytest.raises(StorageError, match="went away"):
        writer.commit({"name": "c"})
    writer.abort()
    monkeypatch.undo()
    assert tried == ["extra.parquet", "metrics.parquet"]
    with pytest.raises(RunDirError, match="no scenario"):
        read_scenario(uri, "c")
    rep = recompute(uri, name="c")
    assert rep.steps_reused == [] and read_scenario(uri, "c")[1].num_rows == 4
    assert s3.keys(f"{_prefix(uri)}/rldiag/scenarios/c") == keys  # the stray object of the failed commit is gone


def test_a_metrics_object_that_does_not_match_is_detected(s3, uri):
    recompute(uri, name="m")
    key = f"{s3.bucket}/{_prefix(uri)}/rldiag/scenarios/m/metrics.parquet"
    pq.write_table(pa.table({"step": pa.array([7], pa.int64())}), key, filesystem=s3.fs())
    with pytest.raises(OutputError, match="being rewritten"):
        read_scenario(uri, "m")
    assert recompute(uri, name="m").steps_reused == []  # not trusted for reuse either
    assert read_scenario(uri, "m")[1]["step"].to_pylist() == [1, 2, 3, 4]


def test_arrow_ipc_batches(s3, tmp_path):
    run = write_synth_run(tmp_path / "ipc", SynthSpec(steps=2, seed=4))
    t = pq.read_table(run / "batches" / "step_2.parquet")
    (run / "batches" / "step_2.parquet").unlink()
    with pa.OSFile(str(run / "batches" / "step_2.arrow"), "wb") as sink, pa.ipc.new_file(sink, t.schema) as w:
        w.write_table(t)
    uri = s3.upload_dir(run, "runs/ipc")
    assert [sf.format for sf in RunDir(uri).step_files()] == ["parquet", "arrow"]
    remote = {r["step"]: r for r in recompute(uri).metrics}
    local = {r["step"]: r for r in recompute(run).metrics}
    assert remote == local and sorted(remote) == [1, 2]


def test_follow_a_run_in_object_storage(uri):
    rep = follow(uri, name="f", poll_seconds=0.05, idle_timeout=0.2)
    assert rep.steps_done == [1, 2, 3, 4] and rep.rows == 64
    meta, table = read_scenario(uri, "f")
    assert meta["steps_done"] == [1, 2, 3, 4] and table["step"].to_pylist() == [1, 2, 3, 4]


def test_unreachable_endpoint_is_a_storage_error(monkeypatch, capsys):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("RLDIAG_S3_RETRIES", "1")
    with pytest.raises(StorageError, match="s3://nowhere/run"):
        RunDir("s3://nowhere/run")
    assert main(["recompute", "s3://nowhere/run", "--no-progress"]) == 1
    assert "StorageError" in capsys.readouterr().err


def test_uri_paths():
    with pytest.raises(StorageError, match="bucket"):
        as_path("s3://")
    p = as_path("s3://bucket/runs/a/")
    assert isinstance(p, RemotePath) and str(p) == "s3://bucket/runs/a"
    step = p / "batches" / "step_7.parquet"
    assert (step.name, step.suffix, str(step.parent)) == ("step_7.parquet", ".parquet", "s3://bucket/runs/a/batches")
    assert str(step.relative_to(p)) == "batches/step_7.parquet"
    assert as_path("file:///tmp/x").as_posix() == "/tmp/x" and not isinstance(as_path("rel/dir"), RemotePath)
    assert sorted([p / "b", p / "a"]) == [p / "a", p / "b"] and len({p / "a", p / "a"}) == 1


def test_doctor_reads_the_logged_metrics(run, uri):
    remote, local = diagnose(uri, recompute=False), diagnose(run, recompute=False)
    assert remote.logged_steps == local.logged_steps == 4
    assert [(f.rule, f.message) for f in remote.findings] == [(f.rule, f.message) for f in local.findings]
    assert remote.passed == local.passed and remote.not_evaluated == local.not_evaluated


def test_doctor_cli_recomputes_the_run_in_the_store(s3, run, uri, capsys):
    assert main(["doctor", uri, "--json", "--no-progress"]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert main(["doctor", str(run), "--json", "--no-progress"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert (remote.pop("run"), local.pop("run")) == (uri, str(run))
    assert remote == local and remote["recomputed_steps"] == 4 and remote["recompute_error"] is None
    # its recompute is a scenario of the run, written into the store (reused by the next doctor)
    scen = f"{_prefix(uri)}/rldiag/scenarios/baseline"
    assert s3.keys(scen) == ([f"{scen}/metrics.parquet"] + [f"{scen}/rows/step_{s:06d}.parquet" for s in range(1, 5)]
                             + [f"{scen}/scenario.json"])
    assert read_scenario(uri, "baseline")[1]["step"].to_pylist() == [1, 2, 3, 4]
