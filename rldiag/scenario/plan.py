"""A scenario's plan: its settings checked, what an earlier write left for reuse, and its steps
cut into the chunks an executor runs (:class:`rldiag.executors.Plan`).

Shared by every driver: :func:`rldiag.scenario.recompute.recompute` (one scenario),
:func:`rldiag.scenario.sweep.sweep` (many, from one read of each file) and
:func:`rldiag.scenario.memory.recompute_in_memory` (nothing written). A scenario planned here the
same way gives the same packs, so the same bits, whichever of them runs it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from rldiag.config.settings import Settings
from rldiag.config.verl_versions import version_of
from rldiag.engine.advantage import ESTIMATORS
from rldiag.engine.aggregation import AGG_MODES
from rldiag.engine.kl import KL_ESTIMATORS
from rldiag.engine.microbatch import check_microbatch_settings
from rldiag.engine.pipeline import initial_kl_state
from rldiag.engine.policy_loss import POLICY_LOSSES
from rldiag.engine.rollout_correction import CorrectionConfig
from rldiag.errors import ConfigError, RldiagError
from rldiag.executors import Plan
from rldiag.executors.klchain import is_adaptive
from rldiag.executors.steps import Job, StepTask
from rldiag.io.file_hash import known_inputs
from rldiag.io.fs import RemotePath, is_remote, relative_to
from rldiag.io.outputs import json_safe, list_scenarios, read_scenario_at
from rldiag.io.run_layout import RunLayout, ScenarioLayout
from rldiag.io.rundir import RunDir, StepFile
from rldiag.version import __version__

__all__ = ["Previous", "check_name", "check_settings", "chunk_ids", "equal_scenario", "known_inputs", "plan_steps",
           "previous", "rescored", "reusable_steps"]


def check_settings(settings: Settings) -> None:
    """Fail before any work on a setting whose registry key is unknown."""
    for registry, key in ((ESTIMATORS, settings.estimator),
                          (POLICY_LOSSES, settings["actor_rollout_ref.actor.policy_loss.loss_mode"])):
        check = registry.meta(key).check  # the entry's own rule on its settings, where it has one
        if check is not None:
            check(settings)
    AGG_MODES.get(settings.actor_agg_mode)
    AGG_MODES.get(settings.critic_agg_mode)
    if settings["algorithm.use_kl_in_reward"]:
        KL_ESTIMATORS.get(settings["algorithm.kl_penalty"])
        initial_kl_state(settings)
    if settings["actor_rollout_ref.actor.use_kl_loss"]:
        KL_ESTIMATORS.get(settings["actor_rollout_ref.actor.kl_loss_type"])
    CorrectionConfig.from_settings(settings, "algorithm.rollout_correction")
    check_microbatch_settings(settings)
    version_of(settings)


def check_name(name: str, what: str = "scenario") -> None:
    """A scenario's (or sweep's) name is one path component, not hidden (``--name``)."""
    if "/" in name or name.startswith(".") or not name.strip():
        raise ConfigError(f"--name {name!r}: a {what} name is one path component, not hidden")


@dataclass
class Previous:
    """What an earlier run of the same scenario left that can be reused, and the input records
    (file, size, mtime, SHA-256) other scenarios of the run hold."""

    inputs: dict[int, dict] = field(default_factory=dict)
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    token_steps: set[int] = field(default_factory=set)  # steps with a tokens file
    row_steps: set[int] = field(default_factory=set)  # steps with a per-row file
    reusable: bool = False
    known: dict[str, dict] = field(default_factory=dict)  # input records by file, any scenario
    # another scenario of the run equal by resolved settings (whatever its name), whose files a
    # reused step is copied or hard-linked from (None: the scenario's own last write)
    reused_from: str | None = None
    source: ScenarioLayout | None = None

    def may_reuse(self, step: int, save_tokens: bool) -> bool:
        """Step ``step``'s results may be reused, should its batch file be unchanged (the
        executor checks that: size, mtime, SHA-256)."""
        return (self.reusable and step in self.metrics and step in self.row_steps
                and (not save_tokens or step in self.token_steps))


def previous(run: Path | RemotePath, name: str, settings: Settings, save_tokens: bool,
             target: ScenarioLayout | None = None, known: dict[str, dict] | None = None) -> Previous:
    """What the scenario ``name``'s last write left for reuse (``target``: its directory, when not
    the run's ``scenarios/<name>/``); ``known``: the run's input records by file, when the caller
    has them (default: :func:`known_inputs`)."""
    target = target or RunLayout(run).scenario(name)
    known = known_inputs(run, name) if known is None else known
    own = _previous_at(target, settings, save_tokens, known)
    if own.reusable and own.metrics:
        return own
    other = equal_scenario(run, name, settings, save_tokens, exclude=target)
    if other is None:
        return own
    found = _previous_at(RunLayout(run).scenario(other), settings, save_tokens, known)
    if not found.reusable:
        return own
    found.reused_from, found.source = other, RunLayout(run).scenario(other)
    return found


def rescored(meta: Mapping[str, Any]) -> bool:
    """Whether a scenario.json is a re-scored scenario's (``rldiag rescore``: its ``reward``
    record): its scores are not the batches', so its steps are never reused by a recompute, under
    its own name or another's, whatever its settings."""
    return bool(meta.get("reward"))


def equal_scenario(run: Path | RemotePath, name: str, settings: Settings, save_tokens: bool,
                   exclude: ScenarioLayout | None = None) -> str | None:
    """Another complete scenario of the (local) run whose resolved settings equal ``settings``
    (written by this rldiag version, with per-token files when ``save_tokens``): the one with the
    most steps done, None when there is none. Its steps are then reused whatever its name."""
    if is_remote(run) or is_adaptive(settings):
        return None
    want = json.loads(json.dumps(json_safe(settings.resolved())))
    layout = RunLayout(run)
    best: tuple[int, str] | None = None
    for other in list_scenarios(run):
        sl = layout.scenario(other)
        if other == name or (exclude is not None and sl.dir == exclude.dir):
            continue
        try:
            meta = json.loads(sl.meta.read_text())
        except (OSError, ValueError):
            continue
        if (meta.get("rldiag_version") != __version__ or meta.get("settings") != want or rescored(meta)
                or (save_tokens and not meta.get("save_tokens"))):
            continue
        done = len(meta.get("steps_done", []))
        if best is None or done > best[0]:
            best = (done, other)
    return None if best is None else best[1]


def _previous_at(target: ScenarioLayout, settings: Settings, save_tokens: bool, known: dict[str, dict]) -> Previous:
    """What the scenario written at ``target`` left for reuse under ``settings``."""
    if not target.meta.is_file():
        return Previous(known=known)
    try:
        meta, table = read_scenario_at(target)
    except (RldiagError, OSError, ValueError, pa.ArrowException):
        return Previous(known=known)
    inputs = {int(i["step"]): i for i in meta.get("inputs", [])}
    same = (
        meta.get("rldiag_version") == __version__
        and not rescored(meta)
        and meta.get("settings") == json.loads(json.dumps(json_safe(settings.resolved())))
        and (meta.get("save_tokens") or not save_tokens)
        # an adaptive KL coefficient depends on every earlier step: no reuse
        and not is_adaptive(settings)
    )
    done = set(meta.get("steps_done", []))
    metrics = {int(r["step"]): r for r in table.to_pylist() if int(r["step"]) in done}
    token_steps: set[int] = set(target.token_steps()) if save_tokens and same else set()
    row_steps: set[int] = set(target.row_steps()) if same else set()
    return Previous(inputs=inputs, metrics=metrics, token_steps=token_steps, row_steps=row_steps, reusable=same,
                    known=known)


def reusable_steps(run: Path | RemotePath, name: str, settings: Settings, save_tokens: bool) -> list[int]:
    """The steps a recompute of scenario ``name`` under ``settings`` would reuse should their
    batch files be unchanged (what :func:`previous` found, as :func:`plan_steps` decides it),
    in step order."""
    prev = previous(run, name, settings, save_tokens, known={})
    return sorted(s for s in prev.metrics if prev.may_reuse(s, save_tokens))


def plan_steps(rd: RunDir, files: dict[int, StepFile], chosen: list[int], job: Job, prev: Previous,
               chunk_steps: int) -> Plan:
    """The executor's plan of the ``chosen`` steps (in order) of the run's ``files``: chunks of
    at most ``chunk_steps`` steps, each step marked reusable where ``prev`` allows it; under an
    adaptive KL controller, the run's steps left out before the last chosen one replayed."""
    def task(step: int, chunk: int) -> StepTask:
        sf = files[step]
        rel = str(relative_to(sf.path, rd.path))
        reusable = prev.may_reuse(step, job.save_tokens)
        # results are reused only from this scenario; a file's hash may come from any scenario
        earlier = prev.inputs.get(step) if reusable else (prev.inputs.get(step) or prev.known.get(rel))
        return StepTask(step=step, file=str(sf.path), rel=rel, chunk=chunk, previous=earlier, reusable=reusable)

    if not is_adaptive(job.settings):
        return Plan(job=job, tasks=[task(s, i // chunk_steps) for i, s in enumerate(chosen)])
    # adaptive KL: a step's coefficient depends on every run step before it, so the steps left
    # out before the last chosen one are replayed; no chunk (so no pack) spans a step of the
    # other kind, and the chain takes both in step order
    order = sorted(files)
    position = {s: i for i, s in enumerate(order)}
    picked = set(chosen)
    left_out = [s for s in order if s < chosen[-1] and s not in picked]
    tasks = [task(s, c) for s, c in zip(chosen, chunk_ids(chosen, position, chunk_steps))]
    replay = [task(s, c) for s, c in zip(left_out, chunk_ids(left_out, position, chunk_steps))]
    return Plan(job=job, tasks=tasks, replay=replay)


def chunk_ids(steps: list[int], position: dict[int, int], chunk_steps: int) -> list[int]:
    """Chunks of at most ``chunk_steps`` of ``steps`` (in order), a new one wherever a run step
    not in ``steps`` lies between two of them (``position``: each step's place in the run). For
    the run's first steps, these are the chunks a recompute of every step makes."""
    ids: list[int] = []
    chunk, size = 0, 0
    for i, s in enumerate(steps):
        if i and (size == chunk_steps or position[s] != position[steps[i - 1]] + 1):
            chunk, size = chunk + 1, 0
        ids.append(chunk)
        size += 1
    return ids
