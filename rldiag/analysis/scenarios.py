"""Scenarios that an analysis needs: reuse one that is up to date with its per-token outputs,
else (re)compute it with ``save_tokens``."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rldiag.config.settings import find_config_file
from rldiag.errors import ComputeError, RunDirError, StorageError
from rldiag.io.arrays import read_parquet
from rldiag.io.fs import RemotePath, arrow_source, relative_to
from rldiag.io.outputs import list_scenarios, sha256_file
from rldiag.io.run_layout import RunLayout, ScenarioLayout
from rldiag.io.rundir import RunDir, parse_steps
from rldiag.recompute import ProgressFn, recompute

if TYPE_CHECKING:
    import pyarrow as pa


def read_meta(run: Path | RemotePath, name: str) -> dict | None:
    p = RunLayout(run).scenario(name).meta
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, StorageError, ValueError):
        return None


def scenario_is_fresh(rd: RunDir, name: str, overrides: Mapping[str, Any] | None, steps: list[int]) -> bool:
    """True when scenario ``name`` exists with per-token outputs, was computed with exactly
    ``overrides`` from the current batch files (same SHA-256) and config file, and covers
    ``steps``."""
    meta = read_meta(rd.path, name)
    if meta is None or not meta.get("save_tokens"):
        return False
    if overrides is not None and meta.get("overrides", {}) != dict(overrides):
        return False
    covered = set(meta.get("steps_done", [])) | {int(s) for s in meta.get("steps_failed", {})}
    if not set(steps) <= covered:
        return False
    recorded = {i["step"]: i for i in meta.get("inputs", [])}
    files = {sf.step: sf for sf in rd.step_files()}
    for step in steps:
        sf, rec = files.get(step), recorded.get(step)
        if sf is None or rec is None or rec["file"] != str(relative_to(sf.path, rd.path)):
            return False
        if rec["size"] != sf.path.stat().st_size or rec["sha256"] != sha256_file(sf.path):
            return False
    cf = find_config_file(rd.path)
    if cf is None:
        return meta.get("config_file") is None
    return meta.get("config_sha256") == sha256_file(cf)


def ensure_scenario(
    run: str | Path | RemotePath,
    name: str,
    overrides: Mapping[str, Any] | None = None,
    steps: str | None = None,
    device: str = "auto",
    progress: ProgressFn | None = None,
) -> bool:
    """Make sure scenario ``name`` exists with per-token outputs for ``steps``.

    ``overrides`` None means "the scenario's own overrides" (it must exist then). Returns True
    when it was (re)computed, False when the existing one was reused.
    """
    rd = RunDir(run)
    chosen = parse_steps(steps, [sf.step for sf in rd.require_steps()])
    if overrides is None:
        meta = read_meta(rd.path, name)
        if meta is None:
            have = ", ".join(list_scenarios(rd.path)) or "none"
            raise RunDirError(f"no scenario {name!r} in {rd.path} (have: {have}); run `rldiag recompute` first")
        overrides = meta.get("overrides", {})
        if steps is None:
            done = set(meta.get("steps_done", [])) | {int(s) for s in meta.get("steps_failed", {})}
            chosen = [s for s in chosen if s in done] or chosen
    if scenario_is_fresh(rd, name, overrides, chosen):
        return False
    spec = ",".join(str(s) for s in chosen)
    recompute(rd.path, dict(overrides), name=name, steps=spec, device=device, save_tokens=True, progress=progress)
    return True


def step_tokens(run: str | Path | RemotePath, step: int, scenario: str = "baseline", device: str = "cpu") -> pa.Table:
    """One step's per-token values under scenario ``scenario``: its saved
    ``tokens/step_<N>.parquet`` when it has one, else the step recomputed with the scenario's
    overrides (from its ``scenario.json``; none for a ``baseline`` not written yet) into a
    temporary directory, read and removed: nothing is written into the run, so a run rldiag may
    not write into works too. One row per batch row: ``row`` and the list columns of
    docs/run-directory.md."""
    rd = RunDir(run)
    step = int(step)
    if step not in {sf.step for sf in rd.step_files()}:
        raise RunDirError(f"{rd.batches_dir}: no batch file for step {step}")
    saved = rd.layout.scenario(scenario).tokens_file(step)
    meta = read_meta(rd.path, scenario)
    if meta is not None and saved.is_file():
        source, fs = arrow_source(saved)
        return read_parquet(source, filesystem=fs)
    if meta is None and scenario != "baseline":
        have = ", ".join(list_scenarios(rd.path)) or "none"
        raise RunDirError(f"no scenario {scenario!r} in {rd.path} (have: {have}); run `rldiag recompute` first")
    overrides = dict((meta or {}).get("overrides", {}))
    with tempfile.TemporaryDirectory(prefix="rldiag-step-tokens-") as tmp:
        target = ScenarioLayout(Path(tmp) / "scenario")
        rep = recompute(rd.path, overrides, name=scenario, steps=str(step), device=device, save_tokens=True,
                        reuse=False, target=target)
        if step in rep.steps_failed:
            raise ComputeError(f"step {step} under scenario {scenario!r}: {rep.steps_failed[step]}")
        return read_parquet(str(target.tokens_file(step)))
