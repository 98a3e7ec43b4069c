"""The one writer of what rldiag puts in a run directory, on local disk or in an object store:
new content is staged, then put in place at once, a marker JSON file last.

:func:`open_staged` gives a :class:`StagedWriter` for a directory ``target`` (a local
:class:`~pathlib.Path` or a :class:`~rldiag.io.fs.RemotePath`). Files are named relative to it
(``metrics.parquet``, ``tokens/step_000012.parquet``, ``rldiag/import/wandb.json``: the names of
:mod:`rldiag.io.run_layout`), written into a local staging directory (``write_bytes``,
``write_table``, ``add_file``, or any writer into ``local_path(rel)``), and nothing in ``target``
changes until :meth:`StagedWriter.commit`, which puts them in place and writes the marker (the
``marker`` file, e.g. ``scenario.json``) last. :meth:`StagedWriter.abort` (or leaving the
``with`` block without a commit) drops what was staged: an interrupted write leaves the previous
content as it was.

Two kinds of target:

- ``replace=True`` (a scenario, a comparison, an import's ``batches/``): the new content of the
  directory is exactly what was written, plus what :meth:`~StagedWriter.keep` keeps of the old.
- ``replace=False`` (an import into a run directory): the files written replace theirs, the
  others stay; :meth:`~StagedWriter.subdir` stages a sub-directory replaced whole
  (``batches/``), put in place before the writer's own files.

On local disk the staging directory is a hidden sibling of the target (``replace``) or a hidden
directory inside it (otherwise), so every move is a rename on one filesystem:

- ``replace``: the marker is written into the staging directory, which then takes the target's
  place in one rename (:func:`rldiag.io.atomic.replace_dir`; a reader sees the old directory or
  the new one, never a mix);
- otherwise each staged file is renamed over its own (a reader sees each file old or new), the
  marker last.

With ``durable=True`` each file is fsynced before it is renamed, and the directories after.
Temporary names carry their owner process (:mod:`rldiag.io.atomic`), so the next writer removes
what a killed one left (never what a running one is writing).

In an object store there is no rename: the parts are staged in a local temporary directory;
:meth:`~StagedWriter.commit` deletes the previous marker, uploads every part (one PUT each: an
object appears whole or not at all), then writes the marker; with ``replace``, the marker lists
every object of the directory with its size and SHA-256 (``outputs``, which readers check a part
against), and the previous version's objects it does not list are deleted after it. So a write
interrupted before the commit changes nothing; one interrupted during it leaves no marker, which
readers take for "being written" (never a mix for a complete version). A directory without a
marker (an import's ``batches/``) has no such flag: its new objects go up before the old ones
that they replace under other names go.

Single files and appends, for the capture (which writes one step file at a time while a trainer
runs) and ``run.yaml``: :func:`replace_file` / :func:`replace_bytes` (a temporary sibling renamed
over the file on disk; one PUT in a store) and :class:`LineAppender` (``metrics.jsonl``: each
line whole in one write; local only, as an object store cannot append).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from types import TracebackType

import pyarrow as pa
import pyarrow.parquet as pq

from rldiag.errors import OutputError, StorageError
from rldiag.io.atomic import remove_stale, replace_dir, staging_dir, temp_name, write_bytes_atomic, write_file_atomic
from rldiag.io.fs import RemotePath, as_path
from rldiag.io.outputs import json_safe

AnyPath = Path | RemotePath


def json_bytes(meta: dict) -> bytes:
    """A marker's bytes: standard JSON (NaN and infinities as null), indented."""
    return (json.dumps(json_safe(meta), indent=2, allow_nan=False) + "\n").encode("utf-8")


def _check_rel(rel: str) -> str:
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or any(part in ("", ".", "..") for part in rel.split("/")):
        raise ValueError(f"{rel!r} is not a file name relative to the directory written")
    return str(p)


def fsync_path(path: Path, directory: bool = False) -> None:
    """fsync a file (or, with ``directory``, a directory's entries)."""
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fsync_path(path, directory=True)
    except OSError:  # pragma: no cover - file systems that cannot fsync a directory
        pass


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


class StagedWriter:
    """New content for ``target``, staged in the local directory ``staging`` until
    :meth:`commit`. Made by :func:`open_staged`."""

    target: AnyPath
    staging: Path

    def __init__(self, target: AnyPath, marker: str | None, replace: bool, durable: bool):
        self.target, self.replace, self.durable = target, replace, durable
        self.marker = _check_rel(marker) if marker else None
        self.children: list[StagedWriter] = []
        self.finished = False
        self._scratch: Path | None = None

    # -- staging ---------------------------------------------------------------------------------
    def local_path(self, rel: str) -> Path:
        """The local file to write ``rel``'s new content into (its directory made)."""
        self._open()
        p = self.staging / _check_rel(rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def write_bytes(self, rel: str, data: bytes) -> None:
        p = self.local_path(rel)
        try:
            p.write_bytes(data)
        except OSError as exc:
            raise OutputError(f"cannot write {self.target / rel}: {exc}") from exc

    def write_table(self, rel: str, table: pa.Table, **options) -> None:
        """``table`` as the Parquet file ``rel`` (``options``: :func:`pyarrow.parquet.write_table`'s)."""
        p = self.local_path(rel)
        try:
            pq.write_table(table, p, **options)
        except (pa.ArrowException, OSError) as exc:
            raise OutputError(f"cannot write {self.target / rel}: {exc}") from exc

    def add_file(self, rel: str, src: Path, move: bool = False) -> None:
        """The local file ``src`` as ``rel`` (copied; with ``move``, the file itself)."""
        dst = self.local_path(rel)
        try:
            if move:
                shutil.move(src, dst)
            else:
                shutil.copyfile(src, dst)
        except OSError as exc:
            raise OutputError(f"cannot stage {src} as {self.target / rel}: {exc}") from exc

    def link_file(self, rel: str, src: Path) -> None:
        """The local file ``src`` as ``rel``, hard-linked where the filesystem allows, else copied
        (a file of another directory kept unchanged)."""
        try:
            _link_or_copy(src, self.local_path(rel))
        except OSError as exc:
            raise OutputError(f"cannot stage {src} as {self.target / rel}: {exc}") from exc

    def add_tree(self, rel: str, src: Path) -> None:
        """Every file under the local directory ``src``, as the same names under ``rel``."""
        for f in sorted(Path(src).rglob("*")):
            if f.is_file():
                self.add_file(f"{rel}/{f.relative_to(src).as_posix()}", f)

    def discard(self, rel: str) -> None:
        """Drop what was staged as ``rel`` (the old file, if any, stays or goes as before)."""
        if self._opened():
            (self.staging / _check_rel(rel)).unlink(missing_ok=True)

    def keep(self, rel: str) -> None:
        """With ``replace``: the old file ``rel`` belongs to the new content unchanged. (Otherwise
        every file not written stays anyway.)"""

    def subdir(self, rel: str) -> StagedWriter:
        """A writer that replaces the sub-directory ``rel`` whole (no marker of its own),
        committed with this one, before this one's files."""
        if self.replace:
            raise ValueError("subdir: only a writer with replace=False stages sub-directories")
        child = open_staged(self.target / _check_rel(rel), replace=True, durable=self.durable)
        self.children.append(child)
        return child

    def scratch(self) -> Path:
        """A local directory for temporary files (downloads, say) on the staging directory's
        filesystem, so that :meth:`add_file` with ``move`` is a rename; not part of the content,
        removed at commit or abort."""
        self._open()
        if self._scratch is None:
            self._scratch = self.staging.parent / temp_name("scratch")
            self._scratch.mkdir(parents=True)
        return self._scratch

    def staged(self) -> list[str]:
        """The names staged so far (files under ``staging``), sorted."""
        if not self._opened():
            return []
        return sorted(p.relative_to(self.staging).as_posix() for p in self.staging.rglob("*") if p.is_file())

    # -- the end ---------------------------------------------------------------------------------
    def commit(self, meta: dict | None = None) -> None:
        """Put everything in place, the marker (``meta`` as JSON) last."""
        raise NotImplementedError

    def abort(self) -> None:
        """Drop what was staged (idempotent; nothing after a commit)."""
        if self.finished:
            return
        self._finish()
        for child in self.children:
            child.abort()
        if self._opened():
            shutil.rmtree(self.staging, ignore_errors=True)

    def __enter__(self) -> StagedWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.abort()

    # -- internals -------------------------------------------------------------------------------
    def _open(self) -> None:
        if self.finished:
            raise OutputError(f"the writer of {self.target} is closed (committed or aborted)")

    def _opened(self) -> bool:
        return True

    def _finish(self) -> None:
        self.finished = True
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def _marker_meta(self, meta: dict | None) -> dict:
        if self.marker is None:
            if meta is not None:
                raise ValueError(f"the writer of {self.target} has no marker file to write meta to")
            return {}
        return dict(meta or {})


class DirectoryWriter(StagedWriter):
    """Local, ``replace``: a hidden staging directory beside the target, swapped in by
    :func:`~rldiag.io.atomic.replace_dir`."""

    def __init__(self, target: Path, marker: str | None, dirs: tuple[str, ...], durable: bool):
        super().__init__(target, marker, True, durable)
        self.staging = staging_dir(target)
        for d in dirs:
            (self.staging / _check_rel(d)).mkdir(parents=True, exist_ok=True)

    def keep(self, rel: str) -> None:
        assert isinstance(self.target, Path)
        _link_or_copy(self.target / rel, self.local_path(rel))

    def commit(self, meta: dict | None = None) -> None:
        self._open()
        assert isinstance(self.target, Path)
        meta = self._marker_meta(meta)
        try:
            if self.marker is not None:
                self.local_path(self.marker).write_bytes(json_bytes(meta))
            if self.durable:
                for p in self.staging.rglob("*"):
                    fsync_path(p, directory=p.is_dir())
                _fsync_dir(self.staging)
            replace_dir(self.staging, self.target)
            if self.durable:
                _fsync_dir(self.target.parent)
        except OSError as exc:
            raise OutputError(f"cannot write {self.target}: {exc}") from exc
        self._finish()


class UpdateWriter(StagedWriter):
    """Local, not ``replace``: a hidden staging directory inside the target; each file renamed
    over its own at commit, the marker last. A target this writer made is removed again on an
    abort (when empty)."""

    def __init__(self, target: Path, marker: str | None, durable: bool):
        super().__init__(target, marker, False, durable)
        if target.exists() and not target.is_dir():
            raise OutputError(f"{target} exists and is not a directory")
        self.created = not target.exists()
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot create {target}: {exc}") from exc
        remove_stale(target)  # what a writer killed before its commit left behind
        self.staging = target / temp_name("staged")
        self._made = False

    def _opened(self) -> bool:
        return self._made

    def local_path(self, rel: str) -> Path:
        self._open()
        if not self._made:
            self.staging.mkdir()
            self._made = True
        return super().local_path(rel)

    def commit(self, meta: dict | None = None) -> None:
        self._open()
        assert isinstance(self.target, Path)
        meta = self._marker_meta(meta)
        try:
            for child in self.children:
                child.commit()
            names = self.staged()
            if self.marker is not None:
                if self.marker in names:
                    raise ValueError(f"{self.marker} is the marker: written by commit, not staged")
                self.local_path(self.marker).write_bytes(json_bytes(meta))
                names.append(self.marker)
            dirs: set[Path] = set()
            for rel in names:
                src, dst = self.staging / rel, self.target / rel
                if self.durable:
                    fsync_path(src)
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.replace(src, dst)
                dirs.add(dst.parent)
            if self.durable:
                for d in sorted(dirs):
                    _fsync_dir(d)
        except OSError as exc:
            raise OutputError(f"cannot write {self.target}: {exc}") from exc
        finally:
            if self._made:
                shutil.rmtree(self.staging, ignore_errors=True)
        self._finish()

    def abort(self) -> None:
        if self.finished:
            return
        super().abort()
        if self.created:
            assert isinstance(self.target, Path)
            try:
                self.target.rmdir()  # only when empty
            except OSError:
                pass


class ObjectStoreWriter(StagedWriter):
    """An object store: parts staged in a local temporary directory, uploaded at commit, the
    marker last; with ``replace``, the objects the marker does not list deleted after it."""

    def __init__(self, target: RemotePath, marker: str | None, replace: bool):
        super().__init__(target, marker, replace, durable=False)
        self.remote = target
        self.staging = Path(tempfile.mkdtemp(prefix="rldiag-staged-"))
        self.sources: dict[str, Path] = {}  # rel -> a local file uploaded as it is
        self.kept: dict[str, dict | None] = {}  # rel -> its record in the marker (None: unknown)
        self._previous = self._previous_outputs() if replace and marker else {}

    def _previous_outputs(self) -> dict[str, dict]:
        assert self.marker is not None
        meta_path = self.remote / self.marker
        try:
            meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        except (StorageError, ValueError):
            return {}
        out = meta.get("outputs") if isinstance(meta, dict) else None
        return out if isinstance(out, dict) else {}

    def add_file(self, rel: str, src: Path, move: bool = False) -> None:
        if move:
            super().add_file(rel, src, move=True)
            return
        self._open()
        self.discard(rel)
        self.sources[_check_rel(rel)] = Path(src)  # uploaded from where it is: no local copy

    def discard(self, rel: str) -> None:
        super().discard(rel)
        self.sources.pop(rel, None)
        self.kept.pop(rel, None)

    def keep(self, rel: str) -> None:
        self._open()
        if not self.replace:
            return
        record = self._previous.get(rel)
        if record is None and self.marker is not None:  # not recorded by the previous version: describe it now
            data = (self.remote / rel).read_bytes()
            record = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        self.kept[_check_rel(rel)] = record

    def commit(self, meta: dict | None = None) -> None:
        self._open()
        meta = self._marker_meta(meta)
        if self.marker is not None:  # before the first object changes: the old marker no longer describes them
            (self.remote / self.marker).unlink(missing_ok=True)
        for child in self.children:
            child.commit()
        uploads = {rel: self.staging / rel for rel in self.staged()}
        uploads.update(self.sources)
        if self.marker in uploads:
            raise ValueError(f"{self.marker} is the marker: written by commit, not staged")
        outputs: dict[str, dict] = {}
        for rel in sorted(uploads):
            size, sha = (self.remote / rel).write_from(uploads[rel])
            outputs[rel] = {"size": size, "sha256": sha}
        if self.marker is not None:
            if self.replace:
                listed = {**{k: v for k, v in self.kept.items() if v is not None}, **outputs}
                meta["outputs"] = {k: listed[k] for k in sorted(listed)}
            (self.remote / self.marker).write_bytes(json_bytes(meta))
        if self.replace:
            for obj in self.remote.files():
                rel = str(obj.relative_to(self.remote))
                if rel != self.marker and rel not in outputs and rel not in self.kept:
                    obj.unlink(missing_ok=True)
        shutil.rmtree(self.staging, ignore_errors=True)
        self._finish()


def open_staged(target: str | os.PathLike | RemotePath, *, replace: bool = True, marker: str | None = None,
                dirs: tuple[str, ...] = (), durable: bool = False) -> StagedWriter:
    """The writer of the directory ``target`` (see the module docstring). ``marker``: the file
    (relative to ``target``) written last from :meth:`~StagedWriter.commit`'s ``meta``;
    ``dirs``: sub-directories a local ``replace`` target always has (``tokens/``); ``durable``:
    fsync before each rename (local)."""
    path = as_path(target)
    if isinstance(path, RemotePath):
        return ObjectStoreWriter(path, marker, replace)
    if replace:
        return DirectoryWriter(path, marker, dirs, durable)
    return UpdateWriter(path, marker, durable)


# -- one file, one line ---------------------------------------------------------------------------


def replace_file(path: AnyPath, write: Callable[[Path], None], durable: bool = False) -> None:
    """``write(tmp)`` writes a local file, which then replaces ``path`` whole: on disk a hidden
    sibling renamed over it (with ``durable``, fsynced first and its directory after); in an
    object store one PUT."""
    if isinstance(path, RemotePath):
        with tempfile.TemporaryDirectory(prefix="rldiag-put-") as tmp:
            local = Path(tmp) / path.name
            write(local)
            path.write_from(local)
        return

    def staged(tmp: Path) -> None:
        write(tmp)
        if durable:
            fsync_path(tmp)

    write_file_atomic(path, staged)
    if durable:
        _fsync_dir(path.parent)


def replace_bytes(path: AnyPath, data: bytes) -> None:
    """``data`` as the file ``path``, whole: fsynced and renamed over it on disk, one PUT in a store."""
    if isinstance(path, RemotePath):
        path.write_bytes(data)
    else:
        write_bytes_atomic(path, data)


def end_torn_line(path: Path) -> None:
    """Before appending to ``path``: if its last line has no newline (a writer killed in the
    middle of a line), end that line, so the torn text stays a line of its own (which readers
    skip) instead of merging with the next record. Nothing is deleted: a last line that is a
    whole record missing only its newline stays readable."""
    try:
        with path.open("rb+") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell() == 0:
                return
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                fh.write(b"\n")
                fh.flush()
                os.fsync(fh.fileno())
    except FileNotFoundError:
        return


class LineAppender:
    """Lines appended to a local file (``metrics.jsonl``), each with its newline in one
    ``write`` on an ``O_APPEND`` descriptor, so readers (which skip a last line without its
    newline) see whole lines only. A torn last line left by a killed writer is ended first
    (:func:`end_torn_line`). Local only: an object store cannot append to an object.

    A line is written whole or not at all: when a write fails part-way (a full disk), the file
    is cut back to its length before the line. A file removed or replaced under the appender
    (its directory deleted, or renamed and made again) is opened again at its path, the
    directory made again if needed. ``opener`` and ``write`` are ``os.open`` and ``os.write``
    unless given (the capture writer's I/O seam, :class:`rldiag.capture.diskio.WriterDisk`)."""

    def __init__(self, path: AnyPath, opener: Callable[[Path, int, int], int] | None = None,
                 write: Callable[[int, bytes | memoryview], int] | None = None):
        if isinstance(path, RemotePath):
            raise StorageError(f"{path}: an object store cannot append to a file; write the run directory on "
                               "local (or shared) disk and copy it to the store afterwards")
        self.path = path
        self._open = opener or os.open
        self._write = write or os.write
        self._fd: int | None = None

    def _current(self) -> bool:
        """Whether the open descriptor is still the file at :attr:`path`."""
        assert self._fd is not None
        try:
            here, mine = os.stat(self.path), os.fstat(self._fd)
        except OSError:
            return False
        return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)

    def append(self, line: str) -> None:
        if self._fd is not None and not self._current():
            self.close()  # removed or replaced: append to the file now at the path
        if self._fd is None:
            end_torn_line(self.path)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = self._open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        data = memoryview((line + "\n").encode("utf-8"))
        start = os.fstat(self._fd).st_size
        try:
            while data:
                data = data[self._write(self._fd, data):]
        except BaseException:
            try:  # no part of the line stays behind
                os.ftruncate(self._fd, start)
            except OSError:
                pass
            raise

    def sync(self) -> None:
        """Everything appended so far on disk (fsync)."""
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
