"""The sampling band of a step metric recomputed from a capture policy's sample of prompt groups.

A step whose batch file holds only some of its prompt groups (``RLDIAG_CAPTURE_GROUPS``,
:mod:`rldiag.scenario.sampling`) recomputes every per-row and per-group value of the kept rows
exactly, but a step metric (a mean over the batch, a whitening) is then a statistic of the kept
groups: an *estimate* of the value the trainer logged over the whole step. ``verify`` never calls
an estimate's difference a mismatch; it places the logged value in the estimate's sampling band.

The band comes from a delete-a-group jackknife (Quenouille 1956, Tukey 1958; the grouped,
"delete-a-group" form for cluster samples: Kott 2001, *J. Official Statistics* 17(4)): the kept
groups are dealt into ``B`` blocks (one group a block when at most :data:`MAX_BLOCKS` are kept),
the step's metrics are recomputed ``B`` times with one block left out, and

    se^2 = (1 - f) * (B - 1) / B * sum_b (theta_b - mean_b theta_b)^2

where ``f`` is the share of the step's groups the sample kept (the finite-population correction
of sampling groups without replacement). Groups are the sampling unit, so the correlation of a
group's rows is in the band. A metric is *inside* its band when ``|estimate - logged| <=
Z_BAND * se`` (or, where the replicates do not move, within the field's usual tolerance).

A maximum or minimum over the batch is not smooth and the jackknife says nothing of its spread;
it is checked one way instead: the kept rows' maximum cannot exceed the whole step's (nor their
minimum fall below it). A total over the batch (a count of groups or tokens, ``global_seqlen/*``)
grows with the sample and is no estimate of the step's: it is not placed. Where the kept groups
do not vary at all (a rare event none of them had: a clip ratio of 0) the band has no width and
the estimate equals the logged value or is not placed (``inside`` None), never outside.
Means, shares, standard deviations and every other metric use the band.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from rldiag.analysis.tolerance import Tolerances, diff
from rldiag.config.settings import Settings
from rldiag.engine.batch import Batch
from rldiag.engine.pipeline import KLControllerState, PresetKLCoefficients, recompute_batch

#: at most this many jackknife replicates a step (each a recompute of most of the kept rows)
MAX_BLOCKS = 16
#: half-width of the band in standard errors. The delete-a-group jackknife's t statistic has
#: about B - 1 degrees of freedom; with B >= 4, |t| > 6 has probability under 1 % (t_3: 0.9 %,
#: t_15: 2.4e-5), so a logged value outside the band is a real question, not sampling noise.
Z_BAND = 6.0


@dataclass(frozen=True)
class Band:
    """One step metric of a sampled step against the logged value."""

    estimate: float  # the metric of the kept groups
    logged: float
    se: float  # the jackknife standard error (nan: one-sided or not computable)
    kind: str  # "band" | "max" | "min" | "flat" (the replicates agree: compared with the tolerance)
    inside: bool | None  # None: not placed (a flat band the logged value is off)

    @property
    def z(self) -> float:
        """|estimate - logged| in standard errors (0 inside an exact comparison's tolerance)."""
        if self.kind != "band" or not self.se > 0:
            return 0.0 if self.inside is not False else math.inf
        return abs(self.estimate - self.logged) / self.se


#: leaves (and top-level groups) of metrics that are totals over the batch, not means
TOTAL_LEAVES = ("count", "tokens", "rows", "num_tokens", "total_num_tokens", "num_rows")
TOTAL_GROUPS = ("global_seqlen", "perf")


def _kind(name: str) -> str:
    leaf = name.rsplit("/", 1)[-1]
    if leaf in TOTAL_LEAVES or leaf.endswith(("_count", "_tokens")) or name.split("/", 1)[0] in TOTAL_GROUPS:
        return "total"
    if leaf.startswith("max") or leaf.endswith("_max"):
        return "max"
    if leaf.startswith("min") or leaf.endswith("_min"):
        return "min"
    return "band"


def _blocks(batch: Batch) -> tuple[torch.Tensor, int]:
    """Each row's jackknife block ``(rows,)`` and the number of blocks: the kept groups in
    order of their ids, dealt round-robin."""
    present, inverse = torch.unique(batch.group_ids, return_inverse=True)
    n_blocks = min(int(present.numel()), MAX_BLOCKS)
    return inverse % max(n_blocks, 1), n_blocks


def _without(batch: Batch, keep: torch.Tensor) -> Batch:
    """The rows where ``keep`` holds, their groups numbered from 0 again (the group stages size
    their arrays by ``n_groups``: an emptied group would count as a group of no rows)."""
    sub = batch.select_rows(torch.nonzero(keep).flatten())
    present, inverse = torch.unique(sub.group_ids, return_inverse=True)
    return replace(sub, group_ids=inverse, n_groups=int(present.numel()))


def replicate_state(kl_state):
    """A copy of a reward-KL state that a recompute may advance (None stays None)."""
    if isinstance(kl_state, KLControllerState):
        return copy.deepcopy(kl_state)
    if isinstance(kl_state, PresetKLCoefficients):
        return PresetKLCoefficients(list(kl_state.values))
    return kl_state


def sample_bands(batch: Batch, settings: Settings, kl_state, estimates: Mapping[str, float],
                 logged: Mapping[str, float], share: float, tols: Tolerances) -> dict[str, Band]:
    """Each metric of ``estimates`` (the kept groups' values, one step) that the trainer
    ``logged``, placed in its sampling band. ``batch``: the kept rows of one step, on the device
    the recompute ran on; ``kl_state``: the reward-KL state *before* the step (copied, never
    advanced); ``share``: the share of the step's groups the sample kept. Empty when fewer than
    two groups are kept (no spread to measure)."""
    names = sorted(set(estimates) & set(logged))
    blocks, n_blocks = _blocks(batch)
    if n_blocks < 2 or not names:
        return {}
    reps: dict[str, list[float]] = {n: [] for n in names}
    for b in range(n_blocks):
        result = recompute_batch(_without(batch, blocks != b), settings, replicate_state(kl_state))
        for n in names:
            v = result.metrics.get(n)
            reps[n].append(float(v.detach().cpu().to(torch.float64)[0]) if v is not None else math.nan)
    fpc = max(0.0, 1.0 - share)
    out: dict[str, Band] = {}
    for n in names:
        est, log = float(estimates[n]), float(logged[n])
        t = torch.tensor(reps[n], dtype=torch.float64)
        kind = _kind(n)
        if kind == "total":
            continue
        within_tol = not bool(diff(np.array([log]), np.array([est]), tols.for_field(n, "metric")).bad.any())
        if kind == "max":
            out[n] = Band(est, log, math.nan, kind, within_tol or est <= log)
            continue
        if kind == "min":
            out[n] = Band(est, log, math.nan, kind, within_tol or est >= log)
            continue
        if not bool(torch.isfinite(t).all()):
            continue  # a replicate without the metric (a group-dependent metric): no band
        var = fpc * (n_blocks - 1) / n_blocks * float(((t - t.mean()) ** 2).sum())
        se = math.sqrt(var)
        if not se > 0:
            out[n] = Band(est, log, 0.0, "flat", True if within_tol else None)
            continue
        out[n] = Band(est, log, se, "band", within_tol or abs(est - log) <= Z_BAND * se)
    return out
