"""Diagnostic rollout IS weights: what verl's token-level and sequence-level truncated IS (TIS,
``rollout_is=token`` / ``sequence`` with ``rollout_is_threshold=2.0``) would weigh each token and
row by, computed whenever the batch has ``rollout_log_probs`` and the trainer's ``old_log_probs``
(not in bypass mode, where pi_old is the rollout's), whatever the run's rollout-correction
settings. They are diagnostics only: the loss, the mask and the IS weights it uses
(``rollout_is_weights``) are never touched.

The weights and their statistics are :func:`rldiag.engine.rollout_correction.is_weights`' own, on
the original mask, so ``rldiag/diag_is/token/<stat>`` equals ``rollout_corr/rollout_is_<stat>``
of a run with ``rollout_is=token``, ``rollout_is_threshold=2.0`` (``seq/``: ``rollout_is=sequence``),
without batch normalisation: to the bit at the token level; at the sequence level the mean, std
and effective sample size are taken in closed form per row (:mod:`rldiag.engine.diag_is`) and
differ from verl's token sums in their last float32 bits.
"""

from __future__ import annotations

import torch

from rldiag.engine.diag_is import tis_statistics
from rldiag.engine.rollout_correction import SAFETY_BOUND, CorrectionConfig, is_weights
from rldiag.engine.segments import step_mask_count, step_token_bounds
from rldiag.engine.stages.base import Metric, Stage, State

#: the truncation threshold of the diagnostic weights (verl's default rollout_is_threshold)
THRESHOLD = 2.0
#: the statistics written per level: ``rollout_corr/rollout_is_<stat>`` of that level
STATS = ("mean", "max", "min", "std", "eff_sample_size", "ratio_fraction_high", "ratio_fraction_low")
PREFIX = "rldiag/diag_is/"
LEVELS = {"token": "token", "seq": "sequence"}  # name part -> rollout_is level


def _diag_is(st: State) -> None:
    batch = st.batch
    if batch.rollout_log_probs is None or st.old_lp is None or st.bypass:
        return
    rows, sid, n = batch.rows, batch.step_ids, batch.n_steps
    log_ratio = st.old_lp - batch.rollout_log_probs
    empty = step_mask_count(st.mask0, rows, sid, n) == 0  # no statistic: NaN, never a failed step
    nan = torch.full((n,), float("nan"), dtype=torch.float32, device=sid.device)
    bounds = step_token_bounds(rows, sid, n)
    fused = None if bounds is None else tis_statistics(log_ratio, st.mask0, rows, sid, n, bounds, THRESHOLD)
    if fused is not None:  # one shared pass (rldiag.engine.diag_is)
        levels = {"token": fused.token, "seq": fused.seq}
        st.diag_is_token, ratio = fused.token_weights, fused.seq_ratio
    else:  # a non-finite log-ratio, or rows out of step order: verl's formulas level by level
        levels = {}
        for part, level in LEVELS.items():
            w, levels[part] = is_weights(log_ratio, st.mask0, CorrectionConfig(level, THRESHOLD), rows, sid, n,
                                         seq_stats=False)
            if level == "token":
                st.diag_is_token = w
        row_log = rows.masked_sum(log_ratio, st.mask0)  # the rows' summed log-ratios, as the sequence level sums them
        ratio = torch.exp(torch.clamp(row_log, -SAFETY_BOUND, SAFETY_BOUND))
    # every statistic of both levels in one tensor, NaN where a step has no actor token (one
    # operation, not one a statistic: a pack's fixed cost)
    names = [(part, stat) for part in levels for stat in STATS]
    table = torch.where(empty, nan, torch.stack([levels[part][f"rollout_is_{stat}"].to(torch.float32)
                                                 for part, stat in names]))
    for (part, stat), value in zip(names, table.unbind(0), strict=True):
        st.metrics[f"{PREFIX}{part}/{stat}"] = value
    st.diag_is_seq_ratio, st.diag_is_seq = ratio, ratio.clamp(max=THRESHOLD)
    st.rows.update(is_weight_seq=st.diag_is_seq, is_ratio_seq=st.diag_is_seq_ratio)


_R = "rldiag"
_WHEN = "not `bypass_mode`; whatever `rollout_is` says"
_TOK = "w = min(exp(old - rollout), 2) per actor token"
_SEQ = "w = min(exp(sum of the row's old - rollout), 2) per row, on its actor tokens"
DIAG_IS = Stage(
    "diag_is",
    "diagnostic TIS weights at threshold 2.0, token and sequence level, on the original mask, "
    "whatever the rollout-correction settings; never in the loss",
    _diag_is,
    needs=("rollout_log_probs", "old_log_probs"),
    optional=("loss_mask",),
    metrics=(
        Metric(f"{PREFIX}token/{{mean,max,min,std}}", f"{_TOK}: over the step's actor tokens (= "
               "rollout_corr/rollout_is_* under rollout_is=token, threshold 2.0; NaN: no actor token)", _R, when=_WHEN),
        Metric(f"{PREFIX}token/eff_sample_size", "1 / mean(normalised w^2) of the token weights", _R, when=_WHEN),
        Metric(f"{PREFIX}token/ratio_fraction_{{high,low}}", "share of actor tokens whose ratio is above 2 (below "
               "0.5)", _R, when=_WHEN),
        Metric(f"{PREFIX}seq/{{mean,max,min,std}}", f"{_SEQ}: mean and std over the step's actor tokens; max and "
               "min: of the rows' untruncated ratios (= rollout_corr/rollout_is_* under rollout_is=sequence, "
               "threshold 2.0; mean and std to float32 rounding)", _R, when=_WHEN),
        Metric(f"{PREFIX}seq/eff_sample_size", "1 / mean(normalised w^2) of the sequence weights over actor tokens",
               _R, when=_WHEN),
        Metric(f"{PREFIX}seq/ratio_fraction_{{high,low}}", "share of the step's rows whose sequence ratio is above 2 "
               "(below 0.5)", _R, when=_WHEN),
    ),
    rows=("is_weight_seq", "is_ratio_seq"),
    uses=("bypass", "mask0", "old_lp"),
    sets=("diag_is_token", "diag_is_seq", "diag_is_seq_ratio"),
)
