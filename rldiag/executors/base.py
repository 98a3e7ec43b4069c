"""The interface every executor implements, and the plan it is given."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Protocol

from rldiag.executors.steps import Job, StepOutcome, StepTask


@dataclass
class Plan:
    """One recompute as an executor sees it."""

    job: Job
    tasks: list[StepTask]  # the chosen steps, in step order
    # adaptive KL: the run's steps left out before the last chosen one, in step order
    replay: list[StepTask] = field(default_factory=list)
    # adaptive KL on a run captured under a capture policy: {step: (logged current_kl, rows)} of the
    # steps whose batch is not whole (rldiag.executors.klchain.LoggedKL)
    logged_kl: dict[int, tuple[float, int]] = field(default_factory=dict)


class Executor(Protocol):
    """Runs a :class:`Plan`; the driver (:func:`rldiag.scenario.recompute.recompute`) writes what it yields.

    ``start`` connects to what runs the steps and resolves ``--device`` there (returns e.g.
    ``"cpu"``, ``"cuda"``); ``run`` yields one :class:`StepOutcome` per task, in step order, so
    that the driver keeps memory flat and owns every write (a generator: the driver closes it, so
    that the executor's clean-up runs even when the driver stops early); ``close`` releases what
    ``start`` acquired. ``start`` may be called again on a started executor (``--follow``).
    """

    name: str

    def start(self, device: str) -> str: ...

    def run(self, plan: Plan) -> Generator[StepOutcome, None, None]: ...

    def close(self) -> None: ...
