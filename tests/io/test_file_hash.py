"""rldiag.io.file_hash: a local file's SHA-256 in pieces (any thread may advance it), and the early
hashes a recompute starts before it imports the engine: each fetch takes its file's hash from
there only when it is the same file, and nothing is hashed twice or left open."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from contextlib import contextmanager

import pytest

from rldiag import api
from rldiag.executors import steps as steps_mod
from rldiag.io import file_hash
from rldiag.io.file_hash import EarlyHashes, PieceHash, claim_early, early_hashes, files_to_hash, recompute_files
from rldiag.io.rundir import RunDir
from rldiag.synth import SynthSpec, write_synth_run


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_a_local_file_is_hashed_in_pieces(tmp_path, monkeypatch):
    """The hash of an open local file reads it piece by piece (never whole) at its offsets into
    one buffer, and closes the descriptor it was given; the digest and size are the whole file's,
    and the position of the file the loader reads is left where it was."""
    path = tmp_path / "f.bin"
    content = bytes(range(256)) * 1000 + b"tail"
    path.write_bytes(content)
    monkeypatch.setattr(file_hash, "HASH_PIECE", 4096)
    reads = []
    real = os.preadv

    def preadv(fd, buffers, offset):
        reads.append((len(buffers[0]), offset, id(buffers[0])))
        return real(fd, buffers, offset)

    monkeypatch.setattr(file_hash.os, "preadv", preadv)
    with open(path, "rb") as fh:
        fh.seek(17)
        fd = os.dup(fh.fileno())
        info = steps_mod.hashed_file_record({"step": 1}, fd)
        assert fh.tell() == 17
    assert info == {"step": 1, "size": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    assert [o for _, o, _ in reads] == [*range(0, len(content), 4096), len(content)]
    assert {n for n, _, _ in reads} == {4096} and len({b for _, _, b in reads}) == 1  # one buffer
    assert _closed(fd)


def test_a_piece_hash_advanced_by_two_threads_is_the_files_digest(tmp_path, monkeypatch):
    """PieceHash: two threads taking pieces as they come (in order, under its lock) give the file's
    SHA-256 and size, both get the same record, and the descriptor is closed once."""
    path = tmp_path / "f.bin"
    content = bytes(range(251)) * 4000 + b"end"
    path.write_bytes(content)
    monkeypatch.setattr(file_hash, "HASH_PIECE", 1000)
    fd = os.open(path, os.O_RDONLY)
    ph = PieceHash({"step": 3}, fd)
    got = []
    threads = [threading.Thread(target=lambda: got.append(ph.run())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = {"step": 3, "size": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    assert got == [want, want]
    assert ph.run() == want  # done: nothing read again
    assert _closed(fd)


def test_an_early_hash_is_the_files_and_is_claimed_once(tmp_path):
    """Files hashed early give each its own SHA-256 and size to the fetch that opens the same
    file; a second claim of a path gets nothing (the fetch hashes), and a path never hashed early
    gets nothing."""
    paths = []
    for i in range(3):
        p = tmp_path / f"f{i}.bin"
        p.write_bytes(os.urandom(5000 + 997 * i))
        paths.append(p)
    early = EarlyHashes(paths)
    early.join()
    for p in paths:
        with open(p, "rb") as fh:
            ph = early.claim(str(p), fh.fileno())
            assert ph is not None
            assert ph.run() == {"size": p.stat().st_size, "sha256": _digest(p)}
            assert early.claim(str(p), fh.fileno()) is None
    other = tmp_path / "other.bin"
    other.write_bytes(b"x")
    with open(other, "rb") as fh:
        assert early.claim(str(other), fh.fileno()) is None


def test_a_file_replaced_after_its_early_hash_is_not_given_that_hash(tmp_path):
    """A path whose file was replaced (another inode) or rewritten (another size or mtime) since
    the early thread hashed it gets no early hash: the fetch hashes the bytes it parses."""
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"old" * 1000)
    b.write_bytes(b"old" * 1000)
    early = EarlyHashes([a, b])
    early.join()
    new = tmp_path / "new.bin"
    new.write_bytes(b"new" * 1000)
    os.replace(new, a)  # another file at the path
    with open(b, "ab") as fh:
        fh.write(b"more")  # the same file, grown
    for p in (a, b):
        with open(p, "rb") as fh:
            assert early.claim(str(p), fh.fileno()) is None


def test_a_path_claimed_before_the_early_thread_reaches_it_is_not_hashed_early(tmp_path, monkeypatch):
    """The early thread is held on its first file (a FIFO: opening it waits for a writer); a
    fetch claims the second file meanwhile, so the early thread skips it: the file is read by
    the early thread not at all, and every descriptor it opened is closed."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    second = tmp_path / "second.bin"
    second.write_bytes(b"y" * 10_000)
    opened = []
    real_open = os.open

    def spy_open(path, *a, **k):
        fd = real_open(path, *a, **k)
        opened.append((str(path), fd))
        return fd

    monkeypatch.setattr(file_hash.os, "open", spy_open)
    early = EarlyHashes([gate, second])
    with open(second, "rb") as fh:
        assert early.claim(str(second), fh.fileno()) is None  # not reached yet: the fetch hashes it
    writer = real_open(gate, os.O_WRONLY)  # lets the early thread open the FIFO
    os.close(writer)
    early.stop()
    assert [p for p, _ in opened] == [str(gate)]  # the second file was never opened early
    assert all(_closed(fd) for _, fd in opened)


def test_stop_leaves_the_files_not_started(tmp_path, monkeypatch):
    """stop(): the file being hashed is finished, no other is opened, and the thread has ended."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    rest = []
    for i in range(3):
        p = tmp_path / f"r{i}.bin"
        p.write_bytes(b"z" * 100)
        rest.append(p)
    opened = []
    real_open = os.open
    monkeypatch.setattr(file_hash.os, "open", lambda p, *a, **k: opened.append(str(p)) or real_open(p, *a, **k))
    early = EarlyHashes([gate, *rest])
    early._stopped.set()  # stop asked while the thread waits on its first file
    os.close(real_open(gate, os.O_WRONLY))
    early.stop()
    assert opened == [str(gate)] and not early._thread.is_alive()


def test_claim_early_finds_the_active_block_and_none_after_it(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"q" * 3000)
    with early_hashes([p]) as early:
        assert early is not None
        early.join()
        with open(p, "rb") as fh:
            ph = claim_early(str(p), fh.fileno())
        assert ph is not None and ph.run()["sha256"] == _digest(p)
    with open(p, "rb") as fh:
        assert claim_early(str(p), fh.fileno()) is None
    with early_hashes([]) as nothing:
        assert nothing is None


@pytest.fixture
def run(tmp_path):
    return write_synth_run(tmp_path / "run", SynthSpec(seed=9, steps=4, prompts=2, n=4, min_len=8, max_len=16))


def test_the_files_a_recompute_hashes(run):
    """Every chosen step's file without reuse; with reuse, only those no scenario's record matches
    in size and mtime; none for a run that cannot be listed or a bad --steps (the recompute says why)."""
    files = {sf.step: sf.path for sf in RunDir(run).step_files()}
    assert recompute_files(run, None, reuse=False) == [files[s] for s in sorted(files)]
    assert recompute_files(run, "2:3", reuse=False) == [files[2], files[3]]
    assert recompute_files(run, None, reuse=True) == [files[s] for s in sorted(files)]  # no scenario yet
    api.recompute(run, name="a", device="cpu")
    assert recompute_files(run, None, reuse=True) == []  # every file has its record
    os.utime(files[3], ns=(files[3].stat().st_atime_ns, files[3].stat().st_mtime_ns + 10**9))
    assert recompute_files(run, None, reuse=True) == [files[3]]
    assert recompute_files(run, None, reuse=False) == [files[s] for s in sorted(files)]
    assert recompute_files(run.parent / "missing", None, reuse=False) == []
    assert recompute_files(run, "99", reuse=False) == []
    rel = [(str(files[s].relative_to(run)), files[s]) for s in sorted(files)]
    assert files_to_hash(run, rel, reuse=True) == [files[3]]


def test_a_recompute_takes_its_hashes_from_the_early_thread(run, monkeypatch):
    """api.recompute hashes the files early, each fetch claims its file's hash there, and the
    scenario's input records are the files' SHA-256, as a recompute without early hashes writes."""
    claimed = []
    real = steps_mod.claim_early

    def spy(path, fd):
        ph = real(path, fd)
        claimed.append(ph is not None)
        return ph

    real_block = file_hash.early_hashes

    @contextmanager
    def finished_first(paths):  # every file hashed before the first fetch: each claim finds its hash
        with real_block(paths) as early:
            if early is not None:
                early.join()
            yield early

    monkeypatch.setattr(steps_mod, "claim_early", spy)
    monkeypatch.setattr(file_hash, "early_hashes", finished_first)
    api.recompute(run, name="early", device="cpu", reuse=False)
    files = {sf.step: sf.path for sf in RunDir(run).step_files()}
    meta = json.loads((run / "rldiag" / "scenarios" / "early" / "scenario.json").read_text())
    assert {int(r["step"]): r["sha256"] for r in meta["inputs"]} == {s: _digest(p) for s, p in files.items()}
    assert claimed == [True] * len(files)
    from rldiag.scenario.recompute import recompute

    recompute(run, name="late", device="cpu", reuse=False)  # no early hashes: the fetch's own
    late = json.loads((run / "rldiag" / "scenarios" / "late" / "scenario.json").read_text())
    assert [(r["step"], r["size"], r["sha256"]) for r in late["inputs"]] == [
        (r["step"], r["size"], r["sha256"]) for r in meta["inputs"]]
