"""Export a run directory to Weights & Biases, so that ``rldiag import-wandb`` round-trips.

>>> from rldiag.capture.wandb_export import export_run, log_batches   # doctest: +SKIP
>>> export_run("runs/exp1", project="rl", mode="offline")             # a new W&B run
>>> log_batches(wandb.run, "runs/exp1")                               # or into a running one

- ``log_batches``: the run directory's ``batches/step_<N>.parquet|.arrow`` files as one artifact
  of type ``rl-batches`` (file names kept, so the steps come back as they were);
- ``log_metrics``: every line of ``metrics.jsonl`` (verl's ``{"step": N, "data": {...}}`` or flat)
  with ``run.log(data, step=N)``; lines of one step are merged and steps go in increasing order,
  as W&B requires;
- ``export_run``: a new W&B run with the run's config (``run.yaml`` / ``config.yaml`` /
  ``.hydra/config.yaml``, nested as verl's), its metrics and its batches.

``wandb`` is optional: it is imported when these functions are called. Nothing here changes
wandb's settings; pass ``mode="offline"`` for an air-gapped machine (the run then lands in
``wandb/offline-run-*`` and ``wandb sync`` or ``rldiag import-wandb`` can take it from there).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rldiag.errors import CaptureError, RldiagError
from rldiag.io.run_layout import RunLayout
from rldiag.io.rundir import RunDir, iter_metrics_records
from rldiag.version import __version__

BATCH_ARTIFACT_TYPE = "rl-batches"
#: keys of a metrics line that wandb computes itself and must not be logged back
_SKIP_KEYS = ("_step", "_runtime")


def _wandb():
    try:
        import wandb
    except ImportError as exc:
        raise CaptureError(f"exporting to W&B needs the optional wandb package: pip install 'rldiag[wandb]' ({exc})") from exc
    return wandb


def artifact_name_for(run_dir: str | Path) -> str:
    """A valid artifact name from the run directory's name (letters, digits, ``-``, ``_``, ``.``)."""
    base = Path(run_dir).resolve().name or "run"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-.") + "-batches"


def read_config_tree(run_dir: str | Path) -> dict[str, Any]:
    """The run's config file as a nested tree (safe YAML), or {} when it has none."""
    from rldiag.config.settings import find_config_file, read_yaml_mapping

    path = find_config_file(Path(run_dir))
    if path is None:
        return {}
    return read_yaml_mapping(path, "config file", CaptureError)


def iter_metric_rows(run_dir: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(step, data)`` per step of ``metrics.jsonl``: increasing steps, lines of one step merged.

    Every JSON value is kept (numbers exactly, NaN/Infinity, strings, nested dicts). An
    incomplete last line (still being written) and lines that are not JSON objects with a step
    are skipped.
    """
    rows: dict[int, dict[str, Any]] = {}
    for step, data in iter_metrics_records(RunLayout(run_dir).metrics_file):
        rows.setdefault(step, {}).update({k: v for k, v in data.items() if k not in _SKIP_KEYS})
    for step in sorted(rows):
        yield step, rows[step]


def log_metrics(run, run_dir: str | Path) -> int:
    """Log every step of ``metrics.jsonl`` into ``run``; returns the number of steps logged."""
    n = 0
    for step, data in iter_metric_rows(run_dir):
        run.log(data, step=step)
        n += 1
    return n


def log_batches(
    run,
    run_dir: str | Path,
    *,
    name: str | None = None,
    type: str = BATCH_ARTIFACT_TYPE,  # noqa: A002 - wandb's own parameter name
    aliases: Sequence[str] | None = None,
    steps: Sequence[int] | None = None,
):
    """Log the run directory's batch files as one artifact of type ``rl-batches``; returns it.

    ``steps`` limits the export to those steps (default: every batch file).
    """
    wandb = _wandb()
    try:
        files = RunDir(run_dir).require_steps()
    except RldiagError as exc:
        raise CaptureError(str(exc)) from exc
    if steps is not None:
        wanted = set(int(s) for s in steps)
        files = [f for f in files if f.step in wanted]
        if not files:
            raise CaptureError(f"none of the steps {sorted(wanted)} has a batch file in {run_dir}")
    art = wandb.Artifact(
        name or artifact_name_for(run_dir), type=type,
        description=f"rldiag run directory batches ({len(files)} steps)",
        metadata={"steps": [f.step for f in files], "format": "rldiag run directory (docs/run-directory.md)",
                  "rldiag_version": __version__},
    )
    for f in files:
        art.add_file(str(f.path), name=f.path.name)
    run.log_artifact(art, aliases=list(aliases) if aliases else None)
    return art


@dataclass
class ExportReport:
    run_id: str
    project: str | None
    mode: str | None
    metric_steps: int = 0
    batch_files: int = 0
    artifact: str | None = None
    config_keys: list[str] = field(default_factory=list)


def export_run(
    run_dir: str | Path,
    *,
    project: str | None = None,
    entity: str | None = None,
    name: str | None = None,
    run_id: str | None = None,
    mode: str | None = None,
    dir: str | Path | None = None,  # noqa: A002 - wandb.init's parameter name
    artifact_name: str | None = None,
    artifact_type: str = BATCH_ARTIFACT_TYPE,
    config: bool = True,
    metrics: bool = True,
    batches: bool = True,
    settings: Any = None,
) -> ExportReport:
    """A new W&B run holding the run directory's config, metrics and batches."""
    wandb = _wandb()
    RunDir(run_dir)  # exists and is a directory
    cfg = read_config_tree(run_dir) if config else {}
    init_kwargs: dict[str, Any] = {"project": project, "entity": entity, "name": name, "id": run_id, "mode": mode,
                                   "config": cfg or None}
    if dir is not None:
        init_kwargs["dir"] = str(dir)
    if settings is not None:
        init_kwargs["settings"] = settings
    run = wandb.init(**{k: v for k, v in init_kwargs.items() if v is not None})
    report = ExportReport(run_id=run.id, project=getattr(run, "project", project), mode=mode,
                          config_keys=sorted(cfg))
    try:
        if metrics:
            report.metric_steps = log_metrics(run, run_dir)
        if batches and RunDir(run_dir).step_files():
            art = log_batches(run, run_dir, name=artifact_name, type=artifact_type)
            report.batch_files = len(art.manifest.entries)
            report.artifact = art.name
    except BaseException:
        run.finish(exit_code=1)
        raise
    run.finish()
    return report
