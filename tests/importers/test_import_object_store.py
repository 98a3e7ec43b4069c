"""``import_wandb`` into a run directory in an object store (``s3://bucket/run``, a moto server):
the same files as a local import, ``rldiag/import/wandb.json`` written last, an update in place
that keeps the steps it does not bring, and an import that fails before its commit leaves the
run in the store as it was."""

from __future__ import annotations

import json
import uuid

import pytest

from rldiag.errors import StorageError
from rldiag.importers import WandbImportError, import_wandb
from rldiag.io.fs import RemotePath, as_path
from rldiag.scenario.recompute import recompute
from tests.s3server import fail_uploads, moto_s3

from . import test_wandb_online as online


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as server:
        yield server


def _objects(s3, uri: str) -> dict[str, bytes]:
    root = as_path(uri)
    assert isinstance(root, RemotePath)
    return {str(p.relative_to(root)): p.read_bytes() for p in root.files()}


def _local(d) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def test_an_online_run_imported_into_the_store(s3, batch_files, tmp_path):
    src, data = batch_files
    uri = f"s3://{s3.bucket}/imports/{uuid.uuid4().hex[:8]}"
    api, _, _ = online.make_api(data)
    rep = import_wandb("me/rl/abc123", uri, api_factory=online.factory_for(api, []))
    assert isinstance(rep.out, RemotePath) and str(rep.out) == uri and rep.batch_steps == [1, 2, 3]
    remote = _objects(s3, uri)
    assert sorted(remote) == ["batches/step_1.parquet", "batches/step_2.parquet", "batches/step_3.parquet",
                              "metrics.jsonl", "rldiag/import/wandb.json", "run.yaml"]
    # the same run directory as a local import (but for when and where the record says)
    api, _, _ = online.make_api(data)
    import_wandb("me/rl/abc123", tmp_path / "run", api_factory=online.factory_for(api, []))
    local = _local(tmp_path / "run")
    assert sorted(local) == sorted(remote)
    for name in remote:
        if name != "rldiag/import/wandb.json":
            assert remote[name] == local[name], name
    record, local_record = (json.loads(x["rldiag/import/wandb.json"]) for x in (remote, local))
    for r in (record, local_record):
        r.pop("imported_at"), r.pop("seconds")
    assert record == local_record
    # the imported run recomputes in the store like the original
    got, want = recompute(uri), recompute(src)
    assert got.steps_done == want.steps_done == [1, 2, 3]
    assert sorted(got.metrics, key=lambda r: r["step"]) == sorted(want.metrics, key=lambda r: r["step"])


def test_a_reimport_updates_the_store_in_place_and_a_failed_one_changes_nothing(s3, batch_files):
    _, data = batch_files
    uri = f"s3://{s3.bucket}/imports/{uuid.uuid4().hex[:8]}"
    root = as_path(uri)
    (root / "batches" / "step_9.parquet").write_bytes(data[1])  # a step the import does not bring
    (root / "batches" / "step_000002.parquet").write_bytes(b"old step 2, named otherwise")
    (root / "batches" / "README").write_bytes(b"kept")
    api, run, (_, v1, _) = online.make_api(data)
    import_wandb("me/rl/abc123", uri, api_factory=online.factory_for(api, []))
    got = _objects(s3, uri)
    assert sorted(k for k in got if k.startswith("batches/")) == [
        "batches/README", "batches/step_1.parquet", "batches/step_2.parquet", "batches/step_3.parquet",
        "batches/step_9.parquet"]  # step 2's other file went: one file a step
    assert got["batches/step_2.parquet"] == data[2] and got["batches/README"] == b"kept"
    before = got
    # a bad digest is found while the import reads: nothing in the store changes
    v1.manifest.entries["step_3.parquet"].digest = online.md5_b64(b"something else")
    run._rows = online.ROWS[:1]
    with pytest.raises(WandbImportError, match="step_3.parquet downloaded with MD5"):
        import_wandb("me/rl/abc123", uri, api_factory=online.factory_for(api, []))
    assert _objects(s3, uri) == before


def test_an_import_interrupted_while_it_uploads_leaves_no_record(s3, batch_files, monkeypatch):
    _, data = batch_files
    uri = f"s3://{s3.bucket}/imports/{uuid.uuid4().hex[:8]}"
    api, _, _ = online.make_api(data)
    import_wandb("me/rl/abc123", uri, api_factory=online.factory_for(api, []))
    fail_uploads(monkeypatch, "metrics.jsonl")
    api, _, _ = online.make_api(data)
    with pytest.raises(StorageError, match="went away"):
        import_wandb("me/rl/abc123", uri, api_factory=online.factory_for(api, []))
    assert "rldiag/import/wandb.json" not in _objects(s3, uri)  # the record says the run is whole, or is absent
