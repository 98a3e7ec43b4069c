"""Decode the records of an offline run file with the protobuf classes wandb ships.

Each record read by :mod:`rldiag.importers.wandb_log` is a ``wandb_internal.Record``. The ones
an import needs:

- ``run``: run id, entity, project, name and the initial config (``config.update`` items);
- ``config``: later ``run.config.update(...)`` calls (updates and removals, applied in order);
- ``history``: one row per step: ``item`` (key or nested_key path, value as ``value_json`` and/or a
  typed value) and ``step.num``;
- ``exit``: the exit code (absent when the run was killed);
- ``artifact``: logged artifacts with their manifest (path, digest, size, staged local path).

Everything else (system stats, console output, telemetry, summaries) is counted, not imported.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rldiag.importers.wandb_log import LogStats, iter_records
from rldiag.importers.wandb_sdk import record_class
from rldiag.importers.wandb_values import (
    STEP_KEY,
    WANDB_CONFIG_KEYS,
    flatten_into,
    parse_json,
    parse_json_many,
    remove_path,
    set_path,
)

RowSink = Callable[[int, dict[str, Any]], None]
Progress = Callable[[int, int, int], None]


@dataclass
class ArtifactEntry:
    """One file of an artifact's manifest."""

    path: str  # the file's name inside the artifact
    digest: str  # base64 digest (MD5 unless ``algorithm`` says otherwise)
    size: int | None = None
    local_path: str | None = None  # where wandb staged it (offline: a random name)
    ref: str | None = None  # a reference (s3://, gs://, ...): the bytes were never stored
    algorithm: str = "md5"  # "md5" or "xxh128"

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


@dataclass
class ArtifactInfo:
    """An artifact a run logged (offline: its record; online: the API object)."""

    name: str
    type: str
    digest: str | None = None
    version: str | None = None
    aliases: list[str] = field(default_factory=list)
    entries: list[ArtifactEntry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.name}:{self.version}" if self.version and ":" not in self.name else self.name


@dataclass
class OfflineRun:
    """What one offline run file holds, apart from its history rows (streamed to a sink)."""

    file: str
    run_id: str | None = None
    entity: str | None = None
    project: str | None = None
    display_name: str | None = None
    producer: str | None = None  # the wandb version that wrote the file
    config: dict[str, Any] = field(default_factory=dict)
    config_updates: int = 0  # config records after the run record
    exit_code: int | None = None  # None: no exit record (killed, or still running)
    runtime: int | None = None
    artifacts: list[ArtifactInfo] = field(default_factory=list)
    history_rows: int = 0
    first_step: int | None = None
    last_step: int | None = None
    record_types: dict[str, int] = field(default_factory=dict)
    undecodable_records: int = 0
    undecodable_values: int = 0
    rows_without_step: int = 0

    @property
    def finished(self) -> bool:
        return self.exit_code is not None


def _path(item) -> tuple[str, ...]:
    nested = tuple(item.nested_key)
    return nested if nested else (item.key,)


def history_row(history, sep: str = ".", run: OfflineRun | None = None) -> tuple[int | None, dict[str, Any]]:
    """``(step, data)`` of a history record; ``data`` has flat keys and no ``_step``.

    The row's JSON values are decoded with one parser call (this is the hot loop of an import).
    """
    paths: list[Any] = []  # a str for a one-part key (the usual case), else a tuple
    values: list[Any] = []
    json_at: list[int] = []
    json_texts: list[str] = []
    for item in history.item:
        nested = item.nested_key
        path = nested[0] if len(nested) == 1 else (tuple(nested) if nested else item.key)
        kind = item.WhichOneof("value")
        if kind is None:
            text = item.value_json
            if not text:
                continue
            json_at.append(len(values))
            json_texts.append(text)
            values.append(None)
        elif kind == "none":
            values.append(None)
        elif kind == "json":
            json_at.append(len(values))
            json_texts.append(item.json)
            values.append(None)
        else:  # boolean, integer, number, text
            values.append(getattr(item, kind))
        paths.append(path)
    if json_texts:
        try:
            decoded = parse_json_many(json_texts)
        except ValueError:
            decoded = []
            for text in json_texts:
                try:
                    decoded.append(parse_json(text))
                except ValueError:
                    if run is not None:
                        run.undecodable_values += 1
                    decoded.append(text)
        for i, value in zip(json_at, decoded):
            values[i] = value
    data: dict[str, Any] = {}
    step_value = None
    for path, value in zip(paths, values):
        if path == STEP_KEY:
            step_value = value
        elif isinstance(value, dict) or not isinstance(path, str):
            flatten_into(data, (path,) if isinstance(path, str) else path, value, sep)
        else:
            data[path] = value
    if history.HasField("step"):
        return int(history.step.num), data
    if isinstance(step_value, int) and not isinstance(step_value, bool):
        return step_value, data
    return None, data


def _apply_config(config: dict[str, Any], record, run: OfflineRun) -> None:
    for item in record.update:
        path = _path(item)
        try:
            value = parse_json(item.value_json) if item.value_json else None
        except ValueError:
            run.undecodable_values += 1
            value = item.value_json
        set_path(config, path, value)
    for item in record.remove:
        remove_path(config, _path(item))


def _entry(proto, algorithm: str) -> ArtifactEntry:
    alg = algorithm
    for extra in proto.extra:
        if extra.key == "alg":
            try:
                alg = str(json.loads(extra.value_json)).lower()
            except ValueError:
                alg = extra.value_json.lower()
    return ArtifactEntry(
        path=proto.path, digest=proto.digest, size=proto.size or None,
        local_path=proto.local_path or None, ref=proto.ref or None,
        algorithm="xxh128" if "xxh128" in alg else "md5",
    )


def _manifest_entry(d: Any, algorithm: str) -> ArtifactEntry:
    """One line of a manifest file; ValueError naming what is wrong with it."""
    if not isinstance(d, dict):
        raise ValueError(f"not a JSON object but {type(d).__name__}")
    if not isinstance(d.get("path"), str) or not d["path"]:
        raise ValueError("no \"path\"")
    size = d.get("size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise ValueError(f"size {size!r} is not a byte count")
    extra = d.get("extra")
    alg = str((extra if isinstance(extra, dict) else {}).get("alg", algorithm)).lower()
    text = {k: d.get(k) if isinstance(d.get(k), str) else None for k in ("digest", "local_path", "ref")}
    return ArtifactEntry(
        path=d["path"], digest=text["digest"] or "", size=size, local_path=text["local_path"], ref=text["ref"],
        algorithm="xxh128" if "xxh128" in alg else "md5",
    )


def _manifest_file_entries(path: str, algorithm: str, problems: list[str], label: str) -> list[ArtifactEntry]:
    """A large manifest wandb wrote to a gzipped JSON-lines file instead of the record.

    A line that is not a file entry is reported in ``problems`` (by line number) and left out;
    a file cut short (a truncated gzip) keeps the entries before the cut.
    """
    out = []
    number = 0
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    out.append(_manifest_entry(json.loads(line), algorithm))
                except (ValueError, RecursionError) as exc:
                    why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
                    problems.append(f"artifact {label}: manifest {path} line {number} skipped: {why}")
    except (OSError, EOFError, ValueError) as exc:  # gzip.BadGzipFile is an OSError; a cut stream EOFError
        got = f"; the {len(out)} entries before line {number + 1} are kept" if out else ""
        problems.append(f"artifact {label}: its manifest {path} cannot be read past line {number} "
                        f"({type(exc).__name__}: {exc}){got}")
    return out


def artifact_info(record) -> ArtifactInfo:
    art = record
    algorithm = "xxh128" if "XXH128" in (art.digest_algorithm or "").upper() else "md5"
    info = ArtifactInfo(name=art.name, type=art.type, digest=art.digest or None, aliases=list(art.aliases))
    manifest = art.manifest
    info.entries = [_entry(e, algorithm) for e in manifest.contents]
    if manifest.manifest_file_path:
        info.entries += _manifest_file_entries(manifest.manifest_file_path, algorithm, info.problems, art.name)
    return info


def read_offline_run(
    path: str | Path,
    on_row: RowSink,
    *,
    sep: str = ".",
    progress: Progress | None = None,
    stats: LogStats | None = None,
) -> tuple[OfflineRun, LogStats]:
    """Read one ``run-*.wandb`` file: history rows go to ``on_row(step, data)`` in file order.

    Returns the rest of what the file holds and what reading it found (damage included).
    ``progress(done_kib, total_kib, step)`` is called as the file is read.
    """
    Record = record_class()
    path = Path(path)
    stats = stats if stats is not None else LogStats(str(path))
    run = OfflineRun(file=str(path))
    config: dict[str, Any] = {}
    types = run.record_types
    rec = Record()
    last_report = 0
    for offset, payload in iter_records(path, stats):
        try:
            rec.ParseFromString(payload)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError; its module path differs by backend
            run.undecodable_records += 1
            continue
        kind = rec.WhichOneof("record_type")
        types[kind or "none"] = types.get(kind or "none", 0) + 1
        if kind == "history":
            step, data = history_row(rec.history, sep, run)
            if step is None:
                run.rows_without_step += 1
                continue
            on_row(step, data)
            run.history_rows += 1
            if run.first_step is None:
                run.first_step = step
            run.last_step = step
            if progress is not None and offset - last_report >= 1 << 18:
                last_report = offset
                progress(offset >> 10, stats.file_size >> 10, step)
        elif kind == "config":
            _apply_config(config, rec.config, run)
            run.config_updates += 1
        elif kind == "run":
            r = rec.run
            run.run_id = r.run_id or run.run_id
            run.entity = r.entity or run.entity
            run.project = r.project or run.project
            run.display_name = r.display_name or run.display_name
            _apply_config(config, r.config, run)
        elif kind == "exit":
            run.exit_code = int(rec.exit.exit_code)
            run.runtime = int(rec.exit.runtime) if rec.exit.runtime else None
        elif kind == "artifact":
            run.artifacts.append(artifact_info(rec.artifact))
        elif kind == "header":
            run.producer = rec.header.version_info.producer or None
    for key in WANDB_CONFIG_KEYS:
        config.pop(key, None)
    run.config = config
    if progress is not None:
        progress(stats.file_size >> 10, stats.file_size >> 10, run.last_step if run.last_step is not None else 0)
    return run, stats
