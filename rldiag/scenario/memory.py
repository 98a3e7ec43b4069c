"""Scenarios recomputed in memory: nothing written into the run. The one door for every caller
that recomputes without writing a scenario.

- :func:`recompute_in_memory` (steps x settings, metrics): plans each settings' scenario as
  ``rldiag recompute --steps`` plans it (:func:`rldiag.scenario.plan.plan_steps`: the same chunks
  and packs, so the same bits; no reuse, no tokens) and runs them all on the sweep executor
  (:class:`rldiag.executors.sweep.SweepExecutor`): one read of each step file, each engine stage
  run once for the scenarios that agree on its settings. The doctor's counterfactuals use it,
  and the mismatch diagnosis of a run it may not write into (``rldiag.mismatch(write=False)``).
- :func:`recompute_changed` (the steps of a growing run that are new or changed, metrics): the
  packs a full recompute of the run makes when it reuses every other step, without reading or
  writing the scenario; ``rldiag doctor --follow`` after catching up (its memory and work per
  look do not grow with the run's length).
- :func:`recompute_step` (one step, the engine's whole result, per-token tensors included): the
  step loaded with the columns the recompute reads and recomputed as a pack of its own, under a
  reward-KL controller state the caller carries from step to step. ``rldiag verify`` (which
  compares the per-token values and starts the controller from the logged coefficient) and the
  capture's health hook (steps in the order training writes them, on the writer thread) use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rldiag.config.settings import Settings
from rldiag.executors.base import Plan
from rldiag.executors.steps import DEFAULT_CHUNK_STEPS, Job, StepTask
from rldiag.io.fs import RemotePath, relative_to
from rldiag.io.rundir import RunDir, StepFile, Steps, parse_steps
from rldiag.scenario.plan import Previous, plan_steps

if TYPE_CHECKING:
    from rldiag.engine.pipeline import KLControllerState, PresetKLCoefficients, Result
    from rldiag.io.loader import StepData

__all__ = ["InMemoryScenario", "recompute_changed", "recompute_in_memory", "recompute_step"]


@dataclass
class InMemoryScenario:
    """One settings' recompute of the chosen steps, in memory."""

    settings: Settings
    #: step -> its metrics (verl's names; a metric the step does not give is left out)
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)  # step -> why


def recompute_in_memory(run: str | Path | RemotePath | RunDir, settings_list: Sequence[Settings],
                        steps: Steps = None, device: str = "cpu",
                        progress: Callable[[int, int, int], None] | None = None) -> list[InMemoryScenario]:
    """Each of ``settings_list``'s recompute of ``steps`` (a ``--steps`` spec or step numbers;
    None: every step) of ``run``, in memory, in the order given. One read of each step file;
    each scenario's metrics are those ``rldiag recompute --steps ... --no-reuse`` writes under
    the same settings, bit for bit. ``progress(done, total, step)`` counts scenario-steps.
    Raises :class:`~rldiag.errors.RldiagError` for what stops them all (no batch file, a step
    that does not exist); a step that fails is in ``failed``."""
    from rldiag.executors.sweep import SweepExecutor

    rd = run if isinstance(run, RunDir) else RunDir(run)
    files = {sf.step: sf for sf in rd.require_steps()}
    chosen = parse_steps(steps, sorted(files))
    out = [InMemoryScenario(s) for s in settings_list]
    ex = SweepExecutor()
    try:
        dev = ex.start(device)
        plans = [plan_steps(rd, files, chosen, Job(settings=s, device=dev, save_tokens=False), Previous(),
                            DEFAULT_CHUNK_STEPS) for s in settings_list]
        total = len(chosen) * len(plans)
        with closing(ex.run(plans)) as outcomes:
            for done, (i, o) in enumerate(outcomes, 1):
                if progress is not None:
                    progress(done, total, o.step)
                if o.status == "done" and o.metrics is not None:
                    out[i].metrics[o.step] = {k: float(v) for k, v in o.metrics.items()
                                              if k != "step" and v is not None}
                else:
                    out[i].failed[o.step] = o.error or o.status
    finally:
        ex.close()
    return out


def recompute_changed(run: str | Path | RemotePath | RunDir, settings: Settings, steps: Sequence[int],
                      device: str = "cpu", chunk_steps: int = DEFAULT_CHUNK_STEPS) -> InMemoryScenario:
    """The metrics of ``steps`` (some of the run's steps: the new or changed ones), in memory, on
    the local executor: each step in the pack :func:`rldiag.scenario.recompute.recompute` of
    every step puts it in when it reuses every step not in ``steps``, so the same bits. A pack is
    consecutive steps of one chunk (``chunk_steps`` of the run's steps, in order), and a reused
    step ends the pack before it (:func:`rldiag.executors.steps.packs`): here a chunk is cut at
    both. Not for an adaptive KL controller (each step depends on every step before it:
    :func:`rldiag.executors.klchain.is_adaptive`), which reuses nothing. Raises
    :class:`~rldiag.errors.RldiagError` for what stops them all; a step that fails is in
    ``failed``. Cost: ``len(steps)`` steps read and computed, whatever the run's length."""
    from rldiag.executors.local import LocalExecutor

    rd = run if isinstance(run, RunDir) else RunDir(run)
    files = {sf.step: sf for sf in rd.require_steps()}
    position = {s: i for i, s in enumerate(sorted(files))}
    chosen = sorted(set(steps) & set(files))
    tasks, chunk = [], 0
    for i, s in enumerate(chosen):
        if i and (position[s] != position[chosen[i - 1]] + 1 or position[s] // chunk_steps
                  != position[chosen[i - 1]] // chunk_steps):
            chunk += 1
        tasks.append(StepTask(step=s, file=str(files[s].path), rel=str(relative_to(files[s].path, rd.path)),
                              chunk=chunk))
    out = InMemoryScenario(settings)
    if not tasks:
        return out
    ex = LocalExecutor()
    dev = ex.start(device)
    with closing(ex.run(Plan(job=Job(settings=settings, device=dev, save_tokens=False), tasks=tasks))) as outcomes:
        for o in outcomes:
            if o.status == "done" and o.metrics is not None:
                out.metrics[o.step] = {k: float(v) for k, v in o.metrics.items() if k != "step" and v is not None}
            else:
                out.failed[o.step] = o.error or o.status
    return out


def recompute_step(sf: StepFile, settings: Settings,
                   kl_state: KLControllerState | PresetKLCoefficients | None = None, *,
                   device: torch.device | str = "cpu", source: bytes | None = None,
                   threads: bool = True) -> tuple[StepData, Result]:
    """Step ``sf`` loaded (the columns :func:`~rldiag.engine.requirements.recompute_columns`
    plans; the batch on the CPU) and recomputed on ``device`` under ``settings``: ``(the loaded
    step, the engine's result)``. ``kl_state``: the reward-KL controller before this step
    (advanced by it; None without a KL in the reward). ``source``: the file's bytes when the
    caller holds them (the file is not read again); ``threads=False``: read on this thread alone
    (:func:`rldiag.io.loader.read_table`). A step verl would raise on is in ``result.failed``;
    raises :class:`~rldiag.errors.RldiagError` when the file cannot be loaded."""
    from rldiag.engine.pipeline import recompute_batch
    from rldiag.engine.requirements import recompute_columns
    from rldiag.io.loader import load_step

    data = load_step(sf, settings, recompute_columns(settings), source=source, threads=threads)
    return data, recompute_batch(data.batch.to(device), settings, kl_state)
