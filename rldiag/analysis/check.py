"""``rldiag check``: what a run holds, what is wrong with it, and what each algorithm needs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow.compute as pc

from rldiag.config.settings import find_config_file, resolve_settings
from rldiag.engine.advantage import ESTIMATORS
from rldiag.engine.requirements import BASE_NEED, estimator_need, metric_family_needs
from rldiag.errors import RldiagError
from rldiag.io.arrays import rows_frame
from rldiag.io.fs import relative_to
from rldiag.io.loader import read_table, validate_table
from rldiag.io.rundir import RunDir, iter_metrics_lines
from rldiag.io.schema import LIST_COLUMNS, SCALAR_COLUMNS

if TYPE_CHECKING:
    import polars as pl


@dataclass
class StepSummary:
    step: int
    file: str
    rows: int = 0
    tokens: int = 0
    actor_tokens: int = 0
    groups: int = 0
    columns: list[str] = field(default_factory=list)
    problem: str | None = None


@dataclass
class CheckReport:
    run: str
    config_file: str | None
    metrics_lines: int
    metrics_names: int
    steps: list[StepSummary]
    columns: list[str]
    algorithms: dict[str, list[str]]  # name -> missing columns ([] = ready)
    metric_families: dict[str, list[str]]
    #: ``metrics.jsonl`` lines every reader skips: ``(line number, why)``
    metrics_skipped: list[tuple[int, str]] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        return [s.problem for s in self.steps if s.problem]

    @property
    def ok(self) -> bool:
        return not self.problems and bool(self.steps)

    def steps_frame(self) -> pl.DataFrame:
        """One row per batch file: step, file, rows, tokens, actor tokens, groups, columns, and
        the problem that makes it unreadable (null when it is fine)."""
        return rows_frame([asdict(s) for s in self.steps], [f.name for f in fields(StepSummary)])


def check_run(run: str | Path, progress: Callable[[int, int, int], None] | None = None) -> CheckReport:
    rd = RunDir(run)
    settings = resolve_settings(rd.path)  # a malformed config file is an error before any batch is read
    files = rd.require_steps()
    summaries: list[StepSummary] = []
    seen: set[str] = set()
    for i, sf in enumerate(files):
        s = StepSummary(step=sf.step, file=str(relative_to(sf.path, rd.path)))
        try:
            table = read_table(sf)
            s.columns = list(table.column_names)
            seen.update(s.columns)
            ragged = validate_table(table, sf)
            s.rows = table.num_rows
            mask = ragged["response_mask"]
            s.tokens = int(mask.lengths.sum())
            s.actor_tokens = int(mask.values.sum())
            s.groups = int(pc.count_distinct(table["uid"]).as_py())
            if s.actor_tokens == 0:
                s.problem = f"file {s.file}, step {sf.step}: no token has response_mask 1 (nothing to learn from)"
        except RldiagError as exc:
            s.problem = str(exc)
        summaries.append(s)
        if progress:
            progress(i + 1, len(files), sf.step)
    # what each algorithm needs, judged on columns present in every step
    common = set.intersection(*(set(s.columns) for s in summaries if s.columns)) if any(s.columns for s in summaries) else set()
    algorithms = {
        name: BASE_NEED.missing(common) + estimator_need(name, settings).missing(common) for name in ESTIMATORS.names()
    }
    families = {name: need.missing(common) for name, need in metric_family_needs().items()}
    names: set[str] = set()
    lines = 0
    skipped: list[tuple[int, str]] = []
    for _, values in iter_metrics_lines(rd.metrics_file, skipped):
        lines += 1
        names.update(values)
    known = [c for c in (*LIST_COLUMNS, *SCALAR_COLUMNS) if c in seen]
    other = sorted(seen - set(known))
    cf = find_config_file(rd.path)
    return CheckReport(
        run=str(rd.path),
        config_file=str(relative_to(cf, rd.path)) if cf else None,
        metrics_lines=lines,
        metrics_names=len(names),
        steps=summaries,
        columns=known + other,
        algorithms=algorithms,
        metric_families=families,
        metrics_skipped=skipped,
    )
