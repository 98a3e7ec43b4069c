"""Advantage estimators, keyed by verl's ``algorithm.adv_estimator`` strings.

Every estimator has one signature: ``fn(inp: AdvInput) -> (advantages, returns)``, both
flat ``(tokens,)`` in the batch's packed layout (``inp.rows``). ``inp.mask`` is the post-correction ``response_mask``; ``inp.rewards`` the
token-level rewards after optional KL shaping (rewards at rejected tokens are not zeroed, as in
verl). Group statistics are segment reductions over ``batch.group_ids`` and whitening over
``batch.step_ids``, so packed steps never mix. Where verl raises on an input the step is flagged in
``inp.errors`` and the other steps go on.

This module holds the outcome and reward-to-go estimators of verl's ``core_algos``; the
optimal-token-baseline pair lives in :mod:`rldiag.engine.estimators_otb` and the agentic
(multi-step trajectory) variants in :mod:`rldiag.engine.estimators_agentic`.
Registration metadata: :class:`EstimatorMeta` (the columns an estimator needs and reads, its
rule on its settings, its source).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rldiag.config.settings import Settings
from rldiag.engine.batch import Batch
from rldiag.engine.errors import StepErrors
from rldiag.engine.layout import Rows
from rldiag.engine.segments import seg_count, seg_max, seg_std, seg_sum
from rldiag.config.verl_versions import has as has_change
from rldiag.engine.scan import (
    gae_segmented,
    reverse_cumsum_segmented,
    reward_to_go_carry_segmented,
    reward_to_go_segmented,
)
from rldiag.engine.whiten import step_whiten
from rldiag.errors import ConfigError, MissingInputError
from rldiag.registry import Entry, Registry

#: verl's ``epsilon`` default of the outcome estimators (added to the group std).
GRPO_EPS = 1e-6
#: verl's ``f_norm`` of GPG (the dispatcher never overrides the function default).
GPG_F_NORM = 1.0


@dataclass
class AdvInput:
    """What an estimator reads.

    Attributes:
        batch: the packed batch (``batch.extra`` holds estimator-specific columns).
        rewards: ``(tokens,)`` token-level rewards.
        mask: ``(tokens,)`` post-correction response_mask.
        settings: resolved settings.
        errors: per-step failures.
        rollout_is_weights: ``(tokens,)`` rollout IS weights when rollout correction computed
            them before the estimator (verl passes them to the optimal-token-baseline pair), else None.
    """

    batch: Batch
    rewards: torch.Tensor
    mask: torch.Tensor
    settings: Settings
    errors: StepErrors
    rollout_is_weights: torch.Tensor | None = None

    @property
    def rows(self) -> Rows:
        """The row layout of the token tensors."""
        return self.batch.rows


AdvFn = Callable[[AdvInput], tuple[torch.Tensor, torch.Tensor]]
@dataclass(frozen=True)
class EstimatorMeta(Entry):
    """An estimator's registration: ``needs``, the columns it always reads; ``needs_fn``,
    settings -> the further columns its settings name (or a description of the setting that
    would name them); ``optional``, columns it reads when the batch has them; ``check``,
    settings -> None, raising :class:`~rldiag.errors.ConfigError` before any work where verl
    would reject the configuration."""

    needs: tuple[str, ...] = ()
    needs_fn: Callable[[Settings], tuple[str, ...]] | None = None
    optional: tuple[str, ...] = ()
    check: Callable[[Settings], None] | None = None


ESTIMATORS: Registry[AdvFn] = Registry("advantage estimator", meta=EstimatorMeta)


# ---- shared helpers ---------------------------------------------------------------------------


def require_extra(inp: AdvInput, name: str, estimator: str, hint: str = "") -> torch.Tensor:
    """``batch.extra[name]``, or a :class:`MissingInputError` naming the column."""
    t = inp.batch.extra.get(name)
    if t is None:
        more = f" ({hint})" if hint else ""
        raise MissingInputError(
            f"{estimator} needs column {name!r}, which the batch does not have{more}", column=name
        )
    return t


def require_field(inp: AdvInput, name: str, estimator: str, hint: str = "") -> torch.Tensor:
    """A standard optional Batch tensor (``values``, ``old_log_probs``, ...) or a precise error."""
    t = getattr(inp.batch, name)
    if t is None:
        more = f" ({hint})" if hint else ""
        raise MissingInputError(
            f"{estimator} needs column {name!r}, which the batch does not have{more}", column=name
        )
    return t


def flag_rows(errors: StepErrors, bad_rows: torch.Tensor, batch: Batch, message: str) -> None:
    """Fail every step holding a row where ``bad_rows`` ``(rows,)`` is true."""
    if bool(bad_rows.any()):
        per_step = seg_sum(bad_rows.to(torch.float32), batch.step_ids, batch.n_steps) > 0
        errors.flag(per_step, message)


def group_stats(
    scores: torch.Tensor, group_ids: torch.Tensor, n_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row ``(rows,)``: group mean, group sample std (two-pass, as ``torch.std`` of the stacked
    group) and group size, with verl's singleton rule (mean 0, std 1 for a group of one)."""
    mean, std, cnt = seg_std(scores, group_ids, n_groups)
    single = cnt <= 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[group_ids], std[group_ids], cnt[group_ids]


def _grpo_scalar(scores: torch.Tensor, group_ids: torch.Tensor, n_groups: int, norm_by_std: bool) -> torch.Tensor:
    """Outcome GRPO scalar per row ``(rows,)``: ``(R - mean) / (std + 1e-6)`` or ``R - mean``."""
    mean, std, _ = group_stats(scores, group_ids, n_groups)
    if norm_by_std:
        return (scores - mean) / (std + GRPO_EPS)  # Shao et al. 2024 (arXiv:2402.03300), eq. GRPO outcome
    return scores - mean  # Dr. GRPO, Liu et al. 2025 (arXiv:2503.20783): no std division


def _broadcast(scalar: torch.Tensor, mask: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``(rows,)`` -> ``(tokens,)``: each row's scalar on its tokens, times the mask."""
    return rows.expand(scalar) * mask


def _gae_scan(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float, rows: Rows
) -> torch.Tensor:
    """verl's mask-skipping GAE recursion; raw advantages ``(tokens,)``.

    At a mask-0 position (tool observation, rejected token) neither the next value nor the
    running advantage is updated, so credit flows across it (verl ``compute_gae_advantage_return``). The recursion
    (Schulman et al. 2016, arXiv:1506.02438) is a segmented scan over the packed rows that
    restarts at each row's end (:func:`rldiag.engine.scan.gae_segmented`); verl's
    one-position-at-a-time form is the reference it is tested against.
    """
    return gae_segmented(rewards, values, mask, rows.last(), gamma, lam)


def _reward_to_go_resetting(rewards: torch.Tensor, mask: torch.Tensor, gamma: float, rows: Rows) -> torch.Tensor:
    """REINFORCE++ reward-to-go of verl 0.8.0 ``(tokens,)``: ``G_t = r_t + gamma * G_{t+1}``,
    where the running return is zeroed *after* position t when ``mask[t] == 0``, so a mask-0
    token keeps its own future but cuts it off from every earlier token (Williams 1992
    REINFORCE return; Hu 2025, arXiv:2501.03262)."""
    return reward_to_go_segmented(rewards, mask, rows.last(), gamma)


def _reward_to_go_carrying(rewards: torch.Tensor, mask: torch.Tensor, gamma: float, rows: Rows) -> torch.Tensor:
    """REINFORCE++ reward-to-go since verl commit 8a1bf6d5b ``(tokens,)``: a mask-0 token neither
    adds its reward nor resets; the running return passes it unchanged and its return is 0
    (verl's ``compute_reinforce_plus_plus_outcome_advantage``). Mask [1, 0, 1], rewards [0, 0, 1]:
    returns [1, 0, 1]."""
    return reward_to_go_carry_segmented(rewards, mask, rows.last(), gamma)


def _reverse_cumsum(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``(tokens,)`` sum of ``x`` from each position to the end of its row (no reset)."""
    return reverse_cumsum_segmented(x, rows)


# ---- critic-based -----------------------------------------------------------------------------


@ESTIMATORS.register("gae", needs=("values",), source="verl core_algos.compute_gae_advantage_return; arXiv:1506.02438")
def gae(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE; returns = raw advantages + values; advantages whitened over each step's mask."""
    b, s = inp.batch, inp.settings
    values = require_field(inp, "values", "gae")
    raw = _gae_scan(inp.rewards, values, inp.mask, float(s["algorithm.gamma"]), float(s["algorithm.lam"]), b.rows)
    returns = raw + values
    adv = step_whiten(raw, inp.mask, b.rows, b.step_ids, b.n_steps, inp.errors, "gae advantage whitening")
    return adv, returns


# ---- GRPO family ------------------------------------------------------------------------------


def _session_final_rows(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """V1 multi-output folding (verl's V1 trainer, ``compute_grpo_outcome_advantage`` on session ids): per row, the index of its session's final
    output row (the first row with the largest ``output_index`` of its (uid, session_id)), and the
    ``(rows,)`` bool of rows that are final outputs."""
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
    optional=("session_id", "output_index"),
    source="verl core_algos.compute_grpo_outcome_advantage; arXiv:2402.03300; Dr. GRPO arXiv:2503.20783",
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
    scores = b.rows.sum(inp.rewards)
    norm = bool(inp.settings["algorithm.norm_adv_by_std_in_grpo"])
    if "session_id" in b.extra and "output_index" in b.extra:
        final_of_row, is_final = _session_final_rows(b)
        fin = torch.nonzero(is_final).flatten()
        scalar_f = _grpo_scalar(scores[fin], b.group_ids[fin], b.n_groups, norm)
        has_tok = b.rows.any(inp.mask > 0)[fin].to(scalar_f.dtype)
        per_final = torch.zeros_like(scores)
        per_final[fin] = scalar_f * has_tok
        adv = _broadcast(per_final[final_of_row], inp.mask, b.rows)
        return adv, adv
    adv = _broadcast(_grpo_scalar(scores, b.group_ids, b.n_groups, norm), inp.mask, b.rows)
    return adv, adv


@ESTIMATORS.register("grpo_vectorized", needs=(), source="verl core_algos.compute_grpo_vectorized_outcome_advantage; arXiv:2402.03300")
def grpo_vectorized(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorised GRPO. Same formula as ``grpo`` with its one-pass group statistics
    (``var = (sum x^2 - (sum x)^2 / n) / max(n - 1, 1)``, clamped at 0, in float32).

    verl's V1 dispatcher passes ``norm_adv_by_std_in_grpo`` only to the exact ``grpo`` key, so this
    estimator always divides by ``std + 1e-6``: the setting is ignored here, as in verl.
    """
    b = inp.batch
    scores = b.rows.sum(inp.rewards).to(torch.float32)
    g, n = b.group_ids, b.n_groups
    count = seg_count(g, n, torch.float32)
    s1 = seg_sum(scores, g, n)
    s2 = seg_sum(scores * scores, g, n)
    mean = s1 / count.clamp_min(1.0)
    var = (s2 - (s1 * s1) / count.clamp_min(1.0)) / (count - 1.0).clamp_min(1.0)
    std = torch.sqrt(torch.clamp(var, min=0.0))
    single = count <= 1.0
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    adv = _broadcast((scores - mean[g]) / (std[g] + GRPO_EPS), inp.mask, b.rows)
    return adv, adv


@ESTIMATORS.register("grpo_passk", needs=(), source="verl core_algos.compute_grpo_passk_outcome_advantage; Pass@k training arXiv:2503.19595")
def grpo_passk(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO: in each uid group only the best row gets ``max - second_max`` (divided by
    ``std + 1e-6`` of the group when ``norm_adv_by_std_in_grpo``, which verl reads from the config
    here); every other row gets 0. A group of one fails its step (verl raises ValueError)."""
    b = inp.batch
    scores = b.rows.sum(inp.rewards)
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
    adv = _broadcast(scalar, inp.mask, b.rows)
    return adv, adv


GDPO_KEYS = "algorithm.gdpo_reward_keys"
GDPO_WEIGHTS = "algorithm.gdpo_reward_weights"


def gdpo_components(settings: Settings) -> tuple[list[str], list[float]]:
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


def _gdpo_needs(settings: Settings) -> tuple[str, ...]:
    keys = settings.get(GDPO_KEYS)
    return tuple(keys) if keys else (f"the setting {GDPO_KEYS} (reward-component columns)",)


@ESTIMATORS.register("gdpo", needs_fn=_gdpo_needs, check=gdpo_components,
                     source="verl core_algos.compute_gdpo_outcome_advantage; GDPO arXiv:2601.05242")
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
        part = w[i] * _broadcast(_grpo_scalar(comp.to(torch.float32), b.group_ids, b.n_groups, True), inp.mask, b.rows)
        total = part if total is None else total + part
    adv = step_whiten(total, inp.mask, b.rows, b.step_ids, b.n_steps, inp.errors, "gdpo advantage whitening") * inp.mask
    return adv, adv


# ---- RLOO family and other group baselines -----------------------------------------------------


@ESTIMATORS.register("rloo", needs=(), source="verl core_algos.compute_rloo_outcome_advantage; arXiv:2402.14740")
def rloo(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out baseline: ``n/(n-1) * (score - group mean)``; a singleton group keeps its
    raw score (verl's ``rloo``; ``rloo_vectorized`` zeroes it instead)."""
    scores = inp.rows.sum(inp.rewards)
    mean, _, cnt = group_stats(scores, inp.batch.group_ids, inp.batch.n_groups)
    factor = cnt / (cnt - 1).clamp_min(1)
    scalar = torch.where(cnt > 1, scores * factor - mean * factor, scores)  # RLOO (arXiv:2402.14740)
    adv = _broadcast(scalar, inp.mask, inp.rows)
    return adv, adv


@ESTIMATORS.register("rloo_vectorized", needs=(), source="verl core_algos.compute_rloo_vectorized_outcome_advantage; arXiv:2402.14740")
def rloo_vectorized(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out in verl's vectorised form ``(n * R - sum_g R) / (n - 1)``; a singleton group
    gets 0 (unlike ``rloo``)."""
    b = inp.batch
    scores = b.rows.sum(inp.rewards)
    cnt = seg_count(b.group_ids, b.n_groups, scores.dtype)[b.group_ids]
    total = seg_sum(scores, b.group_ids, b.n_groups)[b.group_ids]
    scalar = ((cnt * scores - total) / (cnt - 1).clamp_min(1)) * (cnt > 1)  # RLOO (arXiv:2402.14740)
    adv = _broadcast(scalar, inp.mask, b.rows)
    return adv, adv


def _group_mean_singleton_zero(scores: torch.Tensor, batch: Batch) -> torch.Tensor:
    mean, _, _ = group_stats(scores, batch.group_ids, batch.n_groups)
    return mean


@ESTIMATORS.register("opo", needs=(), source="verl core_algos.compute_opo_outcome_advantage; OPO arXiv:2505.23585")
def opo(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: baseline = length-weighted group mean ``sum(L_i R_i) / sum(L_i)`` with ``L_i`` the row's
    post-correction action-token count (tool tokens not counted); 0 for a singleton group.
    A group whose rows all have ``L = 0`` gets 0/0 = NaN, as in verl (it sits only on mask-0 rows)."""
    b = inp.batch
    scores = b.rows.sum(inp.rewards)
    length = b.rows.sum(inp.mask)
    num = seg_sum(length * scores, b.group_ids, b.n_groups)
    den = seg_sum(length, b.group_ids, b.n_groups)
    cnt = seg_count(b.group_ids, b.n_groups, scores.dtype)
    baseline = torch.where(cnt > 1, num / den, torch.zeros_like(num))  # OPO (arXiv:2505.23585), optimal baseline
    adv = _broadcast(scores - baseline[b.group_ids], inp.mask, b.rows)
    return adv, adv


@ESTIMATORS.register("gpg", needs=(), source="verl core_algos.compute_gpg_outcome_advantage; GPG arXiv:2504.02546")
def gpg(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: ``alpha * (R - group mean) / f_norm`` with ``alpha = rows / max(#rows with R != 0, 1)``
    over the step and verl's ``f_norm = 1``; singleton groups use mean 0."""
    b = inp.batch
    scores = b.rows.sum(inp.rewards)
    rows = seg_count(b.step_ids, b.n_steps, scores.dtype)
    nonzero = seg_sum((scores != 0).to(scores.dtype), b.step_ids, b.n_steps)
    alpha = rows / nonzero.clamp(min=1)  # GPG (arXiv:2504.02546): inverse share of rows with a signal
    mean = _group_mean_singleton_zero(scores, b)
    adv = _broadcast(alpha[b.step_ids] * (scores - mean) / GPG_F_NORM, inp.mask, b.rows)
    return adv, adv


# ---- reward-to-go family ----------------------------------------------------------------------


@ESTIMATORS.register("reinforce_plus_plus", needs=(), source="verl core_algos.compute_reinforce_plus_plus_outcome_advantage; arXiv:2501.03262")
def reinforce_plus_plus(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted reward-to-go over the mask, whitened over each step's mask and
    masked. At a mask-0 token (tool observation, rejected token) the running return is carried
    through and the return is 0 (verl >= 0.9.0, commit 8a1bf6d5b); verl 0.8.0 resets it there
    instead, keeping the token's own reward-to-go (``rldiag.verl_version``)."""
    b = inp.batch
    gamma = float(inp.settings["algorithm.gamma"])
    rtg = _reward_to_go_carrying if has_change(inp.settings, "reinforce_pp_carry") else _reward_to_go_resetting
    returns = rtg(inp.rewards, inp.mask, gamma, b.rows)
    adv = step_whiten(returns, inp.mask, b.rows, b.step_ids, b.n_steps, inp.errors, "reinforce_plus_plus whitening")
    return adv * inp.mask, returns


@ESTIMATORS.register("reinforce_plus_plus_baseline", needs=(), source="verl core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage; arXiv:2501.03262")
def reinforce_plus_plus_baseline(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: ``R - group mean`` (mean includes the row; 0 for a singleton group),
    broadcast over the mask, whitened over each step's mask and masked. returns == advantages."""
    b = inp.batch
    scores = b.rows.sum(inp.rewards)
    centred = _broadcast(scores - _group_mean_singleton_zero(scores, b), inp.mask, b.rows)
    adv = step_whiten(centred, inp.mask, b.rows, b.step_ids, b.n_steps, inp.errors, "reinforce_plus_plus_baseline whitening")
    adv = adv * inp.mask
    return adv, adv


@ESTIMATORS.register("remax", needs=("reward_baselines",), source="verl core_algos.compute_remax_outcome_advantage; ReMax arXiv:2310.10505")
def remax(inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: returns = undiscounted reward-to-go of the masked rewards; advantages = returns minus
    the greedy rollout's reward (``reward_baselines``) on mask-1 tokens (mask-0 tokens keep their
    return, as in verl)."""
    rb = require_field(inp, "reward_baselines", "remax", "the greedy rollout's reward per row")
    returns = _reverse_cumsum(inp.rewards * inp.mask, inp.rows)
    adv = returns - inp.rows.expand(rb.to(returns.dtype)) * inp.mask  # ReMax (arXiv:2310.10505), greedy baseline
    return adv, returns


def estimate(name: str, inp: AdvInput) -> tuple[torch.Tensor, torch.Tensor]:
    return ESTIMATORS.get(name)(inp)


# Register the estimators that live in their own modules (they import this module's helpers).
from rldiag.engine import estimators_agentic as _agentic  # noqa: E402,F401
from rldiag.engine import estimators_otb as _otb  # noqa: E402,F401
