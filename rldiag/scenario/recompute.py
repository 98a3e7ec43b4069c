"""``rldiag recompute``: stream a run's steps through the engine and write a scenario.

The driver here plans the steps (:mod:`rldiag.scenario.plan`: which ones, which previous results
may be reused), hands them to an executor (:mod:`rldiag.executors`: this process by default, or a
Ray cluster) and writes what comes back, in step order, into the scenario
(:class:`rldiag.scenario.write.ScenarioWriter`). Executors load one step at a time and pack steps
up to a token budget, so memory does not grow with the number of steps. A step that fails (bad
input, or an input on which verl would raise) is recorded with its error and the others go on;
what succeeded is written either way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import closing
from pathlib import Path
from typing import Any

from rldiag.config.settings import resolve_settings, scenario_slug, unchanged_overrides, unchanged_warning
from rldiag.errors import ConfigError, RunDirError
from rldiag.executors import Executor, get_executor
from rldiag.executors.steps import DEFAULT_CHUNK_STEPS, DEFAULT_PACK_TOKENS, Job
from rldiag.io.fs import RemotePath
from rldiag.io.run_layout import ScenarioLayout
from rldiag.io.rundir import RunDir, Steps, parse_steps
from rldiag.scenario.behind import behind
from rldiag.scenario.plan import Previous, check_name, check_settings, plan_steps, previous
from rldiag.scenario.sampling import SampledRun
from rldiag.scenario.write import ScenarioReport, ScenarioWriter

__all__ = ["ProgressFn", "follow", "recompute"]

#: ``progress(done, total, step)``: ``done`` of ``total`` steps finished, ``step`` the last one
ProgressFn = Callable[[int, int, int], None]


def recompute(
    run: str | Path | RemotePath,
    overrides: Mapping[str, Any] | None = None,
    name: str | None = None,
    steps: Steps = None,
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

    ``run`` is a directory or an object-store URI (``s3://bucket/run``). ``steps``: a ``--steps``
    spec or the step numbers (:func:`rldiag.io.rundir.parse_steps`; None: every step). Steps whose
    input file and settings are unchanged since the last run of the same scenario are reused
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
    check_name(name)
    if chunk_steps < 1:
        raise ConfigError(f"chunk_steps must be >= 1, not {chunk_steps}")
    files = {sf.step: sf for sf in rd.require_steps()}
    chosen = parse_steps(steps, sorted(files))
    target = target or rd.layout.scenario(name)
    prev = previous(rd.path, name, settings, save_tokens, target) if reuse else Previous()
    ex = get_executor(executor)
    owned = isinstance(executor, str)
    sample = SampledRun.of(rd, settings, files, chosen)
    try:
        dev = ex.start(device)
        if sample is not None and sample.logged_kl:
            pack_tokens = 1  # one step a pack: a logged statistic stands in for a sampled step's
        job = Job(settings=settings, device=dev, save_tokens=save_tokens, pack_tokens=pack_tokens)
        plan = plan_steps(rd, files, chosen, job, prev, chunk_steps)
        if sample is not None:
            plan.logged_kl = sample.logged_kl
        report = ScenarioReport(name=name, path=target.dir, settings=settings, device=dev, executor=ex.name,
                                warnings=override_warnings(rd, overrides))
        with ScenarioWriter(target, report, prev, overrides, save_tokens) as writer:
            # each step written on a thread of its own while the engine computes the next (a step's
            # token table, with save_tokens, is too large to hold one more of: written here)
            with closing(ex.run(plan)) as outcomes, behind(writer.record, threaded=not save_tokens) as writes:
                for i, out in enumerate(outcomes, 1):
                    writes.put(out)
                    if progress:
                        progress(i, len(chosen), out.step)
            extra = sample.mark(report) if sample is not None else None
            writer.commit(time.perf_counter() - t0, extra)
    finally:
        if owned:
            ex.close()
    return report


def override_warnings(rd: RunDir, overrides: Mapping[str, Any]) -> list[str]:
    """A warning when some overrides set a key to the run's own value (the what-if changes
    nothing there; :func:`rldiag.config.settings.unchanged_overrides`)."""
    if not overrides:
        return []
    same = unchanged_overrides(resolve_settings(rd.path, {}), overrides)
    return [unchanged_warning(same, len(same) == len(overrides))] if same else []


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
        return _follow(ex, run, overrides, name, poll_seconds, idle_timeout, on_update, kwargs)
    finally:
        if isinstance(spec, str):
            ex.close()


def _follow(ex: Executor, run: str | Path | RemotePath, overrides: Mapping[str, Any] | None, name: str | None,
            poll_seconds: float, idle_timeout: float | None, on_update: Callable[[ScenarioReport], None] | None,
            kwargs: dict[str, Any]) -> ScenarioReport:
    """:func:`follow`'s loop on a started executor ``ex`` (kept for every re-run)."""
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
