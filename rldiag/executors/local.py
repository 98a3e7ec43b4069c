"""``--executor local`` (the default): every step in this process. The next step's file is read
and hashed on a background thread while the current pack is computed."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rldiag.engine.pipeline import initial_kl_state
from rldiag.executors.allocator import engine_threads, tune_host_allocator
from rldiag.executors.base import Plan
from rldiag.executors.device import resolve_device
from rldiag.executors.klchain import replay_statistic
from rldiag.executors.steps import StepOutcome, fetch, prefetched, process


class LocalExecutor:
    name = "local"

    def start(self, device: str) -> str:
        resolved = str(resolve_device(device))
        tune_host_allocator()
        return resolved

    def run(self, plan: Plan) -> Iterator[StepOutcome]:
        job = plan.job
        settings = job.settings
        kl_state = initial_kl_state(settings) if settings["algorithm.use_kl_in_reward"] else None
        for task in plan.replay:  # the coefficient of a step depends on every step before it
            stat = replay_statistic(task.step_file(), settings)
            if stat is not None:
                kl_state.advance(settings, *stat)
        pin = torch.device(job.device).type == "cuda"
        fetched = prefetched(plan.tasks, lambda t: fetch(t, job, pin=pin))
        # the engine keeps one core fewer than the process may use for the whole run, the last
        # packs included: torch's intra-op threads wait for each other at every operation, and
        # where a core is busy (the loader, the writer, another process) each wait lasts a time
        # slice of the scheduler, far longer than the operation (bench/bench_recompute.py --threads)
        with engine_threads(job.device):
            yield from process(fetched, job, lambda steps: kl_state)

    def close(self) -> None:
        """Nothing to release: the executor holds no resources between runs."""
