"""The adaptive KL controller across steps (``algorithm.kl_ctrl.type=adaptive`` with
``algorithm.use_kl_in_reward``).

Step s's coefficient depends on the reward-side KL statistic of every step before it
(:func:`~rldiag.engine.reward_kl.reward_kl`, the one definition the pipeline uses too), and that
statistic does not depend on any coefficient. So the chain can be split: compute each pack's
statistic anywhere (:func:`pack_statistics`), advance the controller over them in step order in
one place (:func:`chain`), then recompute each pack with its steps' coefficients. Steps of the run
left out before the last chosen one (``--steps 10:``, ``--steps 3,5``) are replayed
(:func:`replay_statistics`): loaded with only the statistic's columns (the column planner's
:func:`~rldiag.engine.requirements.reward_kl_columns`),
packed as a full recompute packs the run's first steps, as a trainer that saw them.

Which steps advance the controller: verl's trainer advanced it at every step it ran, so every
step whose statistic can be read from its file does, also one that a full recompute fails for
another reason (a non-finite value in ``log_probs``, a column the estimator needs missing): its
statistic is then read from the statistic's columns alone (:func:`step_statistic`). A step whose
statistic cannot be read (the file unreadable, a non-finite or missing ``ref_log_prob`` or
π_old, an invalid mask) is skipped, unlike the trainer, which saw it. A pack of several steps
is one statistic: a pack the reward KL fails on (a step lacking ``ref_log_prob`` packed with
others) is skipped whole, as the full recompute fails it whole.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch

from rldiag.config.settings import Settings
from rldiag.engine.batch import pack as pack_batches
from rldiag.engine.kl_control import PresetKLCoefficients
from rldiag.engine.pipeline import KLControllerState
from rldiag.engine.requirements import reward_kl_columns
from rldiag.engine.reward_kl import reward_kl
from rldiag.engine.segments import seg_count
from rldiag.errors import RldiagError
from rldiag.executors.steps import Fetched, Job, StepTask, fetch, packs, prefetched

#: (run steps of a pack, current_kl (n_steps,), rows (n_steps,)), CPU tensors
PackStatistic = tuple[list[int], torch.Tensor, torch.Tensor]


def is_adaptive(settings: Settings) -> bool:
    return bool(settings["algorithm.use_kl_in_reward"]) and settings["algorithm.kl_ctrl.type"] == "adaptive"


def fetch_statistic_inputs(task: StepTask, job: Job) -> Fetched:
    """One step loaded with only the statistic's columns (the reward-KL stage's: π_old,
    ``ref_log_prob``, ``loss_mask``, besides the base ones; no hash), or the error that kept it
    from loading."""
    return fetch(task, job, hash_file=False, columns=reward_kl_columns(job.settings))


def _statistic(unit: list[Fetched], job: Job) -> PackStatistic | None:
    """The statistic of one pack of loaded steps, as :func:`~rldiag.engine.pipeline.recompute_batch`
    computes it on that pack (same reductions, so the same bits); None when the reward KL fails
    on it (a missing column)."""
    batch = pack_batches([f.loaded.batch for f in unit]).to(torch.device(job.device))
    try:
        _, current_kl = reward_kl(batch, job.settings)
    except RldiagError:
        return None
    rows = seg_count(batch.step_ids, batch.n_steps)
    return [f.task.step for f in unit], current_kl.cpu(), rows.cpu()


def step_statistic(f: Fetched, job: Job) -> PackStatistic | None:
    """The statistic of a step the full load failed, from the statistic's columns alone (None
    when these cannot be read either, or when the step was reused rather than failed)."""
    if f.error is None:
        return None
    alone = fetch_statistic_inputs(f.task, job)
    return None if alone.data is None else _statistic([alone], job)


def pack_statistics(fetched: Iterable[Fetched], job: Job, retry_failed: bool = True) -> list[PackStatistic]:
    """The reward-KL statistic of each pack that a full recompute of these steps makes (same
    packs, same reductions, so the same bits), in step order. A pack the reward KL fails on is
    left out. ``retry_failed``: a step that did not load (a full load) is read again for its
    statistic alone (:func:`step_statistic`); without it (loads of the statistic's columns
    already), it is left out."""
    out = []
    for unit in packs(fetched, job.pack_tokens):
        if isinstance(unit, Fetched):
            stat = step_statistic(unit, job) if retry_failed else None
        else:
            stat = _statistic(unit, job)
        if stat is not None:
            out.append(stat)
    return out


def replay_statistics(tasks: list[StepTask], job: Job) -> list[PackStatistic]:
    """The statistics of run steps before the chosen ones (``--steps``), in step order, each file
    read with only the statistic's columns; ``tasks`` carry the chunks a full recompute gives
    them, so the packs (and the bits) are the full recompute's."""
    return pack_statistics(prefetched(tasks, lambda t: fetch_statistic_inputs(t, job)), job, retry_failed=False)


def chain(state: KLControllerState, settings: Settings, stats: Iterable[PackStatistic]) -> dict[int, float]:
    """Advance ``state`` over ``stats`` in order; the coefficient each step is computed with."""
    coefs: dict[int, float] = {}
    for steps, current_kl, rows in stats:
        used = state.advance(settings, current_kl, rows)
        coefs.update(zip(steps, used.tolist()))
    return coefs


#: ``{step: (current_kl, rows)}``: the reward-KL statistic verl logged for a step whose batch file
#: does not hold its whole batch (a capture policy left it out or sampled its groups;
#: :func:`rldiag.scenario.sampling.logged_kl`), with the whole batch's rows
LoggedKL = dict[int, tuple[float, int]]


def with_logged(stats: list[PackStatistic], logged: LoggedKL) -> list[PackStatistic]:
    """``stats`` with the logged statistics in their step order, each replacing the statistic of
    the same step (one computed from a sampled batch is an estimate; a run with logged
    statistics is recomputed one step a pack, :func:`rldiag.scenario.sampling`)."""
    if not logged:
        return stats
    kept = [st for st in stats if not set(st[0]) & set(logged)]
    extra = [([s], torch.tensor([kl], dtype=torch.float32), torch.tensor([rows])) for s, (kl, rows) in logged.items()]
    return sorted(kept + extra, key=lambda st: st[0][0])


class SequentialChain:
    """The controller of one process that computes the chosen steps in step order: the replayed
    steps' statistics (``replayed``, in step order) are taken as the chosen steps reach them, and
    the pipeline advances ``state`` over each pack it computes. ``logged``: the statistics verl
    logged for the steps whose batch is not whole (:data:`LoggedKL`; their packs are one step
    each): those advance the controller, never a statistic of a sampled batch."""

    def __init__(self, state: KLControllerState, job: Job, replayed: list[PackStatistic],
                 logged: LoggedKL | None = None):
        self.state, self.job = state, job
        self.logged = dict(logged or {})
        self._replayed = deque(with_logged(replayed, self.logged))

    def _catch_up(self, step: int) -> None:
        while self._replayed and self._replayed[0][0][0] < step:
            chain(self.state, self.job.settings, [self._replayed.popleft()])

    def state_for(self, steps: list[int]) -> KLControllerState | PresetKLCoefficients:
        """The state a pack of ``steps`` is computed with (it advances it past them); a step with
        a logged statistic gets the coefficient before it, and the logged statistic advances
        the controller."""
        self._catch_up(steps[0])
        if len(steps) == 1 and steps[0] in self.logged:
            used = self.state.value
            self._catch_up(steps[0] + 1)  # its own logged statistic
            return PresetKLCoefficients([used])
        return self.state

    def not_loaded(self, f: Fetched) -> None:
        """A chosen step that did not load: advance past it when its statistic can be read."""
        self._catch_up(f.task.step)
        if f.task.step in self.logged:
            self._catch_up(f.task.step + 1)  # its logged statistic
            return
        stat = step_statistic(f, self.job)
        if stat is not None:
            chain(self.state, self.job.settings, [stat])
