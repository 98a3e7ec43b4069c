"""The actor's update as verl logs it: the micro-batch layout, the policy loss (with the IS
weights), the entropy and KL losses, their total, and the metrics verl logs where it recomputes
pi_old.

Actor metrics are computed per emulated micro-batch (:mod:`rldiag.engine.microbatch`) and
combined as verl logs them (docs/algorithms-losses.md); token-mean denominators count the
original mask.
"""

from __future__ import annotations

import torch

from rldiag.engine.aggregation import AggNorm, aggregate
from rldiag.engine.kl import kl_estimate
from rldiag.engine.metrics import rollout_probs_metrics
from rldiag.engine.microbatch import Segmentation, segmentations_for
from rldiag.engine.policy_loss import POLICY_LOSSES, PolicyLossInput, PolicyLossOutput, policy_loss
from rldiag.engine.policy_loss.base import LossMeta
from rldiag.engine.reward_kl import anchor_column
from rldiag.engine.segments import seg_max, step_mask_count
from rldiag.engine.settings import EngineSettings
from rldiag.engine.stages.base import CheckFamily, Metric, Stage, State
from rldiag.engine.step_failures import StepErrors

ACTOR = "actor_rollout_ref.actor"
LOSS_MODE = f"{ACTOR}.policy_loss.loss_mode"
#: the keys that lay a step out in mini- and micro-batches over DP ranks (engine/batch_layout.py)
LAYOUT_SETTINGS = (
    "trainer.use_v1", "trainer.balance_batch", "trainer.critic_warmup", "rldiag.verl_version", "rldiag.rows_balanced",
    "rldiag.capture.trainer", "rldiag.mini_batch_size", "rldiag.micro_batch_size", "rldiag.dp_size",
    "actor_rollout_ref.rollout.n", "critic.enable", "algorithm.adv_estimator", f"{ACTOR}.ppo_*",
    f"{ACTOR}.use_dynamic_bsz", f"{ACTOR}.shuffle", f"{ACTOR}.data_loader_seed", "critic.ppo_*", "critic.use_dynamic_bsz",
    "critic.shuffle", "critic.data_loader_seed", f"{ACTOR}.loss_agg_mode", f"{ACTOR}.loss_scale_factor",
)


def _layout(st: State) -> None:
    batch, s = st.batch, st.settings
    sid, n = batch.step_ids, batch.n_steps
    seq_len = batch.lengths if batch.prompt_length is None else batch.lengths + batch.prompt_length.to(batch.lengths.dtype)
    st.segs, st.critic_segs = segmentations_for(sid, n, s, seq_len, list(batch.steps), batch.extra.get("batch_position"))
    for message, bad in {**st.segs.failed, **st.critic_segs.failed}.items():
        st.errors.flag(bad.to(sid.device), message)
    # seq-mean-token-sum-norm's fallback divisor: the V1 trainer pads per micro-batch (its longest
    # row); the legacy one to data.max_response_length (else the step's longest row)
    use_v1 = s["trainer.use_v1"]
    st.fixed_width = not (s.has("v1_trainer") if use_v1 is None else use_v1)
    st.token_count = step_mask_count(st.mask0, batch.rows, sid, n)
    st.actor_norm = st.global_norm_of(st.segs)
    st.agg_mode = s.actor_agg_mode


LAYOUT = Stage(
    "layout",
    "each step's rows -> (mini-batch, DP rank, micro-batch) segments in verl's order, for the "
    "actor and the critic, and the actor's global normalisers",
    _layout,
    optional=("prompt_length", "batch_position"),
    settings=LAYOUT_SETTINGS,
    uses=("mask0", "dropped"),
    sets=("segs", "critic_segs", "errors", "fixed_width", "token_count", "actor_norm", "agg_mode"),
)


def combine_policy_loss(out: PolicyLossOutput, segs: Segmentation, errors: StepErrors) -> dict[str, torch.Tensor]:
    """Per-segment policy-loss results -> per-step metrics as verl logs them: ``actor/pg_loss``
    summed over a step's micro-batches (global normalisation), verl's metrics averaged with equal
    weight, rldiag's counts summed. Segments on which verl raises fail their step."""
    for message, bad in out.failed.items():
        errors.flag(segs.total(bad.float()) > 0, message)
    combined = {"actor/pg_loss": segs.loss(out.pg_loss)}
    combined.update({k: segs.mean(v) for k, v in out.metrics.items()})
    combined.update({k: segs.total(v) for k, v in out.sums.items()})
    return combined


def _actor_loss(st: State) -> None:
    batch, s = st.batch, st.settings
    if batch.log_probs is None or st.old_lp is None:
        return
    out = policy_loss(
        s[LOSS_MODE],
        PolicyLossInput(
            old_log_prob=st.old_lp,
            log_prob=batch.log_probs,
            advantages=st.adv,
            mask=st.mask,
            agg_mode=st.agg_mode,
            norm=st.actor_norm,
            settings=s,
            rollout_is_weights=st.is_weights,
            dp_size=st.segs.dp_size,
        ),
    )
    st.metrics.update(combine_policy_loss(out, st.segs, st.errors))
    st.tokens.update(ratio=out.ratio, pg_losses=out.pg_losses)
    st.policy = out  # its per-token weights and clip indicators: the turns and rows stages


def _loss_columns(settings: EngineSettings) -> tuple[str, ...]:
    """The chosen policy loss's columns (its registration's ``needs=``), ``old_log_probs`` being
    the PPO anchor (``rollout_log_probs`` in bypass mode)."""
    anchor = anchor_column(settings)
    return tuple(anchor if c == "old_log_probs" else c for c in POLICY_LOSSES.meta(settings[LOSS_MODE]).needs)


_A = "actor"
ACTOR_LOSS = Stage(
    "actor_loss",
    "the policy loss loss_mode per micro-batch with the IS weights, combined per step as verl "
    "logs it (its columns are its registration's needs=)",
    _actor_loss,
    needs=LossMeta().needs,  # a policy loss's columns unless its registration says otherwise
    needs_fn=_loss_columns,
    settings=(f"{ACTOR}.policy_loss.*", f"{ACTOR}.clip_ratio*", f"{ACTOR}.tau_*", f"{ACTOR}.loss_scale_factor",
              f"{ACTOR}.loss_agg_mode", "rldiag.verl_version"),
    metrics=(
        Metric("actor/pg_loss", "the policy loss, summed over the step's micro-batches", _A),
        Metric("actor/ppo_kl", "the masked mean of log pi_old - log pi (kl_cov: of its absolute value)", _A),
        Metric("actor/pg_clipfrac", "share of masked tokens the clip (or the loss's own bound) is active on",
               _A, when="every `loss_mode` but gpg, dro, kl_cov"),
        Metric("actor/pg_clipfrac_lower", "share of masked tokens the lower (dual-clip) bound is active on",
               _A, when="`loss_mode` of the PPO-clip family: vanilla, up, gspo, sapo, cispo, dppo_*, geo_mean"),
        Metric("actor/rollout_corr/*", "bypass mode's rollout correction of the current policy against "
               "pi_rollout, per micro-batch", _A, needs=("rollout_log_probs",), when="`loss_mode=bypass_mode`"),
        Metric("rldiag/clip_cov/{candidates,clipped}", "tokens Clip-Cov could clip, and those it clipped",
               "rldiag", when="`loss_mode=clip_cov`"),
        Metric("rldiag/kl_cov/selected", "tokens KL-Cov's penalty selected", "rldiag", when="`loss_mode=kl_cov`"),
    ),
    tokens=("ratio", "pg_losses"),
    checks=(CheckFamily("actor/* (pg_loss, pg_clipfrac, ppo_kl)", 1),),
    uses=("old_lp", "adv", "mask", "agg_mode", "actor_norm", "is_weights", "segs"),
    sets=("errors", "policy"),
)


def _entropy_loss(st: State) -> None:
    if st.batch.entropy is not None:
        st.metrics["actor/entropy_loss"] = st.segs.loss(aggregate(st.agg_mode, st.batch.entropy, st.mask, st.actor_norm))


ENTROPY_LOSS = Stage(
    "entropy_loss",
    "the entropy aggregated like the policy loss (loss_agg_mode), summed over micro-batches",
    _entropy_loss,
    needs=("entropy",),
    metrics=(Metric("actor/entropy_loss", "the current policy's entropy, aggregated as the loss is", _A),),
    checks=(CheckFamily("actor/entropy_loss", 2),),
    uses=("segs", "agg_mode", "mask", "actor_norm"),
    sets=(),
)


def _kl_loss(st: State) -> None:
    batch, s = st.batch, st.settings
    if not (s[f"{ACTOR}.use_kl_loss"] and batch.ref_log_prob is not None and batch.log_probs is not None):
        return
    kld = kl_estimate(s[f"{ACTOR}.kl_loss_type"], batch.log_probs, batch.ref_log_prob)
    st.metrics["actor/kl_loss"] = st.segs.loss(aggregate(st.agg_mode, kld, st.mask, st.actor_norm))
    st.metrics["actor/kl_coef"] = torch.full((batch.n_steps,), float(s[f"{ACTOR}.kl_loss_coef"]), device=batch.step_ids.device)


KL_LOSS = Stage(
    "kl_loss",
    "the KL loss of the current policy to the reference (kl_loss_type), aggregated like the loss",
    _kl_loss,
    needs=("log_probs", "ref_log_prob"),
    settings=(f"{ACTOR}.use_kl_loss", f"{ACTOR}.kl_loss_type", f"{ACTOR}.kl_loss_coef"),
    metrics=(
        Metric("actor/kl_loss", "KL(pi || pi_ref) by kl_loss_type, aggregated as the loss is", _A,
               when="`actor_rollout_ref.actor.use_kl_loss`"),
        Metric("actor/kl_coef", "kl_loss_coef", _A, when="`actor_rollout_ref.actor.use_kl_loss`"),
    ),
    checks=(CheckFamily("actor/kl_loss (use_kl_loss)", 3),),
    uses=("segs", "agg_mode", "mask", "actor_norm"),
    sets=(),
)


def _total_loss(st: State) -> None:
    m = st.metrics
    if "actor/pg_loss" not in m:
        return
    # the update's total loss (verl's actor/loss, summed over micro-batches like its parts)
    total = m["actor/pg_loss"]
    if "actor/entropy_loss" in m:
        total = total - float(st.settings[f"{ACTOR}.entropy_coeff"]) * m["actor/entropy_loss"]
    if "actor/kl_loss" in m:
        total = total + m["actor/kl_coef"] * m["actor/kl_loss"]
    m["actor/loss"] = total


TOTAL_LOSS = Stage(
    "total_loss",
    "the update's total loss: pg_loss - entropy_coeff * entropy_loss + kl_coef * kl_loss",
    _total_loss,
    needs=LossMeta().needs,
    needs_fn=_loss_columns,
    optional=("entropy", "ref_log_prob"),
    settings=(f"{ACTOR}.entropy_coeff",),
    metrics=(Metric("actor/loss", "the total loss the actor's update minimises, summed over micro-batches", _A),),
    uses=("metrics:actor/pg_loss", "metrics:actor/entropy_loss", "metrics:actor/kl_loss", "metrics:actor/kl_coef"),
    sets=(),
)


def _old_policy(st: State) -> None:
    # logged where verl recomputes pi_old (_compute_old_log_prob; skipped in bypass mode), on
    # the original mask: the old policy's entropy aggregated over the whole step, and the
    # rollout engine's probabilities against the trainer's
    if st.bypass:
        return
    batch, s = st.batch, st.settings
    sid, n = batch.step_ids, batch.n_steps
    if batch.entropy is not None:
        step_norm = AggNorm(seg_ids=sid, n_seg=n, horizon=batch.max_response_length if st.fixed_width else
                            seg_max(batch.lengths.to(torch.float32), sid, n), rows=batch.rows,
                            loss_scale_factor=s[f"{ACTOR}.loss_scale_factor"])
        st.metrics["actor/entropy"] = aggregate(st.agg_mode, batch.entropy, st.mask0, step_norm)
    if batch.rollout_log_probs is not None and batch.old_log_probs is not None:
        st.metrics.update(rollout_probs_metrics(batch.old_log_probs, batch.rollout_log_probs, st.mask0, batch.rows, sid, n))


_T = "training"
OLD_POLICY = Stage(
    "old_policy",
    "what verl logs where it recomputes pi_old (not in bypass mode), on the original mask",
    _old_policy,
    optional=("entropy", "rollout_log_probs", "old_log_probs"),
    settings=(f"{ACTOR}.loss_scale_factor",),
    metrics=(
        Metric("actor/entropy", "the old policy's entropy aggregated over the whole step", _A, needs=("entropy",),
               when="not `bypass_mode`"),
        Metric("training/rollout_probs_diff_{valid,max,mean,std}", "the distance between p_old and p_rollout over masked tokens "
               "(valid: 1 when the step has any)", _T, needs=("rollout_log_probs", "old_log_probs"),
               when="not `bypass_mode`"),
        Metric("training/rollout_actor_probs_pearson_corr", "Pearson correlation of p_old and p_rollout", _T,
               needs=("rollout_log_probs", "old_log_probs"), when="not `bypass_mode`"),
    ),
    uses=("bypass", "fixed_width", "agg_mode", "mask0"),
    sets=(),
)
