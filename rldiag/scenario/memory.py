"""Scenarios recomputed in memory: nothing written into the run.

:func:`recompute_in_memory` plans each settings' scenario as ``rldiag recompute --steps`` plans
it (:func:`rldiag.scenario.plan.plan_steps`: the same chunks and packs, so the same bits; no
reuse, no tokens) and runs them all on the sweep executor
(:class:`rldiag.executors.sweep.SweepExecutor`): one read of each step file, each engine stage
run once for the scenarios that agree on its settings. What the doctor's counterfactuals use.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

from rldiag.config.settings import Settings
from rldiag.executors.steps import DEFAULT_CHUNK_STEPS, Job
from rldiag.io.fs import RemotePath
from rldiag.io.rundir import RunDir, Steps, parse_steps
from rldiag.scenario.plan import Previous, plan_steps

__all__ = ["InMemoryScenario", "recompute_in_memory"]


@dataclass
class InMemoryScenario:
    """One settings' recompute of the chosen steps, in memory."""

    settings: Settings
    #: step -> its metrics (verl's names; a metric the step does not give is left out)
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)  # step -> why


def recompute_in_memory(run: str | Path | RemotePath | RunDir, settings_list: Sequence[Settings],
                        steps: Steps = None, device: str = "cpu") -> list[InMemoryScenario]:
    """Each of ``settings_list``'s recompute of ``steps`` (a ``--steps`` spec or step numbers;
    None: every step) of ``run``, in memory, in the order given. One read of each step file;
    each scenario's metrics are those ``rldiag recompute --steps ... --no-reuse`` writes under
    the same settings, bit for bit. Raises :class:`~rldiag.errors.RldiagError` for what stops
    them all (no batch file, a step that does not exist); a step that fails is in ``failed``."""
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
        with closing(ex.run(plans)) as outcomes:
            for i, o in outcomes:
                if o.status == "done" and o.metrics is not None:
                    out[i].metrics[o.step] = {k: float(v) for k, v in o.metrics.items()
                                              if k != "step" and v is not None}
                else:
                    out[i].failed[o.step] = o.error or o.status
    finally:
        ex.close()
    return out
