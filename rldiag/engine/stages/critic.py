"""The critic's update as verl logs it (only where the trainer has a critic: verl's
``need_critic``, ``critic.enable`` else ``adv_estimator == gae``), per emulated micro-batch."""

from __future__ import annotations

from dataclasses import replace

from rldiag.engine.aggregation import AggNorm
from rldiag.engine.critic import value_loss
from rldiag.engine.stages.base import CheckFamily, Metric, Stage, State


def _critic(st: State) -> None:
    batch, s = st.batch, st.settings
    if not (st.use_critic and batch.vpreds is not None and batch.values is not None):
        return
    segs, critic_segs = st.segs, st.critic_segs
    global_norm = s.has("critic_global_norm")
    if global_norm:
        # verl >= 0.9.0 (commit 2eb020aa9): the actor's global normalisers (original-mask token
        # count, batch size) with the critic's own loss_scale_factor; vf_loss is a SUM metric
        base = st.actor_norm if critic_segs is segs else st.global_norm_of(critic_segs)
        critic_norm = replace(base, loss_scale_factor=s.critic_loss_scale_factor)
    else:
        # verl 0.8.0: every normaliser is the micro-batch's own; the metrics are micro-batch means
        critic_norm = AggNorm(seg_ids=critic_segs.seg_ids, n_seg=critic_segs.n_seg, rows=batch.rows,
                              horizon=critic_segs.horizon(batch.lengths, batch.max_response_length, st.fixed_width))
    vf = value_loss(
        batch.vpreds, batch.values, st.ret, st.mask, float(s["critic.cliprange_value"]),
        s.critic_agg_mode, critic_norm,
    )
    st.metrics.update({k: critic_segs.mean(v) for k, v in vf.items()})
    if global_norm:
        st.metrics["critic/vf_loss"] = critic_segs.loss(vf["critic/vf_loss"])


_C = "critic"
_WHEN = "a critic in use (`critic.enable`, else `adv_estimator=gae`)"
CRITIC = Stage(
    "critic",
    "the clipped value loss of vpreds against the returns, per critic micro-batch (verl's "
    "compute_value_loss)",
    _critic,
    needs=("vpreds", "values"),
    # without a critic the stage writes nothing: the columns are not read (4 bytes a token each)
    needs_fn=lambda s: ("vpreds", "values") if s.uses_critic else (),
    settings=("critic.cliprange_value", "critic.loss_agg_mode", "critic.loss_scale_factor",
              "actor_rollout_ref.actor.loss_agg_mode", "actor_rollout_ref.actor.loss_scale_factor", "rldiag.verl_version"),
    metrics=(
        Metric("critic/vf_loss", "0.5 max((v' - G)^2, (clip(v', v +- cliprange_value) - G)^2), aggregated; summed "
               "over micro-batches from verl 0.9.0, their mean before", _C, when=_WHEN),
        Metric("critic/vf_clipfrac", "share of masked tokens where the clipped term is the larger", _C, when=_WHEN),
        Metric("critic/vpred_mean", "the masked mean of vpreds", _C, when=_WHEN),
    ),
    checks=(CheckFamily("critic/vf_loss (vpreds)", 6),),
    uses=("use_critic", "segs", "critic_segs", "actor_norm", "ret", "mask", "mask0", "fixed_width", "token_count",
          "dropped"),
    sets=(),
)
