"""The filters: rows out of the update (docs/algorithms-losses.md, "Filters").

- ``filter`` (after rollout correction, before the advantages): verl's group filter
  (``algorithm.filter_groups``: DAPO's dynamic sampling, in verl's V1 trainer the replay buffer's
  ``_dapo_filtered_keys``) drops every group (rows sharing a uid in a step) of more than one row
  whose ``filter_groups.metric`` has std 0; rldiag's outcome gate (``rldiag.filter.gate_column``
  / ``gate_min``) drops the rows whose column is below ``gate_min``. verl drops before it
  computes anything of the step; here the drop is a rewrite of the update's mask, and the
  advantage estimator runs on the kept rows alone. **The dropped groups are not refilled**: verl
  samples more prompts until the batch is full again, a recorded batch has no more rows, so the
  step trains on fewer rows.
- ``filter_weight`` (after the micro-batch layout, before the actor's loss): the groups whose
  advantages are all 0 leave the update (``rldiag.filter.drop_no_signal_from_denominator``); then
  what the filters kept and the share of the gradient weight (:mod:`rldiag.engine.gradient_weight`)
  the dropped rows had.

Dropped rows leave the update's mask and its denominators (the token-mean token count and the
seq-mean row count). The diagnostics of the recorded batch (rollout correction's, pi_old's, the
mismatch fingerprints, the data metrics' scores and lengths) still see every row. With none of
the keys set the stages do nothing.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from rldiag.engine.advantage import AdvInput, estimate
from rldiag.engine.aggregation import token_weights
from rldiag.engine.filtering import DERIVED_METRICS, REWARD_METRIC, flat_groups, no_signal_groups, row_values
from rldiag.engine.gradient_weight import gradient_weight
from rldiag.engine.policy_loss import PolicyLossInput, policy_loss
from rldiag.engine.segments import seg_count, seg_sum
from rldiag.engine.settings import EngineSettings
from rldiag.engine.stages.actor import ACTOR_LOSS, LOSS_MODE
from rldiag.engine.stages.base import Metric, Stage, State
from rldiag.engine.step_failures import StepErrors
from rldiag.errors import ConfigError

FG = "algorithm.filter_groups"
F = "rldiag.filter"
ACTOR = "actor_rollout_ref.actor"
#: the release difference of the group filter's metric (rldiag/config/verl_versions.py)
CHANGE = "filter_groups_reward_metric"


def _column_of(settings: EngineSettings, name: object) -> tuple[str, ...]:
    """The batch column a filter metric or gate names (none for the derived ones)."""
    if not name or name in DERIVED_METRICS or name == "score":
        return ()
    if name == REWARD_METRIC and settings.has(CHANGE):
        return ()
    return (str(name),)


def _filter_columns(settings: EngineSettings) -> tuple[str, ...]:
    cols = _column_of(settings, settings.get(f"{FG}.metric")) if settings.get(f"{FG}.enable") else ()
    return tuple(dict.fromkeys(cols + _column_of(settings, settings.get(f"{F}.gate_column"))))


def _filter(st: State) -> None:
    s, batch = st.settings, st.batch
    enable, gate = bool(s[f"{FG}.enable"]), s[f"{F}.gate_column"]
    if not enable and gate is None:
        return
    canonical = s.has(CHANGE)
    drop = torch.zeros(batch.n_rows, dtype=torch.bool, device=batch.device)
    if enable:
        metric = s[f"{FG}.metric"]
        if not metric:
            raise ConfigError(f"{FG}.metric must be set when {FG}.enable is true (verl raises ValueError)")
        values = row_values(batch, st.rewards, str(metric), f"{FG}.metric", canonical)
        drop |= flat_groups(values, batch.group_ids, batch.n_groups)[batch.group_ids]
    if gate is not None:
        low = s[f"{F}.gate_min"]
        if low is None:
            raise ConfigError(f"{F}.gate_column={gate!r} needs {F}.gate_min (rows below it are dropped)")
        drop |= row_values(batch, st.rewards, str(gate), f"{F}.gate_column", canonical) < float(low)
    st.dropped, st.mask_before = drop, st.mask
    st.mask = st.mask * batch.rows.expand((~drop).to(st.mask.dtype))


FILTER = Stage(
    "filter",
    "verl's group filter (algorithm.filter_groups, the V1 replay buffer's) and rldiag's outcome gate: "
    "dropped rows leave the update's mask and its denominators, the estimator runs on the kept rows; "
    "dropped groups are not refilled (verl samples more prompts; a recorded batch has no more)",
    _filter,
    needs_fn=_filter_columns,
    settings=(f"{FG}.enable", f"{FG}.metric", f"{F}.gate_column", f"{F}.gate_min", "rldiag.verl_version"),
    uses=("rewards", "mask"),
    sets=("dropped", "mask", "mask_before"),
)


def estimate_filtered(st: State) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The advantage estimator under the filter: ``(advantages, returns)`` of the kept rows
    computed on the kept rows alone (0 on the dropped ones; a step with no kept row fails
    nothing), and the advantages every row would have had without the filter."""
    batch, s = st.batch, st.settings
    assert st.dropped is not None and st.mask_before is not None  # set together by the filter stage
    if not bool(st.dropped.any()):
        adv, ret = estimate(s.estimator, AdvInput(batch, st.rewards, st.mask, s, st.errors, rollout_is_weights=st.is_weights))
        return adv, ret, adv
    before, _ = estimate(s.estimator, AdvInput(batch, st.rewards, st.mask_before, s, StepErrors(batch.steps),
                                               rollout_is_weights=st.is_weights))
    kept = torch.nonzero(~st.dropped).flatten()
    _, tok = batch.rows.take(kept)
    sub = batch.select_rows(kept)
    groups, dense = torch.unique(sub.group_ids, return_inverse=True)
    sub = replace(sub, group_ids=dense, n_groups=int(groups.numel()))
    errors = StepErrors(batch.steps)
    weights = None if st.is_weights is None else st.is_weights[tok]
    adv_k, ret_k = estimate(s.estimator, AdvInput(sub, st.rewards[tok], st.mask[tok], s, errors, rollout_is_weights=weights))

    def spread(x: torch.Tensor) -> torch.Tensor:  # the kept rows' tokens back in the batch's layout, 0 elsewhere
        return torch.zeros(batch.n_tokens, dtype=x.dtype, device=x.device).index_copy_(0, tok, x)

    adv = spread(adv_k)
    ret = adv if ret_k is adv_k else spread(ret_k)
    has_rows = (seg_count(batch.step_ids[kept], batch.n_steps) > 0).cpu()
    for idx, message in errors.messages.items():  # a step with no kept row has nothing to fail on
        bad = torch.zeros(batch.n_steps, dtype=torch.bool, device="cpu")
        bad[idx] = bool(has_rows[idx])
        st.errors.flag(bad, message)
    return adv, ret, before


def baseline_weights(st: State, adv: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The aggregation weights and the clip indicator every token had without the filters: the
    policy loss on ``adv`` and ``mask`` with the unfiltered normalisers (only the aggregation's
    weights, nothing clipped, without log-probs)."""
    s, batch = st.settings, st.batch
    norm = st.global_norm_of(st.segs, filtered=False)
    if batch.log_probs is None or st.old_lp is None:
        return token_weights(st.agg_mode, mask, norm), None
    out = policy_loss(s[LOSS_MODE], PolicyLossInput(
        old_log_prob=st.old_lp, log_prob=batch.log_probs, advantages=adv, mask=mask, agg_mode=st.agg_mode,
        norm=norm, settings=s, rollout_is_weights=st.is_weights, dp_size=st.segs.dp_size,
    ))
    return (token_weights(st.agg_mode, mask, norm) if out.weights is None else out.weights), out.clipped


def _filter_weight(st: State) -> None:
    s, batch = st.settings, st.batch
    rows, sid, n = batch.rows, batch.step_ids, batch.n_steps
    mask_b = st.mask if st.mask_before is None else st.mask_before
    if s[f"{F}.drop_no_signal_from_denominator"]:
        flat = no_signal_groups(st.adv, st.mask, batch)[batch.group_ids]
        st.dropped = flat if st.dropped is None else st.dropped | flat
        st.mask = st.mask * rows.expand((~flat).to(st.mask.dtype))
        st.actor_norm = st.global_norm_of(st.segs)
    if st.dropped is None:
        return
    out = st.dropped.to(torch.float32)
    adv_b = st.adv if st.adv_before is None else st.adv_before
    g = gradient_weight(adv_b, *baseline_weights(st, adv_b, mask_b))
    row_g = rows.sum(g.to(torch.float64))
    total, lost = seg_sum(row_g, sid, n), seg_sum(row_g * out.to(torch.float64), sid, n)
    share = torch.where(total > 0, lost / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(total))
    st.metrics["rldiag/filter/kept_rows"] = seg_sum(1.0 - out, sid, n)
    st.metrics["rldiag/filter/effective_tokens"] = seg_sum(rows.mask_count(st.mask0) * (1.0 - out), sid, n)
    st.metrics["rldiag/filter/dropped_weight_share"] = share.to(torch.float32)


def _filter_weight_settings(s: EngineSettings) -> tuple[str, ...]:
    """The keys ``filter_weight`` reads: with no filter on (the filter stage dropped nothing),
    ``drop_no_signal_from_denominator`` alone (and the keys that say the filters are off)."""
    off = (f"{F}.drop_no_signal_from_denominator", f"{FG}.enable", f"{F}.gate_column")
    if s[f"{F}.drop_no_signal_from_denominator"] or s[f"{FG}.enable"] or s[f"{F}.gate_column"] is not None:
        return FILTER_WEIGHT.settings + off[1:]
    return off


_R = "rldiag"
_WHEN = "`algorithm.filter_groups.enable`, `rldiag.filter.gate_column` or `rldiag.filter.drop_no_signal_from_denominator`"
FILTER_WEIGHT = Stage(
    "filter_weight",
    "the groups whose advantages are all 0 out of the update and its denominators "
    "(rldiag.filter.drop_no_signal_from_denominator); the rows the filters kept, the token-mean "
    "denominator left, the share of the gradient weight the dropped rows had",
    _filter_weight,
    optional=ACTOR_LOSS.needs,  # the policy loss's columns, for the weights without the filters
    optional_fn=ACTOR_LOSS.needs_fn,
    settings=(f"{F}.drop_no_signal_from_denominator", f"{ACTOR}.policy_loss.*", f"{ACTOR}.clip_ratio*", f"{ACTOR}.tau_*",
              f"{ACTOR}.loss_scale_factor", f"{ACTOR}.loss_agg_mode", "rldiag.verl_version"),
    settings_fn=_filter_weight_settings,
    metrics=(
        Metric("rldiag/filter/kept_rows", "rows the filters keep in the update", _R, when=_WHEN),
        Metric("rldiag/filter/effective_tokens", "the update's token-mean denominator after the filters: the "
               "original mask's tokens of the kept rows (summed over the step's mini-batches)", _R, when=_WHEN),
        Metric("rldiag/filter/dropped_weight_share", "share of the step's gradient weight (|A| x aggregation weight "
               "x not clipped, all without the filters) on the rows the filters drop", _R, when=_WHEN),
    ),
    uses=("adv", "adv_before", "agg_mode", "fixed_width", "is_weights", "mask0", "mask_before", "old_lp", "segs", "token_count"),
    sets=("actor_norm", "dropped", "mask"),
)
