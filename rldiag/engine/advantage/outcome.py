"""The outcome estimators of verl's ``core_algos``: the GRPO family, GDPO, RLOO, OPO and GPG (one
scalar per response from its prompt group's scores, broadcast over the response's mask)."""

from __future__ import annotations

import torch

from rldiag.engine.advantage.base import (
    ESTIMATORS,
    GPG_F_NORM,
    GRPO_EPS,
    AdvInput,
    broadcast,
    flag_rows,
    group_mean,
    group_stats,
    grpo_scalar,
    require_extra,
)
from rldiag.engine.batch import Batch
from rldiag.engine.segments import seg_count, seg_max, seg_std, seg_sum
from rldiag.engine.settings import EngineSettings
from rldiag.engine.whiten import step_whiten
from rldiag.errors import ConfigError

# ---- GRPO family ------------------------------------------------------------------------------


def _session_final_rows(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """V1 multi-output folding (verl's V1 trainer, ``compute_grpo_outcome_advantage`` on session
    ids): per row, the index of its session's final output row (the first row with the largest
    ``output_index`` of its (uid, session_id)), and the ``(rows,)`` bool of rows that are final
    outputs."""
    sess = batch.extra["session_id"].to(torch.long)
    oidx = batch.extra["output_index"].to(torch.long)
    key = batch.group_ids * (int(sess.max()) + 1 if sess.numel() else 1) + sess
    _, sid = torch.unique(key, return_inverse=True)
    n_sess = int(sid.max()) + 1 if sid.numel() else 0
    best = torch.full((n_sess,), torch.iinfo(torch.long).min, dtype=torch.long, device=sid.device)
    best.scatter_reduce_(0, sid, oidx, reduce="amax", include_self=True)
    rows = torch.arange(sid.numel(), device=sid.device)
    cand = torch.where(oidx == best[sid], rows, torch.full_like(rows, sid.numel()))
    first = torch.full((n_sess,), sid.numel(), dtype=torch.long, device=sid.device)
    first.scatter_reduce_(0, sid, cand, reduce="amin", include_self=True)
    final_of_row = first[sid]
    return final_of_row, final_of_row == rows


@ESTIMATORS.register(
    "grpo",
    needs=(),
    whitens="group",
    optional=("session_id", "output_index"),
    grouped=True, source="verl core_algos.compute_grpo_outcome_advantage; arXiv:2402.03300; Dr. GRPO arXiv:2503.20783",
)
def grpo(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Outcome GRPO: row score = sum of token rewards; (score - mean) / (std + 1e-6) within the
    uid group, or score - mean with ``norm_adv_by_std_in_grpo=false`` (Dr. GRPO); broadcast over
    the mask. returns == advantages.

    With ``session_id`` and ``output_index`` columns (verl V1 multi-output agent loops), only each
    session's final output enters the group statistics; its scalar (times "the final output has a
    mask-1 token", as verl reads it at the first mask-1 position) is broadcast to every output of
    the session.
    """
    b = inp.batch
    scores = b.rows.column_sum(inp.rewards)
    norm = bool(inp.settings["algorithm.norm_adv_by_std_in_grpo"])
    if "session_id" in b.extra and "output_index" in b.extra:
        final_of_row, is_final = _session_final_rows(b)
        fin = torch.nonzero(is_final).flatten()
        scalar_f = grpo_scalar(scores[fin], b.group_ids[fin], b.n_groups, norm)
        has_tok = b.rows.any(inp.mask > 0)[fin].to(scalar_f.dtype)
        per_final = torch.zeros_like(scores)
        per_final[fin] = scalar_f * has_tok
        adv = broadcast(per_final[final_of_row], inp.mask, b.rows)
        return adv, adv
    adv = broadcast(grpo_scalar(scores, b.group_ids, b.n_groups, norm), inp.mask, b.rows)
    return adv, adv


@ESTIMATORS.register("grpo_vectorized", needs=(), whitens="group",
                     grouped=True, source="verl core_algos.compute_grpo_vectorized_outcome_advantage; arXiv:2402.03300")
def grpo_vectorized(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorised GRPO. Same formula as ``grpo``, with verl's group statistics in float32:
    the mean, then the Bessel variance of the *centred* scores (``verl.utils.groupwise.group_mean_std``,
    two passes since verl PR #6348, in 0.8.0, 0.9.x and the 2026-08 snapshot), a singleton group
    taking mean 0 and std 1.

    Centring before squaring matters: reward-model scores with a small spread around a non-zero
    mean (0.9 +- 1e-3) cancel in the one-pass ``sum x^2 - (sum x)^2 / n`` and lose the advantage.

    verl's V1 dispatcher passes ``norm_adv_by_std_in_grpo`` only to the exact ``grpo`` key, so this
    estimator always divides by ``std + 1e-6``: the setting is ignored here, as in verl.
    """
    b = inp.batch
    scores = b.rows.column_sum(inp.rewards).to(torch.float32)
    g, n = b.group_ids, b.n_groups
    count = seg_count(g, n, torch.float32)
    mean = seg_sum(scores, g, n) / count.clamp_min(1.0)
    centred = scores - mean[g]
    var = seg_sum(centred * centred, g, n) / (count - 1.0).clamp_min(1.0)
    std = torch.sqrt(var)
    single = count <= 1.0
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    adv = broadcast((scores - mean[g]) / (std[g] + GRPO_EPS), inp.mask, b.rows)
    return adv, adv


@ESTIMATORS.register("grpo_passk", needs=(), grouped=True,
                     source="verl core_algos.compute_grpo_passk_outcome_advantage; Pass@k training arXiv:2503.19595")
def grpo_passk(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO: in each uid group only the best row gets ``max - second_max`` (divided by
    ``std + 1e-6`` of the group when ``norm_adv_by_std_in_grpo``, which verl reads from the config
    here); every other row gets 0. A group of one fails its step (verl raises ValueError)."""
    b = inp.batch
    scores = b.rows.column_sum(inp.rewards)
    g, n = b.group_ids, b.n_groups
    _, std, cnt = seg_std(scores, g, n)
    flag_rows(
        inp.errors, cnt[g] < 2, b,
        "grpo_passk: a uid group has a single response; Pass@k needs at least 2 samples per group "
        "(verl raises ValueError)",
    )
    gmax = seg_max(scores, g, n)
    rows = torch.arange(scores.numel(), device=scores.device)
    cand = torch.where(scores == gmax[g], rows, torch.full_like(rows, scores.numel()))
    best = torch.full((n,), scores.numel(), dtype=torch.long, device=scores.device)
    best.scatter_reduce_(0, g, cand, reduce="amin", include_self=True)
    is_best = best[g] == rows
    second = seg_max(torch.where(is_best, torch.full_like(scores, float("-inf")), scores), g, n)
    gap = gmax - second  # Pass@k training (arXiv:2503.19595): only the top sample is credited
    if inp.settings["algorithm.norm_adv_by_std_in_grpo"]:
        gap = gap / (std + GRPO_EPS)
    scalar = torch.where(is_best & (cnt[g] >= 2), gap[g], torch.zeros_like(scores))
    adv = broadcast(scalar, inp.mask, b.rows)
    return adv, adv


GDPO_KEYS = "algorithm.gdpo_reward_keys"
GDPO_WEIGHTS = "algorithm.gdpo_reward_weights"


def gdpo_components(settings: EngineSettings) -> tuple[list[str], list[float]]:
    """gdpo's reward-component columns and their weights (default all 1), or the
    :class:`~rldiag.errors.ConfigError` verl's ``compute_gdpo_outcome_advantage`` would give:
    the one place the rule is written (the registration's ``check`` and the estimator use it)."""
    keys = settings.get(GDPO_KEYS)
    if not keys:
        raise ConfigError(
            f"gdpo needs {GDPO_KEYS}: the reward-component columns to normalise, verl asserts it is set "
            f"(e.g. --set {GDPO_KEYS}=format_reward,accuracy_reward)"
        )
    weights = settings.get(GDPO_WEIGHTS)
    weights = [1.0] * len(keys) if weights is None else list(weights)
    if len(weights) < len(keys):
        raise ConfigError(
            f"{GDPO_WEIGHTS} has {len(weights)} weights for {len(keys)} reward keys (verl raises IndexError)"
        )
    return list(keys), [float(w) for w in weights]


def _gdpo_needs(settings: EngineSettings) -> tuple[str, ...]:
    keys = settings.get(GDPO_KEYS)
    return tuple(keys) if keys else (f"the setting {GDPO_KEYS} (reward-component columns)",)


@ESTIMATORS.register("gdpo", needs_fn=_gdpo_needs, check=gdpo_components, whitens="step",
                     grouped=True, source="verl core_algos.compute_gdpo_outcome_advantage; GDPO arXiv:2601.05242")
def gdpo(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO: exact GRPO (std-normalised) on each reward-component column named by
    ``algorithm.gdpo_reward_keys`` separately, weighted sum (``algorithm.gdpo_reward_weights``,
    default all 1), then whitened over each step's mask and masked. returns == advantages.

    verl's dispatcher never passes ``norm_adv_by_std_in_grpo`` to gdpo, so each component is always
    divided by its group std (+1e-6).
    """
    b = inp.batch
    keys, weights = gdpo_components(inp.settings)
    w = torch.tensor(list(weights), dtype=torch.float32, device=inp.mask.device)
    total = None
    for i, key in enumerate(keys):
        comp = require_extra(inp, key, "gdpo", "a reward component listed in algorithm.gdpo_reward_keys")
        part = w[i] * broadcast(grpo_scalar(comp.to(torch.float32), b.group_ids, b.n_groups, True), inp.mask, b.rows)
        total = part if total is None else total + part
    assert total is not None  # gdpo_components gives at least one key
    adv = step_whiten(total, inp.mask, b.rows, b.step_ids, b.n_steps, inp.errors, "gdpo advantage whitening") * inp.mask
    return adv, adv


# ---- RLOO family and other group baselines -----------------------------------------------------


@ESTIMATORS.register("rloo", needs=(), grouped=True, source="verl core_algos.compute_rloo_outcome_advantage; arXiv:2402.14740")
def rloo(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out baseline: ``n/(n-1) * (score - group mean)``; a singleton group keeps its
    raw score (verl's ``rloo``; ``rloo_vectorized`` zeroes it instead)."""
    scores = inp.rows.sum(inp.rewards)
    mean, _, cnt = group_stats(scores, inp.batch.group_ids, inp.batch.n_groups)
    factor = cnt / (cnt - 1).clamp_min(1)
    scalar = torch.where(cnt > 1, scores * factor - mean * factor, scores)  # RLOO (arXiv:2402.14740)
    adv = broadcast(scalar, inp.mask, inp.rows)
    return adv, adv


@ESTIMATORS.register("rloo_vectorized", needs=(),
                     grouped=True, source="verl core_algos.compute_rloo_vectorized_outcome_advantage; arXiv:2402.14740")
def rloo_vectorized(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out in verl's vectorised form ``(n * R - sum_g R) / (n - 1)``; a singleton group
    gets 0 (unlike ``rloo``)."""
    b = inp.batch
    scores = b.rows.column_sum(inp.rewards)
    cnt = seg_count(b.group_ids, b.n_groups, scores.dtype)[b.group_ids]
    total = seg_sum(scores, b.group_ids, b.n_groups)[b.group_ids]
    scalar = ((cnt * scores - total) / (cnt - 1).clamp_min(1)) * (cnt > 1)  # RLOO (arXiv:2402.14740)
    adv = broadcast(scalar, inp.mask, b.rows)
    return adv, adv


@ESTIMATORS.register("opo", needs=(), grouped=True, source="verl core_algos.compute_opo_outcome_advantage; OPO arXiv:2505.23585")
def opo(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: baseline = length-weighted group mean ``sum(L_i R_i) / sum(L_i)`` with ``L_i`` the row's
    post-correction action-token count (tool tokens not counted); 0 for a singleton group.
    A group whose rows all have ``L = 0`` gets 0/0 = NaN, as in verl (it sits only on mask-0 rows)."""
    b = inp.batch
    scores = b.rows.column_sum(inp.rewards)
    length = b.rows.sum(inp.mask)
    num = seg_sum(length * scores, b.group_ids, b.n_groups)
    den = seg_sum(length, b.group_ids, b.n_groups)
    cnt = seg_count(b.group_ids, b.n_groups, scores.dtype)
    baseline = torch.where(cnt > 1, num / den, torch.zeros_like(num))  # OPO (arXiv:2505.23585), optimal baseline
    adv = broadcast(scores - baseline[b.group_ids], inp.mask, b.rows)
    return adv, adv


@ESTIMATORS.register("gpg", needs=(), grouped=True, source="verl core_algos.compute_gpg_outcome_advantage; GPG arXiv:2504.02546")
def gpg(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: ``alpha * (R - group mean) / f_norm`` with ``alpha = rows / max(#rows with R != 0, 1)``
    over the step and verl's ``f_norm = 1``; singleton groups use mean 0."""
    b = inp.batch
    scores = b.rows.column_sum(inp.rewards)
    rows = seg_count(b.step_ids, b.n_steps, scores.dtype)
    nonzero = seg_sum((scores != 0).to(scores.dtype), b.step_ids, b.n_steps)
    alpha = rows / nonzero.clamp(min=1)  # GPG (arXiv:2504.02546): inverse share of rows with a signal
    mean = group_mean(scores, b)
    adv = broadcast(alpha[b.step_ids] * (scores - mean) / GPG_F_NORM, inp.mask, b.rows)
    return adv, adv
