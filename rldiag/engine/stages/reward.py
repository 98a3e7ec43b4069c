"""The first stages: the PPO anchor (bypass mode), KL in the reward, rollout correction.

verl runs them in this order: ``_compute_old_log_prob`` (``bypass_mode`` copies
``rollout_log_probs`` over ``old_log_probs`` there), ``apply_kl_penalty`` on the *original* mask,
then ``rollout_corr_helper`` (IS weights; rejection rewrites ``response_mask``, rewards at
rejected tokens stay).
"""

from __future__ import annotations

from rldiag.engine.kl_control import initial_kl_state
from rldiag.engine.reward_kl import anchor_column, anchor_log_probs, original_mask, reward_kl
from rldiag.engine.rollout_correction import CorrectionConfig, correct
from rldiag.engine.segments import seg_count
from rldiag.engine.stages.base import CheckFamily, Metric, Stage, State
from rldiag.errors import MissingInputError

RC = "algorithm.rollout_correction"


def _anchor(st: State) -> None:
    st.mask0 = original_mask(st.batch)
    st.bypass = bool(st.settings[f"{RC}.bypass_mode"])
    st.old_lp = anchor_log_probs(st.batch, st.settings)


ANCHOR = Stage(
    "anchor",
    "the original mask (loss_mask, else response_mask) and pi_old: rollout_log_probs in "
    "bypass mode (verl's _compute_old_log_prob), else old_log_probs",
    _anchor,
    needs_fn=lambda s: (anchor_column(s),) if s[f"{RC}.bypass_mode"] else (),
    optional=("loss_mask", "old_log_probs"),
    settings=(f"{RC}.bypass_mode",),
    # bypass mode's update: pi_rollout is the anchor, the current policy the ratio's numerator
    checks=(CheckFamily("algorithm.rollout_correction.bypass_mode (old_log_probs := rollout_log_probs)", 9,
                        needs=("rollout_log_probs", "log_probs")),),
    uses=(),
    sets=("mask0", "bypass", "old_lp"),
)


def _reward_kl(st: State) -> None:
    s, batch = st.settings, st.batch
    if not s["algorithm.use_kl_in_reward"]:
        st.rewards = batch.token_level_scores
        return
    kld, current_kl = reward_kl(batch, s)
    state = st.kl_state or initial_kl_state(s)
    beta = state.advance(s, current_kl, seg_count(batch.step_ids, batch.n_steps))
    st.rewards = batch.token_level_scores - batch.rows.expand(beta[batch.step_ids]) * kld
    st.metrics["actor/reward_kl_penalty"] = current_kl
    st.metrics["actor/reward_kl_penalty_coeff"] = beta


REWARD_KL = Stage(
    "reward_kl",
    "token_level_scores -> token_level_rewards: the KL penalty on the original mask with the "
    "controller's coefficient (verl's apply_kl_penalty)",
    _reward_kl,
    needs=("old_log_probs", "ref_log_prob"),
    needs_fn=lambda s: (anchor_column(s), "ref_log_prob"),
    optional=("loss_mask",),
    settings=("algorithm.use_kl_in_reward", "algorithm.kl_penalty", "algorithm.kl_ctrl.*", f"{RC}.bypass_mode"),
    metrics=(
        Metric("actor/reward_kl_penalty", "the step's KL statistic: mean over rows of the row's masked-mean KL",
               "reward", when="`algorithm.use_kl_in_reward`"),
        Metric("actor/reward_kl_penalty_coeff", "the KL coefficient the step used (fixed, or the adaptive controller's)",
               "reward", when="`algorithm.use_kl_in_reward`"),
    ),
    checks=(CheckFamily("KL in reward (use_kl_in_reward)", 4),),
    uses=("kl_state",),
    sets=("rewards",),
)


def _rollout_correction(st: State) -> None:
    batch = st.batch
    st.mask, st.is_weights = st.mask0, None
    if batch.rollout_log_probs is None or st.bypass:
        return
    cfg = CorrectionConfig.from_settings(st.settings, RC)
    if st.old_lp is None:
        if cfg.active:
            raise MissingInputError(
                "algorithm.rollout_correction (rollout_is / rollout_rs) needs column 'old_log_probs', "
                "which the batch does not have", column="old_log_probs",
            )
        return
    rc = correct(st.old_lp, batch.rollout_log_probs, st.mask0, cfg, batch.rows, batch.step_ids, batch.n_steps)
    for message, bad in rc.failed.items():
        st.errors.flag(bad, message)
    st.mask, st.is_weights = rc.mask, rc.weights
    st.metrics.update(rc.metrics)
    if st.is_weights is not None:
        st.tokens["rollout_is_weights"] = st.is_weights


_RCM = "rollout correction"
ROLLOUT_CORRECTION = Stage(
    "rollout_correction",
    "IS weights, rejection (rewrites response_mask; rewards stay) and off-policy diagnostics, "
    "skipped in bypass mode (verl's rollout_corr_helper)",
    _rollout_correction,
    needs=("rollout_log_probs", "old_log_probs"),
    settings=(f"{RC}.*",),
    metrics=(
        Metric("rollout_corr/rollout_is_{mean,max,min,std}", "the IS weights over the step's masked tokens "
               "(sequence level: max and min from the rows' log-ratios)", _RCM, when="`rollout_is`"),
        Metric("rollout_corr/rollout_is_eff_sample_size", "effective sample size of the IS weights, "
               "1 / mean(normalised w^2)", _RCM, when="`rollout_is`"),
        Metric("rollout_corr/rollout_is_ratio_fraction_{high,low}", "share of raw IS ratios above the upper "
               "(below the lower) threshold", _RCM, when="`rollout_is`"),
        Metric("rollout_corr/rollout_is_seq_{mean,std,max,min,max_deviation}", "the rows' mean IS weights "
               "(max_deviation: the largest distance from 1)", _RCM, when="`rollout_is`"),
        Metric("rollout_corr/rollout_is_seq_fraction_{high,low}", "share of rows whose mean raw ratio is "
               "above the upper (below the lower) threshold", _RCM, when="`rollout_is`"),
        Metric("rollout_corr/rollout_is_oob_ratio", "share of tokens outside IcePop's [lower, upper] band",
               _RCM, when="`rollout_is` with a `lower_upper` `rollout_is_threshold` (IcePop)"),
        Metric("rollout_corr/rollout_is_batch_norm_factor", "the step's mean IS weight the weights were divided by",
               _RCM, when="`rollout_is_batch_normalize`"),
        Metric("rollout_corr/rollout_rs_{masked_fraction,seq_masked_fraction}", "share of tokens (rows) that "
               "rejection masked, every option combined", _RCM, when="`rollout_rs`"),
        Metric("rollout_corr/rollout_rs_<option>_{mean,max,min,std,fraction_high,fraction_low}",
               "one rejection option's statistic (k1, k2, k3; per token or per row) over the step", _RCM,
               when="`rollout_rs`"),
        Metric("rollout_corr/rollout_rs_<option>_seq_{mean,std,max,min,max_deviation,fraction_high,fraction_low}",
               "the option's statistic per row, over the step's rows", _RCM, when="`rollout_rs`"),
        Metric("rollout_corr/rollout_rs_<option>_{masked_fraction,seq_masked_fraction}",
               "share of tokens (rows) the option rejects", _RCM, when="`rollout_rs`"),
        Metric("rollout_corr/{kl,k3_kl}", "KL(pi_rollout || pi_old) over masked tokens, k1 and k3", _RCM),
        Metric("rollout_corr/{training,rollout}_{ppl,log_ppl}", "perplexity of pi_old (training_), of the "
               "rollout policy (rollout_): mean over rows of exp(-mean log p); log_ppl: of -mean log p", _RCM),
        Metric("rollout_corr/{log_ppl_diff,log_ppl_abs_diff,log_ppl_diff_max,log_ppl_diff_min,ppl_ratio}",
               "the rows' log-perplexity differences, rollout - old (ppl_ratio: mean exp of it)", _RCM),
        Metric("rollout_corr/chi2_{token,seq}", "chi-squared divergence of the token (row) ratios, E[rho^2] - 1",
               _RCM),
    ),
    tokens=("rollout_is_weights",),
    checks=(
        CheckFamily("rollout_corr/*", 7),
        CheckFamily("algorithm.rollout_correction rollout_is / rollout_rs (IS weights, rejection)", 8),
    ),
    uses=("bypass", "old_lp", "mask0"),
    sets=("mask", "is_weights", "errors"),
)
