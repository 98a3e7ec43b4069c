"""rldiag's own per-step signals, beyond verl's metrics: the reference KL of the PPO anchor and
of the current policy side by side, and the group, advantage and mask signals the health rules
read (:mod:`rldiag.doctor`)."""

from __future__ import annotations

import torch

from rldiag.engine.batch import Batch
from rldiag.engine.kl import KL_ESTIMATORS, kl_estimate, kl_k1, kl_row_sums
from rldiag.engine.metrics import signal_metrics
from rldiag.engine.segments import MEAN_EPS, seg_count, seg_std, seg_sum, step_mask_count
from rldiag.engine.stages.base import Metric, Stage, State


def _ref_kl(st: State) -> None:
    batch = st.batch
    if batch.ref_log_prob is None:
        return
    sid, n, rows = batch.step_ids, batch.n_steps, batch.rows
    count = step_mask_count(st.mask, rows, sid, n) + MEAN_EPS
    for who, lp in (("old", st.old_lp), ("current", batch.log_probs)):
        if lp is None:
            continue
        keep = who == "old" and st.keep_tokens  # the token values only where they are written
        sums, d = kl_row_sums(lp, batch.ref_log_prob, st.mask, rows, keep_diff=keep)
        for est, row_sum in sums.items():
            st.metrics[f"rldiag/ref_kl/{who}/{est}"] = seg_sum(row_sum, sid, n) / count
        if keep:
            penalty = st.settings["algorithm.kl_penalty"]
            same = KL_ESTIMATORS.get(penalty) is kl_k1
            st.tokens["ref_kl"] = d if same and d is not None else kl_estimate(penalty, lp, batch.ref_log_prob)


_R = "rldiag"
REF_KL = Stage(
    "ref_kl",
    "the reference KL of the PPO anchor and of the current policy, k1 / k2 / k3 over the "
    "rewritten mask; the reward path's estimator per token",
    _ref_kl,
    needs=("ref_log_prob",),
    optional=("old_log_probs", "log_probs"),
    settings=("algorithm.kl_penalty",),
    metrics=(
        Metric("rldiag/ref_kl/old/{k1,k2,k3}", "KL(pi_old || pi_ref) over masked tokens (the anchor: "
               "rollout_log_probs in bypass mode)", _R, needs=("old_log_probs",)),
        Metric("rldiag/ref_kl/current/{k1,k2,k3}", "KL(pi || pi_ref) over masked tokens", _R, needs=("log_probs",)),
    ),
    tokens=("ref_kl",),
    uses=("keep_tokens", "mask", "old_lp"),
    sets=(),
)


def group_flatness(batch: Batch, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group ``(n_groups,)``: its rows, whether it has 2+ rows, and whether those rows' summed
    ``rewards`` are all equal (no group-relative signal)."""
    _, gstd, gcnt = seg_std(batch.rows.sum(rewards), batch.group_ids, batch.n_groups)
    multi = gcnt > 1
    return gcnt, multi, multi & (gstd == 0)


def _group_signal(st: State) -> None:
    batch, s, m = st.batch, st.settings, st.metrics
    sid, n, rows = batch.step_ids, batch.n_steps, batch.rows
    gcnt, multi, flat = group_flatness(batch, st.rewards)
    group_step = torch.zeros(batch.n_groups, dtype=torch.long, device=sid.device).index_copy_(0, batch.group_ids, sid)
    m["rldiag/groups/count"] = seg_count(group_step, n)
    m["rldiag/groups/no_signal_fraction"] = seg_sum(flat.float(), group_step, n) / seg_sum(multi.float(), group_step, n)
    m["rldiag/groups/singleton_fraction"] = seg_sum((gcnt == 1).float(), group_step, n) / seg_count(group_step, n)
    m["rldiag/advantages/positive_fraction"] = seg_sum(rows.masked_positive_count(st.adv, st.mask), sid, n) / (
        step_mask_count(st.mask, rows, sid, n) + MEAN_EPS
    )
    m.update(signal_metrics(batch, st.rewards, st.adv, st.mask, bool(s["algorithm.use_kl_in_reward"]),
                            mask_resets_return=not s.has("reinforce_pp_carry")))


GROUP_SIGNAL = Stage(
    "group_signal",
    "groups (uid per step) without a learning signal, the advantages' sign and centre, the "
    "credit mask-0 tokens cut, the KL penalty flipping a reward's sign",
    _group_signal,
    optional=("loss_mask",),
    settings=("algorithm.use_kl_in_reward", "rldiag.verl_version"),
    metrics=(
        Metric("rldiag/groups/count", "groups (distinct uid) in the step", _R),
        Metric("rldiag/groups/no_signal_fraction", "share of groups of 2+ rows whose summed rewards are all equal "
               "(no group-relative signal)", _R),
        Metric("rldiag/groups/singleton_fraction", "share of groups with a single row", _R),
        Metric("rldiag/advantages/positive_fraction", "share of masked tokens with a positive advantage", _R),
        Metric("rldiag/advantages/centre_offset", "masked mean of the advantages over their std (+-inf: a "
               "constant nonzero advantage)", _R),
        Metric("rldiag/mask/credit_cut_fraction", "share of actor tokens with a mask-0 token later in their row "
               "(REINFORCE++'s mask-resetting return gives them none of the outcome; 0 from verl 0.9.0)", _R),
        Metric("rldiag/rewards/kl_sign_flip_fraction", "share of rows with a nonzero score whose summed reward "
               "has the opposite sign", _R, when="`algorithm.use_kl_in_reward`"),
    ),
    uses=("rewards", "adv", "mask"),
    sets=(),
)
