"""``import_wandb``: a W&B run (online or offline) -> a run directory.

Sources, one class a kind behind one interface (:class:`Source`: ``read(job)`` writes through
the job's writer and returns the run's config); :func:`import_wandb` picks them and runs each:

- a path (:class:`OfflineRunSource`): an offline (or synced) run folder ``wandb/offline-run-*`` /
  ``wandb/run-*`` or its ``run-<id>.wandb`` file, read with rldiag's own reader
  (:mod:`.wandb_log`, :mod:`.wandb_records`);
- ``entity/project/run_id`` (:class:`OnlineRunSource`): a run on a W&B server, through the public
  API (:mod:`.wandb_online`);
- ``--artifact entity/project/name:version`` (:class:`ArtifactSource`; any number, with or without
  a run): batches from those artifacts instead of the run's own.

What lands in ``RUN`` (see :mod:`.rundir_writer`): ``run.yaml`` (the config, nested as verl's),
``metrics.jsonl`` (every history row, verl's file-logger form), ``batches/step_<N>.parquet``
(from artifacts of type ``rl-batches``) and ``rldiag/import/wandb.json`` (source, exit code,
what was found and what was not).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar, Protocol

from rldiag.errors import WandbImportError
from rldiag.importers.rundir_writer import RunDirWriter
from rldiag.importers.wandb_artifacts import FileFinder, step_of_name, wandb_default_dirs
from rldiag.importers.wandb_log import LogStats
from rldiag.importers.wandb_online import (
    ApiFactory,
    default_api_factory,
    download_batches,
    fetch_run,
    get_artifact,
    is_run_path,
    run_artifacts,
)
from rldiag.importers.wandb_records import ArtifactInfo, OfflineRun, read_offline_run
from rldiag.importers.wandb_sdk import quiet_environment, shutdown, wandb_version
from rldiag.io.fs import RemotePath
from rldiag.version import __version__

Progress = Callable[[int, int, int], None]

DEFAULT_ARTIFACT_TYPE = "rl-batches"
DEFAULT_PAGE_SIZE = 1000
DEFAULT_TIMEOUT = 30.0


@dataclass
class ImportReport:
    """What one import did; also written to ``RUN/rldiag/import/wandb.json``."""

    out: Path | RemotePath
    kind: str  # "offline", "online" or "artifact"
    source: str
    run_id: str | None = None
    entity: str | None = None
    project: str | None = None
    display_name: str | None = None
    exit_code: int | None = None
    state: str | None = None
    history_rows: int = 0
    first_step: int | None = None
    last_step: int | None = None
    metric_keys: int = 0
    config_keys: int = 0
    config_updates: int = 0
    batch_steps: list[int] = field(default_factory=list)
    artifacts: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    log: dict[str, Any] | None = None
    producer: str | None = None
    seconds: float = 0.0

    def record(self) -> dict[str, Any]:
        return {
            "format": 1,
            "source": {"kind": self.kind, "source": self.source},
            "run": {"id": self.run_id, "entity": self.entity, "project": self.project, "name": self.display_name},
            "exit_code": self.exit_code,
            "state": self.state,
            "history": {"rows": self.history_rows, "first_step": self.first_step, "last_step": self.last_step,
                        "keys": self.metric_keys},
            "config": {"top_level_keys": self.config_keys, "updates": self.config_updates},
            "batches": {"steps": self.batch_steps, "artifacts": self.artifacts},
            "log_file": self.log,
            "warnings": self.warnings,
            "notes": self.notes,
            "written_by": {"wandb": self.producer, "reader_wandb": wandb_version(), "rldiag": __version__},
            "imported_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(self.seconds, 3),
        }


def resolve_offline_file(source: Path) -> Path:
    """The ``.wandb`` file of an offline run folder (or the file itself)."""
    if source.is_file():
        return source
    if not source.is_dir():
        raise WandbImportError(f"{source} does not exist")
    files = sorted(source.glob("run-*.wandb")) or sorted(source.glob("*.wandb"))
    if len(files) == 1:
        return files[0]
    if len(files) > 1:
        raise WandbImportError(f"{source} holds {len(files)} .wandb files ({', '.join(f.name for f in files)}); pass one of them")
    runs = sorted(p.name for p in source.iterdir() if p.is_dir() and (p.name.startswith(("offline-run-", "run-"))))
    if runs:
        shown = ", ".join(runs[-5:])
        raise WandbImportError(f"{source} is a wandb folder with {len(runs)} runs; pass one run folder "
                               f"(e.g. {source / runs[-1]}; latest: {shown})")
    raise WandbImportError(f"{source} holds no run-*.wandb file: pass a wandb/offline-run-* folder or its .wandb file")


def _label(art: ArtifactInfo, occurrences: dict[str, int], counts: dict[str, int]) -> str:
    occurrences[art.name] = occurrences.get(art.name, 0) + 1
    if counts.get(art.name, 0) > 1:
        return f"{art.name}@{occurrences[art.name]}"
    return art.name


def _stage_offline_artifacts(run: OfflineRun, writer: RunDirWriter, finder: FileFinder, artifact_type: str,
                             report: ImportReport) -> None:
    chosen = [a for a in run.artifacts if a.type == artifact_type]
    if not chosen:
        types = sorted({a.type for a in run.artifacts})
        report.notes.append(
            f"no artifact of type {artifact_type!r} in the run"
            + (f" (types logged: {', '.join(types)})" if types else "")
            + "; batches/ left as it is"
        )
        return
    counts: dict[str, int] = {}
    for a in chosen:
        counts[a.name] = counts.get(a.name, 0) + 1
    occurrences: dict[str, int] = {}
    for art in chosen:
        label = _label(art, occurrences, counts)
        report.warnings.extend(art.problems)
        found, missing = [], []
        step_entries = [(e, s) for e in art.entries if (s := step_of_name(e.path)) is not None]
        for entry, step in sorted(step_entries, key=lambda t: t[1]):
            path, how = finder.find(entry)
            if path is None:
                missing.append({"path": entry.path, "step": step, "digest": entry.digest, "local_path": entry.local_path,
                                "why": how})
                continue
            writer.add_batch_file(step, entry.name, path, source=label)
            found.append({"path": entry.path, "step": step, "digest": entry.digest, "found_at": str(path), "how": how})
        report.artifacts.append({"name": art.name, "label": label, "type": art.type, "digest": art.digest,
                                 "files": len(step_entries), "found": found, "missing": missing})
        if not step_entries:
            report.warnings.append(f"artifact {label} holds no step_<N>.parquet/.arrow files")
        if missing:
            steps = ", ".join(str(m["step"]) for m in missing[:10]) + (" ..." if len(missing) > 10 else "")
            report.warnings.append(
                f"artifact {label}: {len(missing)} of {len(step_entries)} batch files not found (steps {steps}); "
                f"first: {missing[0]['path']}: {missing[0]['why']}"
            )


def _stage_online_artifacts(arts: Sequence[Any], writer: RunDirWriter, report: ImportReport,
                            progress: Progress | None) -> None:
    for art in arts:
        info = download_batches(art, writer, progress=progress)
        report.warnings.extend(info.problems)
        report.artifacts.append({"name": info.name, "label": info.name, "type": info.type, "digest": info.digest,
                                 "version": info.version, "files": len(info.entries),
                                 "found": [{"path": e.path, "step": step_of_name(e.path), "digest": e.digest}
                                           for e in info.entries],
                                 "missing": []})


# ---- the sources: one class a kind, one interface --------------------------------------------


@dataclass
class ImportJob:
    """What a source reads into and with: the run directory being written, the report, the W&B
    API (made on first use) and the import's options."""

    writer: RunDirWriter
    report: ImportReport
    api: Callable[[], Any]
    own_batches: bool  # stage the batches the run logged itself (batches on, no --artifact)
    artifact_type: str
    artifact_dirs: Sequence[str | Path]
    nested_sep: str
    page_size: int
    progress: Progress | None


class Source(Protocol):
    """One kind of thing to import from: ``kind`` names it in the report, ``read`` writes what it
    holds through ``job.writer``, notes it in ``job.report`` and returns the run's config (None:
    the source has no config)."""

    kind: ClassVar[str]

    def read(self, job: ImportJob) -> dict[str, Any] | None: ...


@dataclass
class OfflineRunSource:
    """An offline (or synced) run folder or its ``.wandb`` file, read with rldiag's own reader;
    its batches from the artifacts it logged, found on this machine."""

    path: Path
    kind: ClassVar[str] = "offline"

    def read(self, job: ImportJob) -> dict[str, Any] | None:
        writer, report = job.writer, job.report
        wandb_file = resolve_offline_file(self.path)
        report.source = str(wandb_file)
        stats = LogStats(str(wandb_file))
        run, stats = read_offline_run(wandb_file, writer.add_row, sep=job.nested_sep, progress=job.progress,
                                      stats=stats)
        report.log = stats.as_dict()
        report.warnings.extend(stats.problems())
        report.run_id, report.entity, report.project = run.run_id, run.entity, run.project
        report.display_name, report.exit_code, report.producer = run.display_name, run.exit_code, run.producer
        report.state = "finished" if run.finished else "unfinished"
        report.config_updates = run.config_updates
        if not run.finished:
            report.warnings.append(
                f"no exit record: the run did not finish writing {wandb_file.name} (killed, crashed or still "
                f"running); exit code unknown; imported {run.history_rows} history rows"
                + (f" (steps {run.first_step}..{run.last_step})" if run.history_rows else "")
            )
        if run.undecodable_records:
            report.warnings.append(f"{run.undecodable_records} record(s) passed their checksum but are not "
                                   "wandb Records (skipped)")
        if run.undecodable_values:
            report.warnings.append(f"{run.undecodable_values} value(s) were not valid JSON; kept as text")
        if run.rows_without_step:
            report.warnings.append(f"{run.rows_without_step} history row(s) without a step (skipped)")
        if job.own_batches:
            staging, cache = wandb_default_dirs()
            finder = FileFinder([*job.artifact_dirs, *staging, wandb_file.parent], cache)
            _stage_offline_artifacts(run, writer, finder, job.artifact_type, report)
        return run.config


@dataclass
class OnlineRunSource:
    """``entity/project/run_id`` on a W&B server, through the public API; its batches from the
    artifacts the run logged."""

    run_path: str
    kind: ClassVar[str] = "online"

    def read(self, job: ImportJob) -> dict[str, Any] | None:
        report = job.report
        info, run = fetch_run(job.api(), self.run_path, job.writer, page_size=job.page_size, sep=job.nested_sep,
                              progress=job.progress)
        report.run_id, report.entity, report.project = info.run_id, info.entity, info.project
        report.display_name, report.state = info.display_name, info.state
        if info.rows_without_step:
            report.warnings.append(f"{info.rows_without_step} history row(s) without _step (skipped)")
        if job.own_batches:
            arts = run_artifacts(run, job.artifact_type, self.run_path)
            if not arts:
                report.notes.append(f"no artifact of type {job.artifact_type!r} logged by the run; batches/ left as it is")
            _stage_online_artifacts(arts, job.writer, report, job.progress)
        return info.config


@dataclass
class ArtifactSource:
    """``entity/project/name:version`` artifacts (``--artifact``) on a W&B server: batches only."""

    specs: Sequence[str]
    kind: ClassVar[str] = "artifact"

    def read(self, job: ImportJob) -> dict[str, Any] | None:
        arts = [get_artifact(job.api(), spec) for spec in self.specs]
        _stage_online_artifacts(arts, job.writer, job.report, job.progress)
        return None


# ---- the import -------------------------------------------------------------------------------


def import_wandb(
    source: str | Path | None,
    out: str | Path | RemotePath,
    *,
    artifacts: Sequence[str] = (),
    artifact_type: str = DEFAULT_ARTIFACT_TYPE,
    artifact_dirs: Sequence[str | Path] = (),
    batches: bool = True,
    nested_sep: str = ".",
    page_size: int = DEFAULT_PAGE_SIZE,
    timeout: float = DEFAULT_TIMEOUT,
    base_url: str | None = None,
    api_factory: ApiFactory | None = None,
    progress: Progress | None = None,
    defer: Callable[[Callable[[], None]], None] | None = None,
) -> ImportReport:
    """Import a W&B run into the run directory ``out`` (created, or updated in place; a local
    directory or an object-store URI such as ``s3://bucket/run``).

    ``source`` is an offline run folder / ``.wandb`` file, or ``entity/project/run_id``; it may be
    None when ``artifacts`` name the batches to import. ``api_factory(timeout=, base_url=)``
    replaces ``wandb.Api`` (tests). The wandb SDK is shut down (bounded, see
    :func:`~rldiag.importers.wandb_sdk.shutdown`) when the import ends, or later by whoever
    ``defer(fn)`` hands ``fn`` to: the CLI reports the outcome first, then shuts down. Raises
    :class:`WandbImportError` when the source cannot be read at all; partial damage (a torn file,
    missing artifact files) is in ``report.warnings``.
    """
    t0 = time.perf_counter()
    quiet_environment()
    if source is None and not artifacts:
        raise WandbImportError("nothing to import: give a run (offline folder, .wandb file or entity/project/run_id) "
                               "or --artifact entity/project/name:version")
    if page_size < 1:
        raise WandbImportError(f"--page-size {page_size}: must be at least 1")
    if timeout <= 0:
        raise WandbImportError(f"--timeout {timeout}: must be positive")
    sources: list[Source] = []
    if source is not None:
        src_path = Path(source).expanduser()
        if src_path.exists():
            sources.append(OfflineRunSource(src_path))
        elif is_run_path(str(source)):
            sources.append(OnlineRunSource(str(source)))
        else:
            raise WandbImportError(f"{source}: no such file or folder, and not a W&B run path (entity/project/run_id)")
    if artifacts:
        sources.append(ArtifactSource(artifacts))
    kind = sources[0].kind
    writer = RunDirWriter(out)
    report = ImportReport(out=writer.out, kind=kind, source=str(source) if source is not None else ", ".join(artifacts))
    factory = api_factory or default_api_factory
    api = None
    used_sdk_api = False

    def get_api():
        nonlocal api, used_sdk_api
        if api is None:
            used_sdk_api = api_factory is None
            api = factory(timeout=timeout, base_url=base_url)
        return api

    job = ImportJob(writer, report, get_api, own_batches=batches and not artifacts, artifact_type=artifact_type,
                    artifact_dirs=artifact_dirs, nested_sep=nested_sep, page_size=page_size, progress=progress)
    config: dict[str, Any] | None = None
    try:
        for src in sources:
            got = src.read(job)
            if got is not None:
                config = got
        for step, old, new in writer.batch_replaced:
            report.warnings.append(f"step {step} is in artifacts {old} and {new}; kept {new}")
        if writer.out_of_order_rows:
            report.warnings.append(f"{writer.out_of_order_rows} history row(s) came with a step lower than an earlier "
                                   "row's; written in the order logged")
        writer.flush_rows()
        report.history_rows, report.first_step, report.last_step = writer.rows, writer.first_step, writer.last_step
        report.metric_keys = len(writer.keys)
        report.batch_steps = writer.batch_steps
        write_metrics = kind != "artifact"
        if write_metrics and writer.rows == 0:
            write_metrics = False
            report.notes.append("the run has no history rows; metrics.jsonl left as it is")
        if config is not None and not config:
            report.notes.append("the run has no config; run.yaml left as it is")
            config = None
        report.config_keys = len(config) if config else 0
        report.seconds = time.perf_counter() - t0
        writer.commit(config=config, record=report.record(), write_metrics=write_metrics)
        return report
    finally:
        writer.abort()
        if used_sdk_api:
            (defer or _now)(shutdown)


def _now(fn: Callable[[], None]) -> None:
    fn()
