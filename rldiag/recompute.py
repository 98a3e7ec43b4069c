"""``rldiag recompute``: stream a run's steps through the engine and write a scenario.

The driver here plans the steps (which ones, which previous results may be reused), hands them to
an executor (:mod:`rldiag.executors`: this process by default, or a Ray cluster) and writes what
comes back, in step order, into the scenario (:mod:`rldiag.io.staged`: a staging
directory swapped in atomically on disk; ``scenario.json`` last on an object store). Executors
load one step at a time and pack steps up to a token budget, so memory does not grow with the
number of steps. A step that fails (bad input, or an input on which verl would raise) is recorded
with its error and the others go on; what succeeded is written either way.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from contextlib import closing
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa

from rldiag.config.settings import Settings, resolve_settings, scenario_slug
from rldiag.config.verl_versions import version_of
from rldiag.engine.advantage import ESTIMATORS
from rldiag.engine.aggregation import AGG_MODES
from rldiag.engine.kl import KL_ESTIMATORS
from rldiag.engine.microbatch import check_microbatch_settings
from rldiag.engine.pipeline import initial_kl_state
from rldiag.engine.policy_loss import POLICY_LOSSES
from rldiag.engine.rollout_correction import CorrectionConfig
from rldiag.errors import ConfigError, RldiagError, RunDirError
from rldiag.executors import Executor, Plan, get_executor
from rldiag.executors.device import resolve_device
from rldiag.executors.klchain import is_adaptive
from rldiag.executors.steps import DEFAULT_CHUNK_STEPS, DEFAULT_PACK_TOKENS, PREFETCH, Job, StepOutcome, StepTask
from rldiag.io.fs import RemotePath, as_path, is_remote, relative_to
from rldiag.io.outputs import json_safe, list_scenarios, metrics_table, read_scenario_at, sha256_file
from rldiag.io.run_layout import RunLayout, ScenarioLayout
from rldiag.io.rundir import RunDir, StepFile, parse_steps
from rldiag.io.staged import StagedWriter, open_staged
from rldiag.version import __version__

__all__ = [
    "DEFAULT_CHUNK_STEPS", "DEFAULT_PACK_TOKENS", "PREFETCH", "ScenarioReport", "check_settings", "follow",
    "recompute", "resolve_device",
]

ProgressFn = Callable[[int, int, int], None]


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


@dataclass
class ScenarioReport:
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

    @property
    def ok(self) -> bool:
        return not self.steps_failed


@dataclass
class _Previous:
    """What an earlier run of the same scenario left that can be reused, and the input records
    (file, size, mtime, SHA-256) other scenarios of the run hold."""

    inputs: dict[int, dict] = field(default_factory=dict)
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    token_steps: set[int] = field(default_factory=set)  # steps with a tokens file
    row_steps: set[int] = field(default_factory=set)  # steps with a per-row file
    reusable: bool = False
    known: dict[str, dict] = field(default_factory=dict)  # input records by file, any scenario


def _known_inputs(run: Path | RemotePath, exclude: str) -> dict[str, dict]:
    """Input records of the run's other complete scenarios, by file (the newest hash first).

    A file whose size and modification time still match such a record keeps its SHA-256
    without being hashed again (:func:`rldiag.executors.steps.known_hash`): a second scenario
    of the same run (another estimator, say) reads its files but does not hash them. Local runs
    only: on an object store each scenario's record is one more request.
    """
    if is_remote(run):
        return {}
    known: dict[str, dict] = {}
    layout = RunLayout(run)
    metas = []
    for name in list_scenarios(run):
        if name == exclude:
            continue
        try:
            metas.append(json.loads(layout.scenario(name).meta.read_text()))
        except (OSError, ValueError):
            continue
    for meta in sorted(metas, key=lambda m: str(m.get("created", ""))):  # newer records win
        for rec in meta.get("inputs", []) if isinstance(meta.get("inputs"), list) else []:
            if isinstance(rec, dict) and rec.get("file") and rec.get("sha256") and "size" in rec and "mtime_ns" in rec:
                known[str(rec["file"])] = rec
    return known


def _previous(run: Path | RemotePath, name: str, settings: Settings, save_tokens: bool,
              target: ScenarioLayout | None = None, known: dict[str, dict] | None = None) -> _Previous:
    """What the scenario ``name``'s last write left for reuse (``target``: its directory, when not
    the run's ``scenarios/<name>/``); ``known``: the run's input records by file, when the caller
    has them (default: :func:`_known_inputs`)."""
    target = target or RunLayout(run).scenario(name)
    known = _known_inputs(run, name) if known is None else known
    if not target.meta.is_file():
        return _Previous(known=known)
    try:
        meta, table = read_scenario_at(target)
    except (RldiagError, OSError, ValueError, pa.ArrowException):
        return _Previous(known=known)
    inputs = {int(i["step"]): i for i in meta.get("inputs", [])}
    same = (
        meta.get("rldiag_version") == __version__
        and meta.get("settings") == json.loads(json.dumps(json_safe(settings.resolved())))
        and (meta.get("save_tokens") or not save_tokens)
        # an adaptive KL coefficient depends on every earlier step: no reuse
        and not is_adaptive(settings)
    )
    done = set(meta.get("steps_done", []))
    metrics = {int(r["step"]): r for r in table.to_pylist() if int(r["step"]) in done}
    token_steps: set[int] = set(target.token_steps()) if save_tokens and same else set()
    row_steps: set[int] = set(target.row_steps()) if same else set()
    return _Previous(inputs=inputs, metrics=metrics, token_steps=token_steps, row_steps=row_steps, reusable=same,
                     known=known)


def _plan(rd: RunDir, files: dict[int, StepFile], chosen: list[int], job: Job, prev: _Previous,
          chunk_steps: int) -> Plan:
    def task(step: int, chunk: int) -> StepTask:
        sf = files[step]
        rel = str(relative_to(sf.path, rd.path))
        reusable = (prev.reusable and step in prev.metrics and step in prev.row_steps
                    and (not job.save_tokens or step in prev.token_steps))
        # results are reused only from this scenario; a file's hash may come from any scenario
        previous = prev.inputs.get(step) if reusable else (prev.inputs.get(step) or prev.known.get(rel))
        return StepTask(step=step, file=str(sf.path), rel=rel, chunk=chunk, previous=previous, reusable=reusable)

    if not is_adaptive(job.settings):
        return Plan(job=job, tasks=[task(s, i // chunk_steps) for i, s in enumerate(chosen)])
    # adaptive KL: a step's coefficient depends on every run step before it, so the steps left
    # out before the last chosen one are replayed; no chunk (so no pack) spans a step of the
    # other kind, and the chain takes both in step order
    order = sorted(files)
    position = {s: i for i, s in enumerate(order)}
    picked = set(chosen)
    left_out = [s for s in order if s < chosen[-1] and s not in picked]
    tasks = [task(s, c) for s, c in zip(chosen, _chunk_ids(chosen, position, chunk_steps))]
    replay = [task(s, c) for s, c in zip(left_out, _chunk_ids(left_out, position, chunk_steps))]
    return Plan(job=job, tasks=tasks, replay=replay)


def _chunk_ids(steps: list[int], position: dict[int, int], chunk_steps: int) -> list[int]:
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


def _record(out: StepOutcome, report: ScenarioReport, prev: _Previous, writer: StagedWriter, save_tokens: bool) -> None:
    """One executor outcome into the report and the scenario being written."""
    tokens_rel = ScenarioLayout.tokens_rel(out.step)
    rows_rel = ScenarioLayout.rows_rel(out.step)
    if out.status == "failed":
        assert out.error is not None  # a failed outcome says why
        report.steps_failed[out.step] = out.error
        if out.traceback:
            report.internal[out.step] = out.traceback
        return
    if out.status == "reused":
        row = dict(prev.metrics[out.step])
        report.metrics.append({k: v for k, v in row.items() if v is not None or k == "step"})
        if save_tokens:
            writer.keep(tokens_rel)
        writer.keep(rows_rel)
        report.steps_reused.append(out.step)
    else:
        assert out.metrics is not None  # a computed step has its metrics row
        report.metrics.append(out.metrics)
        if out.tokens is not None:
            writer.write_table(tokens_rel, out.tokens)
        if out.row_table is not None:
            writer.write_table(rows_rel, out.row_table, compression="zstd")
        report.rows += out.rows
        report.tokens += out.n_tokens
    report.steps_done.append(out.step)


def recompute(
    run: str | Path | RemotePath,
    overrides: Mapping[str, Any] | None = None,
    name: str | None = None,
    steps: str | None = None,
    device: str = "auto",
    save_tokens: bool = False,
    progress: ProgressFn | None = None,
    pack_tokens: int = DEFAULT_PACK_TOKENS,
    reuse: bool = True,
    executor: str | Executor = "local",
    chunk_steps: int = DEFAULT_CHUNK_STEPS,
    target: ScenarioLayout | None = None,
) -> ScenarioReport:
    """Recompute a run under its own settings plus ``overrides`` and write the scenario.

    ``run`` is a directory or an object-store URI (``s3://bucket/run``). Steps whose input file
    and settings are unchanged since the last run of the same scenario are reused
    (``reuse=False`` recomputes everything). ``executor``: ``"local"`` (this process; the next
    step's file is read and hashed on a background thread while the current one is computed),
    ``"ray"`` (a Ray cluster), or an :class:`~rldiag.executors.Executor` instance, which is then
    started but not closed here. Every executor writes the same scenario; steps are packed
    within chunks of ``chunk_steps`` consecutive steps (the unit of a Ray task). Returns the
    report; raises :class:`RldiagError` only for problems that stop the whole scenario (unknown
    settings, no batches, no executor). Failed steps are in ``report.steps_failed``. ``target``:
    the scenario's directory when it is not ``RUN/rldiag/scenarios/<name>/`` (a sweep's
    scenario, :attr:`rldiag.io.run_layout.RunLayout.layout_audit`).
    """
    t0 = time.perf_counter()
    rd = RunDir(run)
    overrides = dict(overrides or {})
    settings = resolve_settings(rd.path, overrides)
    check_settings(settings)
    name = name or scenario_slug(overrides)
    if "/" in name or name.startswith(".") or not name.strip():
        raise ConfigError(f"--name {name!r}: a scenario name is one path component, not hidden")
    if chunk_steps < 1:
        raise ConfigError(f"chunk_steps must be >= 1, not {chunk_steps}")
    files = {sf.step: sf for sf in rd.require_steps()}
    chosen = parse_steps(steps, sorted(files))
    target = target or rd.layout.scenario(name)
    prev = _previous(rd.path, name, settings, save_tokens, target) if reuse else _Previous()
    ex = get_executor(executor)
    owned = isinstance(executor, str)
    try:
        dev = ex.start(device)
        job = Job(settings=settings, device=dev, save_tokens=save_tokens, pack_tokens=pack_tokens)
        plan = _plan(rd, files, chosen, job, prev, chunk_steps)
        report = ScenarioReport(name=name, path=target.dir, settings=settings, device=dev, executor=ex.name)
        inputs: list[dict] = []
        dirs = (ScenarioLayout.ROWS, ScenarioLayout.TOKENS) if save_tokens else (ScenarioLayout.ROWS,)
        writer = open_staged(target.dir, marker=ScenarioLayout.META, dirs=dirs)
        try:
            with closing(ex.run(plan)) as outcomes:
                for i, out in enumerate(outcomes, 1):
                    inputs.append(out.info)
                    _record(out, report, prev, writer, save_tokens)
                    if progress:
                        progress(i, len(chosen), out.step)
            report.steps_done.sort()
            writer.write_table(ScenarioLayout.METRICS, metrics_table(report.metrics))
            report.seconds = time.perf_counter() - t0
            writer.commit(_scenario_meta(report, overrides, inputs, save_tokens))
        except BaseException:
            writer.abort()
            raise
    finally:
        if owned:
            ex.close()
    return report


def _scenario_meta(report: ScenarioReport, overrides: dict, inputs: list[dict], save_tokens: bool) -> dict:
    settings = report.settings
    meta = {
        "name": report.name,
        "settings": settings.resolved(),
        "overrides": overrides,
        "config_file": settings.config_file,
        "rldiag_version": __version__,
        "device": report.device,
        "executor": report.executor,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "inputs": inputs,
        "steps_done": report.steps_done,
        "steps_failed": {str(k): v for k, v in sorted(report.steps_failed.items())},
        "steps_reused": sorted(report.steps_reused),
        "save_tokens": save_tokens,
        "seconds": round(report.seconds, 3),
        "rows": report.rows,
        "tokens": report.tokens,
    }
    if settings.config_file:
        meta["config_sha256"] = sha256_file(as_path(settings.config_file))
    return meta


def follow(
    run: str | Path | RemotePath,
    overrides: Mapping[str, Any] | None = None,
    name: str | None = None,
    poll_seconds: float = 2.0,
    idle_timeout: float | None = None,
    on_update: Callable[[ScenarioReport], None] | None = None,
    **kwargs,
) -> ScenarioReport:
    """Keep a scenario up to date with a run that is still writing batches.

    Re-runs :func:`recompute` (reusing every unchanged step) whenever a new or changed batch file
    appears; a file that cannot be read yet (still being written) is retried on the next poll.
    Returns after ``idle_timeout`` seconds without a new file (never, when None: stop with Ctrl-C).
    ``executor`` (in ``kwargs``) is started once and kept for every re-run.
    """
    spec = kwargs.pop("executor", "local")
    ex = get_executor(spec)
    try:
        return _follow(run, overrides, name, poll_seconds, idle_timeout, on_update, ex, kwargs)
    finally:
        if isinstance(spec, str):
            ex.close()


def _follow(run, overrides, name, poll_seconds, idle_timeout, on_update, ex: Executor, kwargs) -> ScenarioReport:
    rd = RunDir(run)
    seen: dict[int, tuple[int, int]] | None = None
    last_change = time.monotonic()
    report: ScenarioReport | None = None
    while True:
        state = rd.listing()
        # a file that could not be read yet changes (size or mtime) when its writer finishes,
        # so looking at the listing is enough: no re-run while nothing changed
        if state and state != seen:
            report = recompute(run, overrides, name=name, executor=ex, **kwargs)
            seen = state
            if on_update:
                on_update(report)
            # idle from here: the time the re-run (and the caller) took is not time without news
            last_change = time.monotonic()
        if idle_timeout is not None and time.monotonic() - last_change >= idle_timeout:
            if report is None:
                raise RunDirError(f"no batch file appeared in {rd.batches_dir} within {idle_timeout:g} s")
            return report
        time.sleep(poll_seconds)
