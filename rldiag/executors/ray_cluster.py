"""``--executor ray``: a recompute's steps spread over a Ray cluster.

What goes over the wire is small: a task is one chunk of steps as paths or URIs plus the settings
(:class:`~rldiag.executors.steps.Job`); a worker reads, hashes and loads its steps itself, packs
and computes them exactly as the local executor does (same chunks, same packs, same code, so the
same bits), and returns one :class:`~rldiag.executors.steps.StepOutcome` per step: the input
record, a metrics row and, with ``--save-tokens``, an Arrow table. The driver writes them, in step
order, into the scenario (:mod:`rldiag.io.staged`), so atomic replacement and reuse live
in one place. Tasks in flight are bounded, so the driver's memory stays flat.

GPU-aware: with ``--device cuda`` (or ``auto`` on a cluster that has GPUs) each task requests
``gpus_per_task`` GPUs and computes on the one Ray assigns it.

Adaptive KL (``algorithm.kl_ctrl.type=adaptive`` with ``algorithm.use_kl_in_reward``) chains the
steps: a first pass computes each pack's reward-KL statistic on the workers (it does not depend on
the coefficient), the driver advances the controller over them in step order
(:mod:`rldiag.executors.klchain`), and the second pass recomputes every pack with its steps'
coefficients (:class:`~rldiag.engine.pipeline.PresetKLCoefficients`). The batches are read twice.
"""

from __future__ import annotations

import os
import socket
from collections import deque
from collections.abc import Generator
from dataclasses import replace
from pathlib import Path

from rldiag.engine.pipeline import PresetKLCoefficients, initial_kl_state
from rldiag.errors import ComputeError, ConfigError, ExecutorError, RldiagError
from rldiag.executors.allocator import tune_host_allocator
from rldiag.executors.base import Plan
from rldiag.executors.klchain import chain, is_adaptive, pack_statistics, replay_statistics, with_logged
from rldiag.executors.steps import Job, StepOutcome, StepTask, fetch, prefetched, process
from rldiag.io.fs import is_uri


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("--executor ray needs the ray package: pip install 'rldiag[ray]'") from None
    return ray


class _Unchained:
    """Stands in for coefficients the first pass did not produce: that pack's steps were not
    readable then but are now (a file changed in between), so their coefficient is unknown."""

    def __init__(self, steps: list[int]):
        self.steps = steps

    def advance(self, settings, current_kl, rows):
        raise ComputeError(
            f"step(s) {', '.join(map(str, self.steps))}: the batch file changed during the recompute, "
            "so no adaptive KL coefficient was chained for it; run the recompute again"
        )


def _kl_for(job: Job, coefs: dict[int, float] | None):
    settings = job.settings
    if not settings["algorithm.use_kl_in_reward"]:
        return lambda steps: None
    if coefs is None:  # fixed controller: the same coefficient for every step
        state = initial_kl_state(settings)
        return lambda steps: state

    def preset(steps: list[int]):
        missing = [s for s in steps if s not in coefs]
        return _Unchained(missing) if missing else PresetKLCoefficients([coefs[s] for s in steps])

    return preset


# --- task bodies (plain functions, wrapped with ray.remote when a run starts) ----------------------

def run_chunk(tasks: list[StepTask], job: Job, coefs: dict[int, float] | None) -> list[StepOutcome]:
    """Read, hash, load, pack and compute one chunk of steps."""
    tune_host_allocator()
    pin = job.device.startswith("cuda")
    fetched = prefetched(tasks, lambda t: fetch(t, job, pin=pin))
    return list(process(fetched, job, _kl_for(job, coefs)))


def chunk_kl_statistics(tasks: list[StepTask], job: Job):
    """First pass of adaptive KL: the reward-KL statistic of each pack of one chunk (a step that
    fails to load, from its statistic's columns alone)."""
    return pack_statistics(prefetched(tasks, lambda t: fetch(t, job, hash_file=False)), job)


# --- the executor ---------------------------------------------------------------------------------

def probe_address(address: str | None, timeout: float = 5.0) -> None:
    """Fail fast on a cluster address nothing answers at: ``ray.init`` itself retries for
    minutes. ``None``/``auto``/``local`` (and ``RAY_ADDRESS`` unset) have nothing to probe."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address or address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rsplit("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return  # not host:port; let Ray interpret it
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise ExecutorError(f"cannot reach the Ray cluster at {address} ({exc}); "
                            "check --ray-address / RAY_ADDRESS, or omit them for a local Ray") from None


def _absolute(task: StepTask) -> StepTask:
    """Workers do not share the driver's working directory: send local paths absolute."""
    if is_uri(task.file):
        return task
    return replace(task, file=str(Path(task.file).absolute()))


def _chunks(tasks: list[StepTask]) -> list[list[StepTask]]:
    out: list[list[StepTask]] = []
    for t in tasks:
        if out and out[-1][0].chunk == t.chunk:
            out[-1].append(t)
        else:
            out.append([t])
    return out


def task_options(device: str, cpus_per_task: float, gpus_per_task: float) -> dict:
    """Ray resources of one task: its CPUs, and its share of a GPU when it runs on CUDA."""
    return {"num_cpus": cpus_per_task, "num_gpus": gpus_per_task if device.startswith("cuda") else 0}


class RayExecutor:
    """Steps as Ray tasks, one chunk each.

    ``address``: the cluster to join (None: ``RAY_ADDRESS`` or an existing local cluster, else a
    new local one). An already initialised Ray (``ray.init`` by the caller) is used as is and left
    running; one this executor started is shut down by :meth:`close`. ``max_in_flight``: chunks
    submitted ahead of the one being written (default: twice the tasks the cluster can run at once).
    """

    name = "ray"

    def __init__(self, address: str | None = None, gpus_per_task: float = 1.0, cpus_per_task: float = 1.0,
                 max_in_flight: int | None = None):
        if not gpus_per_task > 0 or not cpus_per_task > 0:
            raise ConfigError("RayExecutor: gpus_per_task and cpus_per_task must be > 0")
        self.address = address
        self.gpus_per_task = gpus_per_task
        self.cpus_per_task = cpus_per_task
        self.max_in_flight = max_in_flight
        self._owned = False
        self._device = "cpu"

    def start(self, device: str) -> str:
        ray = import_ray()
        if not ray.is_initialized():
            probe_address(self.address)
            try:
                ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
            except Exception as exc:  # ray raises ConnectionError, RuntimeError, ValueError, ...
                where = f" at {self.address}" if self.address else ""
                raise ExecutorError(f"cannot start or reach the Ray cluster{where}: {exc}") from exc
            self._owned = True
        gpus = float(ray.cluster_resources().get("GPU", 0))
        if device == "auto":
            self._device = "cuda" if gpus > 0 else "cpu"
        elif device == "cpu":
            self._device = "cpu"
        elif device.startswith("cuda"):
            if gpus <= 0:
                raise ConfigError("--device cuda: the Ray cluster has no GPU (use --device cpu or auto)")
            self._device = "cuda"  # a task sees only the GPU(s) Ray gave it
        else:
            raise ConfigError(f"--device {device!r}: expected auto, cpu or cuda")
        return self._device

    def close(self) -> None:
        if self._owned:
            import_ray().shutdown()
            self._owned = False

    def task_options(self) -> dict:
        """The Ray resources each task asks for, on the device :meth:`start` picked."""
        return task_options(self._device, self.cpus_per_task, self.gpus_per_task)

    def _window(self, ray) -> int:
        if self.max_in_flight:
            return max(1, self.max_in_flight)
        res = ray.cluster_resources()
        if self._device.startswith("cuda"):
            slots = float(res.get("GPU", 1)) / self.gpus_per_task
        else:
            slots = float(res.get("CPU", 1)) / self.cpus_per_task
        return max(2, 2 * int(slots))

    def run(self, plan: Plan) -> Generator[StepOutcome, None, None]:
        ray = import_ray()
        job = plan.job
        opts = self.task_options()
        chunks = _chunks([_absolute(t) for t in plan.tasks])
        coefs = self._chain(ray, plan, chunks, opts) if is_adaptive(job.settings) else None
        remote = ray.remote(run_chunk).options(**opts)
        window = self._window(ray)
        pending: deque = deque()
        try:
            for chunk in chunks:
                mine = None if coefs is None else {t.step: coefs[t.step] for t in chunk if t.step in coefs}
                pending.append((chunk, remote.remote(chunk, job, mine)))
                if len(pending) >= window:
                    yield from self._get(ray, *pending.popleft())
            while pending:
                yield from self._get(ray, *pending.popleft())
        finally:
            for _, ref in pending:
                ray.cancel(ref)

    def _chain(self, ray, plan: Plan, chunks: list[list[StepTask]], opts: dict) -> dict[int, float]:
        """First pass: every pack's statistic on the workers (the chosen steps' and the replayed
        ones'); then the chain, here, in step order."""
        job = plan.job
        stat_fn = ray.remote(chunk_kl_statistics).options(**opts)
        refs = [(c, stat_fn.remote(c, job)) for c in chunks]
        # --steps: the run's steps left out, one task per chunk, only the statistic's columns read
        replay_fn = ray.remote(replay_statistics).options(**opts)
        replay_refs = [(part, replay_fn.remote(part, job)) for part in _chunks([_absolute(t) for t in plan.replay])]
        stats = [stat for part, ref in replay_refs + refs for stat in self._get(ray, part, ref)]
        # no pack spans a step of the other kind (scenario.plan.plan_steps), so step order is pack order
        stats.sort(key=lambda stat: stat[0][0])
        # a capture policy's run: verl's logged statistic where a step's batch is missing or sampled
        return chain(initial_kl_state(job.settings), job.settings, with_logged(stats, plan.logged_kl))

    @staticmethod
    def _get(ray, chunk: list[StepTask], ref):
        """The task's result; its RldiagError as is; anything else from Ray as ExecutorError."""
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, RldiagError):
                raise cause from None
            raise ExecutorError(f"steps {chunk[0].step}..{chunk[-1].step}: a Ray task failed: {exc}") from exc
        except ray.exceptions.RayError as exc:
            raise ExecutorError(f"steps {chunk[0].step}..{chunk[-1].step}: Ray lost the task: {exc}") from exc
