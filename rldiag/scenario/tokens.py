"""Per-token outputs on demand: a scenario an analysis needs, reused when it is up to date with
its per-token outputs, else (re)computed with ``save_tokens`` (:func:`ensure_scenario`); one
step's tokens, from the scenario or its token cache (``RUN/rldiag/cache/<name>/``,
:func:`step_tokens`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rldiag.config.settings import find_config_file
from rldiag.errors import RunDirError, StorageError
from rldiag.io.fs import RemotePath, relative_to
from rldiag.io.outputs import list_scenarios, sha256_file
from rldiag.io.run_layout import RunLayout
from rldiag.io.rundir import RunDir, Steps, parse_steps
from rldiag.scenario.recompute import ProgressFn, recompute

__all__ = ["CACHE_STEPS", "StepTokens", "ensure_scenario", "read_meta", "scenario_is_fresh", "step_tokens"]


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
    steps: Steps = None,
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
        if RESCORED_KEY in meta:  # a rescore's scores are not a recompute's: never recomputed as one
            return False
        if steps is None:
            done = set(meta.get("steps_done", [])) | {int(s) for s in meta.get("steps_failed", {})}
            chosen = [s for s in chosen if s in done] or chosen
    if scenario_is_fresh(rd, name, overrides, chosen):
        return False
    recompute(rd.path, dict(overrides), name=name, steps=chosen, device=device, save_tokens=True, progress=progress)
    return True


#: the key of scenario.json that marks a rescored scenario (rldiag rescore): its scores came from a
#: reward function, so it is never recomputed from the batch files' own scores
RESCORED_KEY = "reward"

#: steps whose on-demand per-token outputs a scenario's token cache keeps (the nearest to the step asked for)
CACHE_STEPS = 32


@dataclass
class StepTokens:
    """Where one step's per-token outputs of a scenario are (:func:`step_tokens`)."""

    step: int
    scenario: str
    #: the tokens file; None when the step could not be computed (``error`` says why)
    path: Path | RemotePath | None
    #: ``"scenario"`` (the scenario saved them), ``"cache"`` (the token cache had or got them)
    source: str
    error: str | None = None
    computed: bool = False  # recomputed by this call (not found)


def step_tokens(
    run: str | Path | RemotePath,
    step: int,
    name: str = "baseline",
    device: str = "cpu",
    progress: ProgressFn | None = None,
) -> StepTokens:
    """Step ``step``'s per-token outputs of scenario ``name``: its own tokens file when it saved
    one, else those of its token cache (``RUN/rldiag/cache/<name>/``, laid out as a scenario),
    recomputed there for this step (with the scenario's overrides; none for a scenario not
    written yet, which must then be the run's own settings, ``baseline``) unless the cache is
    current for it. The cache keeps the :data:`CACHE_STEPS` steps nearest to the last one asked
    for; each recompute reuses the cached steps whose batch file and settings did not change."""
    from rldiag.config.settings import scenario_slug
    from rldiag.errors import ConfigError

    rd = RunDir(run)
    files = [sf.step for sf in rd.require_steps()]
    step = int(step)
    if step not in files:
        raise RunDirError(f"{rd.batches_dir}: no batch file for step {step}")
    own = rd.layout.scenario(name)
    if own.tokens_file(step).is_file():
        return StepTokens(step, name, own.tokens_file(step), "scenario")
    meta = read_meta(rd.path, name)
    if meta is not None and RESCORED_KEY in meta:
        return StepTokens(step, name, None, "scenario", error=f"scenario {name!r} is a rescore (rldiag rescore): its "
                          "per-token outputs are those its own --save-tokens wrote; a recompute would lose its scores")
    if meta is not None:
        overrides = dict(meta.get("overrides") or {})
    elif name == scenario_slug({}):
        overrides = {}
    else:
        raise ConfigError(f"no scenario {name!r} in {rd.path}: its per-token outputs cannot be computed")
    cache = rd.layout.token_cache(name)
    kept = sorted((s for s in cache.token_steps() if s != step and s in set(files)), key=lambda s: (abs(s - step), s))
    chosen = sorted({*kept[:CACHE_STEPS - 1], step})
    rep = recompute(rd.path, overrides, name=name, steps=chosen, device=device, save_tokens=True, progress=progress,
                    target=cache)
    if step in rep.steps_failed:
        return StepTokens(step, name, None, "cache", error=rep.steps_failed[step], computed=True)
    return StepTokens(step, name, cache.tokens_file(step), "cache", computed=step not in rep.steps_reused)
