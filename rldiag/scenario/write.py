"""A scenario being written: its report, and the one writer every driver uses.

:class:`ScenarioWriter` opens the scenario's staging directory (:mod:`rldiag.io.staged`: swapped
in atomically on disk, ``scenario.json`` last on an object store), records each executor outcome
in step order (a reused step's files kept, a computed one's tables written, a failed one's error
noted), and commits ``metrics.parquet`` and ``scenario.json``, or aborts, leaving the previous
scenario as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa

from rldiag.config.settings import Settings
from rldiag.executors.steps import StepOutcome
from rldiag.io.fs import RemotePath, as_path
from rldiag.io.outputs import metrics_table, sha256_file
from rldiag.io.run_layout import ScenarioLayout
from rldiag.io.staged import StagedWriter, open_staged
from rldiag.scenario.plan import Previous
from rldiag.version import __version__

__all__ = ["ScenarioReport", "ScenarioWriter"]


@dataclass
class ScenarioReport:
    """One scenario's recompute: what was done, reused and failed, and its metric rows."""

    name: str
    path: Path | RemotePath
    settings: Settings
    device: str
    executor: str = "local"
    steps_done: list[int] = field(default_factory=list)
    steps_failed: dict[int, str] = field(default_factory=dict)
    steps_reused: list[int] = field(default_factory=list)
    internal: dict[int, str] = field(default_factory=dict)  # a failed step's traceback, where a bug failed it
    metrics: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0
    rows: int = 0
    tokens: int = 0
    # the scenario of another name, equal by resolved settings, whose steps were reused (None: none)
    reused_from: str | None = None
    # what the caller should hear before the numbers: overrides equal to the run's own values
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.steps_failed


class ScenarioWriter:
    """Writes one scenario into ``target``: :meth:`record` each executor outcome, then
    :meth:`commit` (or :meth:`abort`). ``prev``: what the scenario's last write left (a reused
    step's metrics come from it); ``overrides``: the scenario's, as ``scenario.json`` records
    them. Used as a context manager, an exception aborts it."""

    def __init__(self, target: ScenarioLayout, report: ScenarioReport, prev: Previous, overrides: dict[str, Any],
                 save_tokens: bool):
        self.target = target
        self.report = report
        self.prev = prev
        self.overrides = overrides
        self.save_tokens = save_tokens
        self.inputs: list[dict] = []  # each outcome's input record, in the order recorded
        self.table: pa.Table | None = None  # metrics.parquet, once committed
        dirs = (ScenarioLayout.ROWS, ScenarioLayout.TOKENS) if save_tokens else (ScenarioLayout.ROWS,)
        self.staged: StagedWriter | None = open_staged(target.dir, marker=ScenarioLayout.META, dirs=dirs)

    def __enter__(self) -> ScenarioWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is not None:
            self.abort()

    def record(self, out: StepOutcome) -> None:
        """One executor outcome into the report and the scenario being written."""
        staged = self._open()
        report = self.report
        self.inputs.append(out.info)
        tokens_rel = ScenarioLayout.tokens_rel(out.step)
        rows_rel = ScenarioLayout.rows_rel(out.step)
        if out.status == "failed":
            assert out.error is not None  # a failed outcome says why
            report.steps_failed[out.step] = out.error
            if out.traceback:
                report.internal[out.step] = out.traceback
            return
        if out.status == "reused":
            row = dict(self.prev.metrics[out.step])
            report.metrics.append({k: v for k, v in row.items() if v is not None or k == "step"})
            for rel in (tokens_rel, rows_rel) if self.save_tokens else (rows_rel,):
                if self.prev.source is None:
                    staged.keep(rel)
                else:  # an equal scenario of another name: its file, hard-linked or copied
                    src = self.prev.source.dir / rel
                    assert isinstance(src, Path)  # an equal scenario is looked for on local runs only
                    staged.link_file(rel, src)
            report.steps_reused.append(out.step)
        else:
            assert out.metrics is not None  # a computed step has its metrics row
            report.metrics.append(out.metrics)
            if out.tokens is not None:
                staged.write_table(tokens_rel, out.tokens)
            if out.row_table is not None:
                staged.write_table(rows_rel, out.row_table, compression="zstd")
            report.rows += out.rows
            report.tokens += out.n_tokens
        report.steps_done.append(out.step)

    def commit(self, seconds: float, extra: dict[str, Any] | None = None) -> ScenarioReport:
        """``metrics.parquet`` and ``scenario.json`` (with ``extra`` keys, e.g. the sweep that
        wrote it) written and the scenario swapped in; ``seconds``: the report's time."""
        staged = self._open()
        self.report.steps_done.sort()
        self.table = metrics_table(self.report.metrics)
        staged.write_table(ScenarioLayout.METRICS, self.table)
        self.report.seconds = seconds
        staged.commit({**self.meta(), **(extra or {})})
        self.staged = None
        return self.report

    def abort(self) -> None:
        """Nothing of this write kept (a no-op once committed or aborted)."""
        if self.staged is not None:
            self.staged.abort()
            self.staged = None

    def meta(self) -> dict[str, Any]:
        """``scenario.json`` as it stands (docs/run-directory.md)."""
        report = self.report
        settings = report.settings
        meta = {
            "name": report.name,
            "settings": settings.resolved(),
            "overrides": self.overrides,
            "config_file": settings.config_file,
            "rldiag_version": __version__,
            "device": report.device,
            "executor": report.executor,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "inputs": self.inputs,
            "steps_done": report.steps_done,
            "steps_failed": {str(k): v for k, v in sorted(report.steps_failed.items())},
            "steps_reused": sorted(report.steps_reused),
            "save_tokens": self.save_tokens,
            "seconds": round(report.seconds, 3),
            "rows": report.rows,
            "tokens": report.tokens,
        }
        if self.prev.reused_from is not None and report.steps_reused:
            meta["reused_from"] = report.reused_from = self.prev.reused_from
        if settings.config_file:
            meta["config_sha256"] = sha256_file(as_path(settings.config_file))
        return meta

    def _open(self) -> StagedWriter:
        if self.staged is None:
            raise RuntimeError(f"scenario {self.report.name}: its writer was already committed or aborted")
        return self.staged
