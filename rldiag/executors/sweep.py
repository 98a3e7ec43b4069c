"""``rldiag sweep`` in this process: many scenarios of one run from one read of each step file.

The driver (:mod:`rldiag.scenario.sweep`) makes each scenario's :class:`~rldiag.executors.base.Plan`
as a recompute of it would (the same steps, its own reuse decisions and chunks);
:class:`SweepExecutor` runs them together:

1. :func:`fetch_many` reads one step's file once (not at all when every scenario reuses it and
   its hash is known from a record of the same size and mtime), hashes it once, decides for each
   scenario whether its previous result is reused, and parses the bytes once for every set of
   scenarios that load the same columns with the same horizons (usually one).
2. Each scenario packs its steps as its own recompute would (:class:`~rldiag.executors.steps.Packer`:
   a step it reuses ends its pack); scenarios whose next pack is the same (the same steps, the
   same loaded data) are computed together by :func:`rldiag.engine.sweep.iter_recompute_many`,
   which runs each stage once for every scenario that agrees on it.
3. Outcomes come back as ``(scenario index, StepOutcome)``, each scenario's in step order; the
   driver writes each scenario as ``rldiag recompute`` writes it.

Adaptive KL in the reward: each scenario's controller advances over its steps in order
(:class:`~rldiag.executors.klchain.SequentialChain`); scenarios that agree on the reward-KL
settings and plan the same columns share one chain (they compute the same statistics), and the
engine shares the stages of scenarios whose controllers hold the same value.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from rldiag.config.settings import Settings
from rldiag.engine.pipeline import initial_kl_state
from rldiag.engine.requirements import ColumnPlan, recompute_columns
from rldiag.engine.stages.reward import ANCHOR, REWARD_KL
from rldiag.engine.sweep import StageHook, iter_recompute_many, stage_keys
from rldiag.errors import RldiagError
from rldiag.executors import allocator
from rldiag.executors.allocator import engine_threads, tune_host_allocator
from rldiag.executors.base import Plan
from rldiag.executors.device import resolve_device
from rldiag.executors.klchain import SequentialChain, is_adaptive, replay_statistics
from rldiag.executors.steps import (
    COMPUTE_ERRORS,
    Fetched,
    Job,
    Packer,
    StepOutcome,
    StepTask,
    content_hasher,
    hash_pool,
    known_hash,
    pack_batch,
    pack_outcomes,
    prefetched,
    stat_record,
    try_load,
)
from rldiag.io.loader import Source, read_schema, row_columns

__all__ = ["SweepExecutor", "SweepHooks", "fetch_many", "load_key"]

#: ``read(path)``: a step file's content, as the loader takes it (:data:`~rldiag.io.loader.Source`):
#: a local file open for reading (binary; :func:`fetch_many` closes it), or an object store's bytes.
Reader = Callable[[Any], Source]


def open_content(path: Any) -> Source:
    """A step file's content for :func:`fetch_many`: a local file open, so that it is hashed in
    pieces and parsed from the open file, never held whole beside the decoded columns; an object
    store's file read whole, once (reading it twice would double the requests)."""
    if isinstance(path, Path):
        return open(path, "rb")  # noqa: SIM115 - closed by fetch_many
    return path.read_bytes()


@dataclass(frozen=True)
class SweepHooks:
    """Seams for tests and measurements: ``read(path)`` gives a step file's content (every
    read of a step's content goes through it: :data:`Reader`), ``on_stage(stage, scenarios)``
    is told each time an engine stage runs, for which scenarios (indices into the plans)."""

    read: Reader | None = None
    on_stage: StageHook | None = None


def load_key(settings: Settings, plan: ColumnPlan, names: Sequence[str]) -> tuple:
    """What decides how a file with columns ``names`` is parsed for these settings: the columns
    the plan reads from it (in order; a file lacking a column the plan requires fails, in a
    message naming who needs it: a key of its own) and the horizons the loader reads."""
    horizons = (settings["data.max_response_length"], settings["data.max_prompt_length"])
    if plan.missing(names):
        return ("missing", plan, *horizons)
    return (tuple(plan.select(names)), *horizons)


def fetch_many(tasks: Sequence[StepTask], jobs: Sequence[Job], pin: bool = False,
               read: Reader | None = None, columns: Sequence[ColumnPlan] | None = None) -> list[Fetched]:
    """One step for every scenario (``tasks[i]``: scenario i's task of that step, its previous
    record and whether its previous result may be reused): the file read at most once, hashed
    once, parsed once per :func:`load_key`; a :class:`Fetched` per scenario, as
    :func:`~rldiag.executors.steps.fetch` would give it. ``columns``: each scenario's column
    plan, when the caller has them (default: the column planner's). A local file is opened
    once (:func:`open_content`), hashed in pieces on the hash thread and parsed from the open
    file: its bytes are never held whole."""
    read = read or open_content
    plans = list(columns) if columns is not None else [recompute_columns(job.settings) for job in jobs]
    sf = tasks[0].step_file()
    info, remote = stat_record(sf, tasks[0].rel)
    for t in tasks:  # a record of this size and mtime: the hash without reading the file
        if known_hash(info, remote, t.previous):
            break
    content: Source = None
    try:
        pending = finish = None
        if "sha256" not in info:
            content = read(sf.path)
            hashed, finish = content_hasher(info, remote, content)
            if any(t.reusable and t.previous for t in tasks):  # the hash decides what is parsed
                info, finish = hashed(), None
            else:
                pending = hash_pool().submit(hashed)
            del hashed
        out: list[Fetched | None] = [None] * len(tasks)
        todo: list[int] = []
        for i, t in enumerate(tasks):
            old = t.previous
            if t.reusable and old and old.get("sha256") == info.get("sha256") and old.get("size") == info.get("size"):
                out[i] = Fetched(t, info)
            else:
                todo.append(i)
        if todo and content is None:
            content = read(sf.path)
        _load_todo(tasks, jobs, plans, todo, sf, content, pin, (pending, finish), info, out)
    finally:
        if content is not None and not isinstance(content, bytes):
            content.close()
        content = None
    return [f for f in out if f is not None]


def _load_todo(tasks: Sequence[StepTask], jobs: Sequence[Job], plans: Sequence[ColumnPlan], todo: list[int],
               sf: Any, content: Source, pin: bool, hashing: tuple, info: dict, out: list[Fetched | None]) -> None:
    """Parse ``content`` once per :func:`load_key` for the scenarios ``todo`` (indices), setting
    their :class:`Fetched` in ``out`` (``hashing``: the hash's ``(pending, finish)``, as
    :func:`~rldiag.executors.steps.fetch` gives them), and the per-row table's own columns from
    the same content."""
    if not todo:
        return
    loads: dict[tuple, list[int]] = {}
    try:
        names: Sequence[str] | None = read_schema(sf, content).names
    except RldiagError:
        names = None  # unreadable: each load below reports it
    for i in todo:
        key = load_key(jobs[i].settings, plans[i], names) if names is not None else ("unreadable", i)
        loads.setdefault(key, []).append(i)
    for idxs in loads.values():
        data, error = try_load(sf, jobs[idxs[0]].settings, plans[idxs[0]], content)
        errors = {i: error for i in idxs}
        if data is None and len({plans[i].who for i in idxs}) > 1:
            for i in idxs[1:]:  # the message names who needs a missing column: each scenario's own
                errors[i] = try_load(sf, jobs[i].settings, plans[i], content)[1]
        if data is not None and pin:
            data.batch = data.batch.pin_memory()
        for i in idxs:
            out[i] = Fetched(tasks[i], info, data=data, error=errors[i] if data is None else None,
                             pending=hashing[0], finish=hashing[1])
    if loads:  # the per-row table's own columns, from the same bytes (rather than a read per scenario)
        own: pa.Table | BaseException
        try:
            own = row_columns(sf, content)
        except (RldiagError, OSError, pa.ArrowException) as exc:
            own = exc
        for i in todo:
            fetched = out[i]
            assert fetched is not None
            fetched.row_columns = own


class _SharedChain:
    """One adaptive KL chain for the scenarios that compute the same statistics: advanced once
    per step, however many of them report a step they did not load."""

    def __init__(self, chain: SequentialChain):
        self.chain = chain
        self._seen: set[int] = set()

    def state_for(self, steps: list[int]):
        return self.chain.state_for(steps)

    def not_loaded(self, f: Fetched) -> None:
        if f.task.step not in self._seen:
            self._seen.add(f.task.step)
            self.chain.not_loaded(f)


def _constant(state: Any) -> Callable[[list[int]], Any]:
    return lambda steps: state


def _kl_controllers(plans: Sequence[Plan]) -> tuple[list[Callable[[list[int]], Any]], list[Callable[[Fetched], None] | None]]:
    """Each scenario's KL controller, as :class:`~rldiag.executors.local.LocalExecutor` makes
    it: ``kl_for(steps)`` the state a pack is computed with, ``not_loaded(f)`` for a step it did
    not load (adaptive KL only)."""
    kl_for: list[Callable[[list[int]], Any]] = []
    not_loaded: list[Callable[[Fetched], None] | None] = []
    chains: dict[tuple, _SharedChain] = {}
    keys = sorted({k for p in plans for k in p.job.settings.values})
    reward_keys = sorted(set(stage_keys(ANCHOR, keys)) | set(stage_keys(REWARD_KL, keys)))
    for plan in plans:
        job, s = plan.job, plan.job.settings
        if not s["algorithm.use_kl_in_reward"]:
            kl_for.append(lambda steps: None)
            not_loaded.append(None)
        elif not is_adaptive(s):
            kl_for.append(_constant(initial_kl_state(s)))
            not_loaded.append(None)
        else:
            cols = recompute_columns(s)
            key = (cols.wanted, cols.required, s["data.max_response_length"], s["data.max_prompt_length"],
                   tuple(repr(s.get(k)) for k in reward_keys),
                   tuple((t.step, t.chunk) for t in plan.tasks), tuple((t.step, t.chunk) for t in plan.replay))
            if key not in chains:
                chains[key] = _SharedChain(SequentialChain(initial_kl_state(s), job, replay_statistics(plan.replay, job)))
            kl_for.append(chains[key].state_for)
            not_loaded.append(chains[key].not_loaded)
    return kl_for, not_loaded


Unit = Fetched | list[Fetched]


class SweepExecutor:
    """Every scenario of a sweep in this process (see the module doc)."""

    name = "local"

    def __init__(self, hooks: SweepHooks | None = None):
        self.hooks = hooks or SweepHooks()

    def start(self, device: str) -> str:
        resolved = str(resolve_device(device))
        tune_host_allocator()
        return resolved

    def close(self) -> None:
        """Nothing to release."""

    def run(self, plans: Sequence[Plan]) -> Generator[tuple[int, StepOutcome], None, None]:
        """``(scenario, outcome)`` for every step of every plan, each scenario's in step order.
        The plans are of the same run and the same steps, in the same order."""
        if not plans:
            return
        steps = [t.step for t in plans[0].tasks]
        if any([t.step for t in p.tasks] != steps for p in plans):
            raise ValueError("the plans of a sweep must have the same steps")
        jobs = [p.job for p in plans]
        kl_for, not_loaded = _kl_controllers(plans)
        device = jobs[0].device
        pin = torch.device(device).type == "cuda"
        rows = [tuple(p.tasks[k] for p in plans) for k in range(len(steps))]
        read = self.hooks.read
        columns = [recompute_columns(job.settings) for job in jobs]
        fetched = prefetched(rows, lambda tasks: fetch_many(tasks, jobs, pin=pin, read=read, columns=columns))
        packers = [Packer(job.pack_tokens) for job in jobs]
        every = torch.get_num_threads()
        with engine_threads(device) as fewer:
            spare = allocator.SpareCores(fewer)

            def widen() -> None:
                # as LocalExecutor: every core for the last packs, nothing left to read, a core to spare
                allocator.pack_threads(every, fewer, fetched.idle, spare)

            for row in fetched:
                yield from self._drain([packers[i].push(f) for i, f in enumerate(row)], jobs, kl_for, not_loaded, widen)
            yield from self._drain([p.flush() for p in packers], jobs, kl_for, not_loaded, widen)

    def _drain(self, units: list[list[Unit]], jobs: Sequence[Job], kl_for, not_loaded,
               widen: Callable[[], None]) -> Generator[tuple[int, StepOutcome], None, None]:
        """The units the scenarios completed, each scenario's in order; scenarios whose next
        unit is the same pack (the same steps of the same loaded data) computed together."""
        queues = [deque(u) for u in units]
        while any(queues):
            same: dict[tuple, list[int]] = {}
            for i, q in enumerate(queues):
                if not q:
                    continue
                head = q[0]
                if isinstance(head, Fetched):
                    q.popleft()
                    if not_loaded[i] is not None:
                        not_loaded[i](head)
                    yield i, head.outcome()
                else:
                    same.setdefault(tuple(id(f.data) for f in head), []).append(i)
            for idxs in same.values():
                pack_of = {i: queues[i].popleft() for i in idxs}
                widen()
                yield from self._compute(pack_of, jobs, kl_for)

    def _compute(self, pack_of: dict[int, Any], jobs: Sequence[Job], kl_for) -> Generator[tuple[int, StepOutcome], None, None]:
        idxs = list(pack_of)
        first = pack_of[idxs[0]]
        steps = [f.task.step for f in first]
        batch = pack_batch(first, jobs[idxs[0]])
        kl_states = [kl_for[i](steps) for i in idxs]
        hook = self.hooks.on_stage
        on_stage = None if hook is None else (lambda name, members: hook(name, [idxs[m] for m in members]))
        leaves = iter_recompute_many(batch, [jobs[i].settings for i in idxs], kl_states, catch=COMPUTE_ERRORS,
                                     on_stage=on_stage)
        for members, result in leaves:
            shared: dict = {}
            for m in members:
                i = idxs[m]
                for out in pack_outcomes(pack_of[i], jobs[i], result, shared):
                    yield i, out

