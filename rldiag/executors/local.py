"""``--executor local`` (the default): every step in this process. The next step's file is read
and hashed on a background thread while the current pack is computed."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import torch

from rldiag.engine.pipeline import initial_kl_state
from rldiag.executors import allocator
from rldiag.executors.allocator import engine_threads, tune_host_allocator
from rldiag.executors.base import Plan
from rldiag.executors.device import resolve_device
from rldiag.executors.klchain import SequentialChain, is_adaptive, replay_statistics
from rldiag.executors.steps import Fetched, StepOutcome, fetch, large_step, prefetched, process


class LocalExecutor:
    name = "local"

    def start(self, device: str) -> str:
        resolved = str(resolve_device(device))
        tune_host_allocator()
        return resolved

    def run(self, plan: Plan) -> Generator[StepOutcome, None, None]:
        job = plan.job
        settings = job.settings
        kl_state = initial_kl_state(settings) if settings["algorithm.use_kl_in_reward"] else None
        kl_for: Callable[[list[int]], Any] = lambda steps: kl_state  # noqa: E731
        not_loaded: Callable[[Fetched], None] | None = None
        if kl_state is not None and is_adaptive(settings):
            # the coefficient of a step depends on every step before it (rldiag.executors.klchain)
            kc = SequentialChain(kl_state, job, replay_statistics(plan.replay, job), plan.logged_kl)
            kl_for, not_loaded = kc.state_for, kc.not_loaded
        pin = torch.device(job.device).type == "cuda"
        fetched = prefetched(plan.tasks, lambda t: fetch(t, job, pin=pin), hold=large_step)
        every = torch.get_num_threads()
        with engine_threads(job.device) as fewer:
            spare = allocator.SpareCores(fewer)

            def threads() -> None:
                # every core for a pack computed while the loader reads nothing (the last packs, a
                # large step held), one fewer while it reads the next step (allocator.pack_threads)
                allocator.pack_threads(every, fewer, fetched.quiet, spare)

            yield from process(fetched, job, kl_for, before_compute=threads, not_loaded=not_loaded)

    def close(self) -> None:
        """Nothing to release: the executor holds no resources between runs."""
