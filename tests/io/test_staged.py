"""The one staged writer (rldiag.io.staged), on local disk and in an object store (moto): nothing
changes before the commit, an abort or an interrupted write leaves the previous content (or,
in a store, no marker: never a mix taken for complete), the marker is written last, ``replace``
drops what is neither written nor kept, an update leaves the other files; and the single-file
writes and line appends the capture uses."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rldiag.errors import OutputError, StorageError
from rldiag.io.fs import RemotePath, as_path
from rldiag.io.staged import LineAppender, json_bytes, open_staged, replace_bytes, replace_file
from tests.s3server import fail_uploads


@pytest.fixture(params=["local", "store"])
def where(request, tmp_path):
    """A fresh directory: local, or a prefix in the moto store."""
    if request.param == "local":
        return tmp_path / "d"
    s3 = request.getfixturevalue("s3")
    return as_path(f"s3://{s3.bucket}/staged/{uuid.uuid4().hex[:8]}")


def files(d: Path | RemotePath) -> dict[str, bytes]:
    """Every file under ``d`` (hidden ones included) and its bytes."""
    if isinstance(d, RemotePath):
        return {str(p.relative_to(d)): p.read_bytes() for p in d.files()}
    if not d.exists():
        return {}
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def leftovers(d: Path | RemotePath) -> list[str]:
    """Hidden temporary entries beside and inside a local ``d``."""
    if isinstance(d, RemotePath):
        return []
    near = list(d.parent.iterdir()) + (list(d.iterdir()) if d.is_dir() else [])
    return sorted(p.name for p in near if p.name.startswith("."))


def write_v1(d) -> None:
    w = open_staged(d, marker="meta.json")
    w.write_bytes("a.txt", b"a1")
    w.write_bytes("sub/b.txt", b"b1")
    w.write_table("t.parquet", pa.table({"x": [1]}))
    w.commit({"v": 1})


def test_replace_commit_abort_keep(where):
    write_v1(where)
    v1 = files(where)
    assert sorted(v1) == ["a.txt", "meta.json", "sub/b.txt", "t.parquet"]
    meta = json.loads(v1["meta.json"])
    assert meta["v"] == 1
    if isinstance(where, RemotePath):  # the marker lists every object with its size and SHA-256
        assert sorted(meta["outputs"]) == ["a.txt", "sub/b.txt", "t.parquet"]
        assert meta["outputs"]["a.txt"]["size"] == 2
    # staged: nothing changes before the commit; an abort leaves the previous content
    w = open_staged(where, marker="meta.json")
    w.write_bytes("a.txt", b"a2")
    w.write_bytes("c.txt", b"c2")
    assert files(where) == v1
    w.abort()
    assert files(where) == v1 and leftovers(where) == []
    # replace: what is written plus what is kept; the rest goes
    with open_staged(where, marker="meta.json") as w:
        w.write_bytes("a.txt", b"a2")
        w.keep("sub/b.txt")
        w.commit({"v": 2})
    v2 = files(where)
    assert sorted(v2) == ["a.txt", "meta.json", "sub/b.txt"] and v2["a.txt"] == b"a2" and v2["sub/b.txt"] == b"b1"
    meta = json.loads(v2["meta.json"])
    assert meta["v"] == 2
    if isinstance(where, RemotePath):
        assert meta["outputs"]["sub/b.txt"] == json.loads(v1["meta.json"])["outputs"]["sub/b.txt"]
    assert leftovers(where) == []


def test_an_exception_inside_the_block_leaves_the_previous_content(where):
    write_v1(where)
    v1 = files(where)
    with pytest.raises(RuntimeError, match="interrupted"):
        with open_staged(where, marker="meta.json") as w:
            w.write_bytes("a.txt", b"half")
            raise RuntimeError("interrupted")
    assert files(where) == v1 and leftovers(where) == []
    with pytest.raises(OutputError, match="closed"):
        w.write_bytes("a.txt", b"after")


def test_a_store_commit_interrupted_leaves_no_marker(s3, monkeypatch):
    d = as_path(f"s3://{s3.bucket}/staged/{uuid.uuid4().hex[:8]}")
    write_v1(d)
    w = open_staged(d, marker="meta.json")
    w.write_bytes("a.txt", b"a2")
    w.write_bytes("z.txt", b"z2")
    fail_uploads(monkeypatch, "z.txt")
    with pytest.raises(StorageError, match="went away"):
        w.commit({"v": 2})
    w.abort()
    got = files(d)
    assert "meta.json" not in got and got["a.txt"] == b"a2"  # a mix, but never marked complete
    monkeypatch.undo()
    with open_staged(d, marker="meta.json") as w:
        w.write_bytes("a.txt", b"a3")
        w.commit({"v": 3})
    assert sorted(files(d)) == ["a.txt", "meta.json"]  # the next commit removes what it does not list


def test_update_keeps_the_other_files_and_replaces_a_subdir(where):
    write_v1(where)
    with open_staged(where, replace=False, marker="rec/done.json", durable=True) as w:
        w.write_bytes("a.txt", b"a2")
        sub = w.subdir("sub")
        sub.write_bytes("n.txt", b"n")
        w.commit({"ok": True})
    got = files(where)
    assert got["a.txt"] == b"a2" and got["t.parquet"] and got["meta.json"]  # the others stay
    assert "sub/b.txt" not in got and got["sub/n.txt"] == b"n"  # the subdir replaced whole
    assert json.loads(got["rec/done.json"]) == {"ok": True}
    assert leftovers(where) == []
    # an aborted update changes nothing
    before = files(where)
    w = open_staged(where, replace=False, marker="rec/done.json")
    w.write_bytes("a.txt", b"a3")
    w.subdir("sub").write_bytes("m.txt", b"m")
    w.abort()
    assert files(where) == before and leftovers(where) == []


def test_an_aborted_update_removes_the_directory_it_made(tmp_path):
    d = tmp_path / "new"
    w = open_staged(d, replace=False, marker="m.json")
    w.write_bytes("x", b"1")
    assert d.is_dir()
    w.abort()
    assert not d.exists()


def test_move_and_sources(where, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"payload")
    moved = tmp_path / "moved.bin"
    moved.write_bytes(b"moved")
    with open_staged(where, marker="m.json") as w:
        w.add_file("copied.bin", src)
        w.add_file("moved.bin", moved, move=True)
        tree = tmp_path / "tree"
        (tree / "in").mkdir(parents=True)
        (tree / "in" / "f").write_bytes(b"f")
        w.add_tree("t", tree)
        w.add_file("gone.bin", src)
        w.discard("gone.bin")
        w.commit({})
    assert files(where) == {"copied.bin": b"payload", "moved.bin": b"moved", "t/in/f": b"f",
                            "m.json": files(where)["m.json"]}
    assert src.exists() and not moved.exists()


def test_names_stay_inside_the_directory(tmp_path):
    with open_staged(tmp_path / "d") as w:
        for bad in ("../x", "/abs", "a/../../b", ""):
            with pytest.raises(ValueError, match="relative"):
                w.write_bytes(bad, b"")


def test_the_marker_is_standard_json():
    assert json.loads(json_bytes({"a": float("nan"), "b": [float("inf")]})) == {"a": None, "b": [None]}


# -- single files and appends ---------------------------------------------------------------------


def test_replace_file_and_bytes(where):
    target = where / "f.parquet"
    replace_file(target, lambda tmp: pq.write_table(pa.table({"x": [1, 2]}), tmp), durable=True)
    replace_bytes(where / "run.yaml", b"a: 1\n")
    got = files(where)
    assert got["run.yaml"] == b"a: 1\n" and sorted(got) == ["f.parquet", "run.yaml"]

    def fails(tmp):
        tmp.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        replace_file(target, fails)
    assert files(where) == got and leftovers(where) == []  # the old file, whole


def test_line_appender(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2, "torn')  # a writer killed mid-line
    a = LineAppender(path)
    a.append('{"step": 3}')
    a.sync()
    a.append('{"step": 4}')
    a.close()
    assert path.read_bytes().split(b"\n") == [b'{"step": 1}', b'{"step": 2, "torn', b'{"step": 3}', b'{"step": 4}', b""]


def test_a_store_cannot_take_appends(s3):
    with pytest.raises(StorageError, match="cannot append"):
        LineAppender(as_path(f"s3://{s3.bucket}/run/metrics.jsonl"))
