"""rldiag's rollout-vs-trainer mismatch fingerprints (:mod:`rldiag.engine.mismatch`) per step, as
``rldiag/mismatch/<statistic>``: computed whenever the batch has ``rollout_log_probs`` and the
trainer's log-probs, whatever the run's rollout-correction settings. The trainer's log-probs are
``old_log_probs``, except in bypass mode, where verl never recomputes them (it copies
``rollout_log_probs`` over ``old_log_probs``: verl's ``apply_bypass_mode``) and the trainer's own
are the update's ``log_probs``. Which causes they point to is :mod:`rldiag.analysis.mismatch`'s
to decide."""

from __future__ import annotations

import torch

from rldiag.engine.mismatch import mismatch_stats
from rldiag.engine.settings import EngineSettings
from rldiag.engine.stages.base import Metric, Stage, State

ENABLE = "rldiag.mismatch.enable"
PREFIX = "rldiag/mismatch/"
BYPASS = "algorithm.rollout_correction.bypass_mode"


def trainer_column(settings: EngineSettings) -> str:
    """The column holding the trainer's log-probs of the sampled tokens: ``old_log_probs``, or the
    update's ``log_probs`` in bypass mode (where ``old_log_probs`` is the rollout's, copied)."""
    return "log_probs" if settings[BYPASS] else "old_log_probs"


def policy_lag(st: State) -> torch.Tensor | None:
    """``(rows,)`` each row's policy lag, ``step - 1 - policy_version``, or None without the column."""
    version = st.batch.extra.get("policy_version")
    if version is None:
        return None
    batch = st.batch
    steps = torch.tensor(batch.steps, dtype=torch.long, device=batch.step_ids.device)
    return steps.index_select(0, batch.step_ids) - 1 - version.to(torch.long)


def _mismatch(st: State) -> None:
    batch = st.batch
    trainer = getattr(batch, trainer_column(st.settings))
    if trainer is None or batch.rollout_log_probs is None or not st.settings[ENABLE]:
        return
    stats = mismatch_stats(trainer, batch.rollout_log_probs, st.mask0, batch.rows, batch.step_ids,
                           batch.n_steps, lag=policy_lag(st))
    st.metrics.update({PREFIX + k: v for k, v in stats.items()})


_R = "rldiag"
_D = "d = old_log_probs - rollout_log_probs over actor tokens"
MISMATCH = Stage(
    "mismatch",
    "the rollout-vs-trainer log-prob gap's fingerprints per step (one-sidedness, slope, shift, "
    "tails, lag), whatever the rollout-correction settings",
    _mismatch,
    needs=("rollout_log_probs", "old_log_probs"),
    needs_fn=lambda s: ("rollout_log_probs", trainer_column(s)),
    optional=("loss_mask", "policy_version"),
    settings=(ENABLE, BYPASS),
    metrics=(
        Metric("rldiag/mismatch/tokens", "actor tokens compared (mask 1, both log-probs finite)", _R),
        Metric("rldiag/mismatch/{gap_mean,gap_std}", f"mean and std of {_D}", _R),
        Metric("rldiag/mismatch/{gap_abs_mean,gap_abs_p99,gap_abs_max}", "mean, 99th percentile and max of |d|", _R),
        Metric("rldiag/mismatch/gap_abs_p95", "95th percentile of |d|: the body's bound (body_*)", _R),
        Metric("rldiag/mismatch/kl_k2", "mean of d^2 / 2 (the k2 KL estimator)", _R),
        Metric("rldiag/mismatch/top_kl_share", "share of the summed d^2 / 2 held by the top 1 % of tokens", _R),
        Metric("rldiag/mismatch/positive_share", "sum of max(d, 0) over sum of |d| (0: one-sided, as "
               "renormalised top-p / top-k log-probs make it)", _R),
        Metric("rldiag/mismatch/slope", "least-squares slope of the trainer's log-probs on the rollout's "
               "(about T_rollout / T_trainer when one side applies another temperature)", _R),
        Metric("rldiag/mismatch/{gap_rollout_corr,logprob_corr}", "correlation of d with the rollout log-prob; "
               "of the two log-probs", _R),
        Metric("rldiag/mismatch/{gap_confident,gap_unconfident}", "mean d over tokens the rollout gave "
               "p >= 0.5 (< 0.05); 0 without such tokens", _R),
        Metric("rldiag/mismatch/{confident_share,unconfident_share}", "share of tokens the rollout gave p >= 0.5 "
               "(< 0.05)", _R),
        Metric("rldiag/mismatch/{gap_position_corr,gap_logprob_corr}", "correlation of |d| with the position in "
               "the response; with |rollout log-prob|", _R),
        Metric("rldiag/mismatch/{pair_abs_gap,shift_next_abs_gap,shift_prev_abs_gap}", "over pairs of adjacent "
               "actor tokens: mean |d|, of |y_t - x_t+1|, of |y_t+1 - x_t| (x trainer, y rollout)", _R),
        Metric("rldiag/mismatch/token_mult_prob_error", "mean of exp(|d|), NeMo RL's token_mult_prob_error "
               "(1 when the two agree; nemo_rl/algorithms/loss_functions.py, ClippedPGLossFn)", _R),
        Metric("rldiag/mismatch/extreme_share", "share of tokens with |d| > ln 2 (a probability ratio outside "
               "[1/2, 2]), AReaL's rollout_train_extreme_frac_tau2", _R),
        Metric("rldiag/mismatch/{body_gap_mean,body_gap_std,body_positive_share,body_slope,body_gap_rollout_corr}",
               "gap_mean, gap_std, positive_share, slope and gap_rollout_corr over the body's tokens, |d| <= "
               "gap_abs_p95 (a handful of outlier tokens left out)", _R),
        Metric("rldiag/mismatch/half_share", "share of tokens whose rollout log-prob is a non-zero bfloat16 or "
               "normal float16 value (the engine's log-softmax in half precision)", _R),
        Metric("rldiag/mismatch/{lag_mean,lag_gap_corr,lag_gap_slope}", "each row's policy lag (step - 1 - "
               "policy_version): its mean, the correlation and slope of the row's mean |d| on it", _R,
               needs=("policy_version",)),
        Metric("rldiag/mismatch/{lag_abs_gap_lag0,lag_abs_gap_lagged}", "mean |d| over on-policy (lag 0) and "
               "lagged rows' tokens (0 without such rows)", _R, needs=("policy_version",)),
        Metric("rldiag/mismatch/lag0_share", "share of tokens in on-policy (lag 0) rows", _R, needs=("policy_version",)),
        Metric("rldiag/mismatch/{lag_body_std_lag0,lag_body_std_lagged}", "std of d over the body's tokens (|d| <= "
               "gap_abs_p95) of on-policy and of lagged rows (0 without such tokens)", _R, needs=("policy_version",)),
        Metric("rldiag/mismatch/lag0_positive_share", "positive_share over the body's tokens of on-policy rows", _R,
               needs=("policy_version",)),
    ),
    uses=("mask0",),
    sets=(),
)
