"""The adaptive KL controller across steps (``algorithm.kl_ctrl.type=adaptive`` with
``algorithm.use_kl_in_reward``).

Step s's coefficient depends on the reward-side KL statistic of every step before it, and that
statistic does not depend on any coefficient. So the chain can be split: compute each pack's
statistic anywhere (:func:`pack_statistics`), advance the controller over them in step order in
one place (:func:`chain`), then recompute each pack with its steps' coefficients. Steps of the run
before the first chosen one (``--steps 10:``) are replayed from a cheaper per-step statistic
(:func:`replay_statistic`), as a trainer that saw them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rldiag.config.settings import Settings
from rldiag.engine.batch import pack as pack_batches
from rldiag.engine.kl import kl_estimate
from rldiag.engine.pipeline import KLControllerState, anchor_log_probs, reward_kl
from rldiag.engine.segments import MEAN_EPS, seg_count
from rldiag.errors import RldiagError
from rldiag.executors.steps import Fetched, Job, packs
from rldiag.io.loader import load_step, read_schema
from rldiag.io.rundir import StepFile

#: (run steps of a pack, current_kl (n_steps,), rows (n_steps,)), CPU tensors
PackStatistic = tuple[list[int], torch.Tensor, torch.Tensor]


def is_adaptive(settings: Settings) -> bool:
    return bool(settings["algorithm.use_kl_in_reward"]) and settings["algorithm.kl_ctrl.type"] == "adaptive"


def pack_statistics(fetched: Iterable[Fetched], job: Job) -> list[PackStatistic]:
    """The reward-KL statistic of each pack that a full recompute of these steps makes, exactly as
    :func:`~rldiag.engine.pipeline.recompute_batch` computes it (same packs, same reductions, so
    the same bits). A pack whose statistic cannot be computed (a missing column) is left out: a
    full recompute fails it before the controller sees it."""
    out = []
    dev = torch.device(job.device)
    for unit in packs(fetched, job.pack_tokens):
        if isinstance(unit, Fetched):
            continue
        batch = pack_batches([f.loaded.batch for f in unit]).to(dev)
        try:
            _, current_kl = reward_kl(batch, anchor_log_probs(batch, job.settings), job.settings)
        except RldiagError:
            continue
        rows = seg_count(batch.step_ids, batch.n_steps)
        out.append(([f.task.step for f in unit], current_kl.cpu(), rows.cpu()))
    return out


def replay_statistic(sf: StepFile, settings: Settings) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A step before the chosen ones: the mean over rows of the per-row masked mean of the KL
    estimator on old vs reference log-probs (original mask), and its row count, from only the
    columns needed. None when the batch cannot be read or lacks a column (the controller skips it,
    as a trainer that never saw it)."""
    try:
        names = read_schema(sf).names
        score = "token_level_scores" if "token_level_scores" in names else "score"
        cols = ["uid", "response_mask", score] + [c for c in ("old_log_probs", "ref_log_prob") if c in names]
        sd = load_step(sf, settings, columns=cols)
    except RldiagError:
        return None
    b = sd.batch
    if b.old_log_probs is None or b.ref_log_prob is None:
        return None
    m = b.response_mask
    kld = kl_estimate(settings["algorithm.kl_penalty"], b.old_log_probs, b.ref_log_prob) * m
    row_kl = b.rows.sum(kld * m) / (b.rows.sum(m) + MEAN_EPS)
    return row_kl.mean().reshape(1), torch.tensor([float(b.n_rows)], device=row_kl.device)


def chain(state: KLControllerState, settings: Settings, stats: Iterable[PackStatistic]) -> dict[int, float]:
    """Advance ``state`` over ``stats`` in order; the coefficient each step is computed with."""
    coefs: dict[int, float] = {}
    for steps, current_kl, rows in stats:
        used = state.advance(settings, current_kl, rows)
        coefs.update(zip(steps, used.tolist()))
    return coefs
