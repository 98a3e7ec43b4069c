"""Writing one scenario directory (``metrics.parquet``, ``tokens/``, ``scenario.json``), or one
comparison directory (``*.parquet``, ``comparison.json``), so that a reader never takes a
half-written one for a complete one. The directory's JSON file marks it complete.

- Local disk: everything goes into a hidden staging directory beside the target, which then
  replaces the target in one rename (:mod:`rldiag.io.atomic`).
- Object store (``s3://...``): there is no rename. Every object is written with one PUT (an object
  appears whole or not at all) in place; the JSON file of the previous version is deleted
  before the first of them and the new one is written last, listing every object of the directory
  with its size and SHA-256 (``outputs``). So the JSON file marks a complete directory: while
  it is absent the directory is being written (or a write was interrupted). After it, objects of
  the previous version that it does not list (tokens of steps no longer done) are deleted.

Both writers take paths relative to the directory (``metrics.parquet``,
``tokens/step_000012.parquet``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from rldiag.errors import OutputError, StorageError
from rldiag.io.atomic import replace_dir, staging_dir, write_bytes_atomic
from rldiag.io.fs import RemotePath
from rldiag.io.outputs import json_safe, write_parquet

META = "scenario.json"


class ScenarioWriter(Protocol):
    def write_table(self, rel: str, table: pa.Table) -> None:
        """Write ``table`` as the Parquet file ``rel`` of the new scenario."""

    def keep(self, rel: str) -> None:
        """The previous scenario's file ``rel`` belongs to the new one unchanged (a reused step)."""

    def commit(self, meta: dict) -> None:
        """Write the JSON file (``scenario.json``) last and make the new directory the directory."""

    def abort(self) -> None:
        """Give up: drop what was written (the call sites are inside ``except``)."""


def open_writer(target: Path | RemotePath, dirs: tuple[str, ...] = (), meta_name: str = META) -> ScenarioWriter:
    """The writer for ``target``; ``dirs`` are subdirectories a local scenario always has, ``meta_name``
    the name of the JSON file written last (``comparison.json`` for a comparison)."""
    if isinstance(target, RemotePath):
        return ObjectStoreWriter(target, meta_name)
    return DirectoryWriter(target, dirs, meta_name)


def _meta_bytes(meta: dict) -> bytes:
    return json.dumps(json_safe(meta), indent=2).encode()


class DirectoryWriter:
    """A staging directory beside the target, swapped in by :func:`replace_dir`."""

    def __init__(self, target: Path, dirs: tuple[str, ...] = (), meta_name: str = META):
        self.target, self.meta_name = target, meta_name
        self.stage = staging_dir(target)
        for d in dirs:
            (self.stage / d).mkdir(parents=True, exist_ok=True)

    def write_table(self, rel: str, table: pa.Table) -> None:
        write_parquet(table, self.stage / rel)

    def keep(self, rel: str) -> None:
        src, dst = self.target / rel, self.stage / rel
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    def commit(self, meta: dict) -> None:
        write_bytes_atomic(self.stage / self.meta_name, _meta_bytes(meta))
        replace_dir(self.stage, self.target)

    def abort(self) -> None:
        shutil.rmtree(self.stage, ignore_errors=True)


class ObjectStoreWriter:
    """Objects in place, the JSON file last, stale objects of the previous version deleted."""

    def __init__(self, target: RemotePath, meta_name: str = META):
        self.target, self.meta_name = target, meta_name
        self.outputs: dict[str, dict] = {}
        self.written: list[str] = []
        self._previous = self._previous_outputs()
        self._invalidated = False

    def _previous_outputs(self) -> dict[str, dict]:
        meta_path = self.target / self.meta_name
        try:
            meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        except (StorageError, ValueError):
            return {}
        out = meta.get("outputs")
        return out if isinstance(out, dict) else {}

    def _invalidate(self) -> None:
        """Before the first object changes: the old JSON file no longer describes the objects."""
        if not self._invalidated:
            (self.target / self.meta_name).unlink(missing_ok=True)
            self._invalidated = True

    def _put(self, rel: str, data: bytes) -> None:
        self._invalidate()
        (self.target / rel).write_bytes(data)
        self.outputs[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        self.written.append(rel)

    def write_table(self, rel: str, table: pa.Table) -> None:
        sink = pa.BufferOutputStream()
        try:
            pq.write_table(table, sink)
        except (pa.ArrowException, OSError) as exc:
            raise OutputError(f"cannot write {self.target / rel}: {exc}") from exc
        self._put(rel, sink.getvalue().to_pybytes())

    def keep(self, rel: str) -> None:
        record = self._previous.get(rel)
        if record is None:  # written by a version that did not record it: describe it now
            data = (self.target / rel).read_bytes()
            record = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        self.outputs[rel] = record

    def commit(self, meta: dict) -> None:
        self._invalidate()
        meta = dict(meta, outputs={k: self.outputs[k] for k in sorted(self.outputs)})
        (self.target / self.meta_name).write_bytes(_meta_bytes(meta))
        for obj in self.target.files():
            rel = str(obj.relative_to(self.target))
            if rel != self.meta_name and rel not in self.outputs:
                obj.unlink(missing_ok=True)

    def abort(self) -> None:
        for rel in self.written:
            try:
                (self.target / rel).unlink(missing_ok=True)
            except StorageError:
                pass  # already failing; the next commit deletes what is not listed
