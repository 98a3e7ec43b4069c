"""rldiag's health signals of the update and of the outputs (:mod:`rldiag.engine.health`,
:mod:`rldiag.engine.repetition`), read by the doctor's rules ``gradient_concentration``,
``degenerate_repetition``, ``empty_responses`` and the reward-hacking rules.

Gradient weight (:mod:`rldiag.engine.gradient_weight`, the one definition): ``|A| x aggregation
weight x not clipped`` over the update's actor tokens (the mask after rollout rejection and the
filters), the aggregation weights of the actor's policy loss (without log-probs: the
aggregation's own weights, nothing clipped).
"""

from __future__ import annotations

import torch

from rldiag.engine.aggregation import token_weights
from rldiag.engine.health import (
    component_means,
    empty_fraction,
    gradient_weight_shares,
    group_std_mean,
    step_bounds,
)
from rldiag.engine.repetition import COMPRESSION_COLUMN, MIN_TOKENS, TEXT_COLUMN, THRESHOLD, repetition_metrics
from rldiag.engine.segments import step_token_bounds
from rldiag.engine.settings import EngineSettings
from rldiag.engine.stages.base import Metric, Stage, State

COMPONENTS = "rldiag.reward_components"
#: the top share of actor tokens ``rldiag/grad_weight/top1pct_share`` looks at
TOP_FRACTION = 0.01


def component_names(s: EngineSettings) -> tuple[str, ...]:
    """The batch columns ``rldiag.reward_components`` names (none when unset)."""
    return tuple(str(c) for c in (s[COMPONENTS] or ()))


def _health(st: State) -> None:
    batch, m = st.batch, st.metrics
    sid, n, rows = batch.step_ids, batch.n_steps, batch.rows
    # the gradient weight: the policy loss's aggregation weights and clip, else the aggregation's own
    pol = st.policy
    w = pol.weights if pol is not None and pol.weights is not None else token_weights(st.agg_mode, st.mask, st.actor_norm)
    clipped = pol.clipped if pol is not None else None
    adv, mask = st.adv, st.mask
    bounds = step_token_bounds(rows, sid, n)
    if bounds is None:  # rows out of step order (never in a packed batch): their tokens put in step order
        order = torch.argsort(sid, stable=True)
        sub, tok = rows.take(order)
        adv, w, mask = adv.index_select(0, tok), w.index_select(0, tok), mask.index_select(0, tok)
        clipped = None if clipped is None else clipped.index_select(0, tok)
        bounds = step_bounds(sid.index_select(0, order).index_select(0, sub.row_ids), n)
    top, clipped_share = gradient_weight_shares(adv, w, mask, bounds, TOP_FRACTION, clipped)
    m["rldiag/grad_weight/top1pct_share"] = top
    if clipped_share is not None:
        # the clipped tokens' share of the weight the unclipped formula would give them all
        m["rldiag/grad_weight/clipped_share"] = clipped_share
    actor_tokens = rows.mask_count(st.mask0)
    m["rldiag/output/empty_fraction"] = empty_fraction(actor_tokens, batch.lengths, sid, n)
    if COMPRESSION_COLUMN in batch.extra:
        rep = repetition_metrics(batch.extra[COMPRESSION_COLUMN], actor_tokens, sid, n)
        m["rldiag/output/repetition_fraction"] = rep["repetition_fraction"]
        m["rldiag/output/compression_ratio/mean"] = rep["compression_ratio_mean"]
    group_step = torch.zeros(batch.n_groups, dtype=torch.long, device=sid.device).index_copy_(0, batch.group_ids, sid)
    m["rldiag/groups/score_std/mean"] = group_std_mean(rows.column_sum(batch.token_level_scores), batch.group_ids,
                                                       batch.n_groups, group_step, n)
    comps = {c: batch.extra[c] for c in component_names(st.settings) if c in batch.extra}
    if comps:
        means, share = component_means(comps, sid, n)
        m.update({f"rldiag/rewards/component/{k}/mean": v for k, v in means.items()})
        m["rldiag/rewards/top_component_share"] = share


def _optional(s: EngineSettings) -> tuple[str, ...]:
    return ("loss_mask", TEXT_COLUMN) + component_names(s)


_R = "rldiag"
_TEXT = (TEXT_COLUMN,)
HEALTH = Stage(
    "health",
    "the gradient weight's concentration on few tokens and on the clipped ones, empty and "
    "repetitive responses (compression ratio of the text), the score's spread within groups, the "
    "reward components' step means",
    _health,
    optional=("loss_mask", TEXT_COLUMN),
    optional_fn=_optional,
    settings=(COMPONENTS,),
    metrics=(
        Metric("rldiag/grad_weight/top1pct_share", "share of the step's gradient weight (|A| x aggregation weight x not "
               "clipped) on its top 1 % of actor tokens by weight (at least one token)", _R),
        Metric("rldiag/grad_weight/clipped_share", "share of the step's unclipped gradient weight (|A| x aggregation "
               "weight) on the tokens the policy loss's clip zeroes (counted in actor/pg_clipfrac)", _R,
               needs=("log_probs", "old_log_probs"), when="every `loss_mode` but gpg, dro, kl_cov"),
        Metric("rldiag/output/empty_fraction", "share of the step's rows with no actor token (mask 1) or of length 0", _R),
        Metric("rldiag/output/repetition_fraction", f"share of the step's rows of >= {MIN_TOKENS} actor tokens whose "
               f"text compresses below {THRESHOLD} (zlib bytes / raw bytes of the last 4 KB), over all its rows", _R,
               needs=_TEXT),
        Metric("rldiag/output/compression_ratio/mean", f"mean compression ratio of the rows of >= {MIN_TOKENS} actor "
               "tokens (NaN: none)", _R, needs=_TEXT),
        Metric("rldiag/groups/score_std/mean", "mean over the step's groups of 2+ rows of the score's std within "
               "the group (torch.std)", _R),
        Metric("rldiag/rewards/component/<name>/mean", "the step mean of each reward component column", _R,
               when="`rldiag.reward_components`"),
        Metric("rldiag/rewards/top_component_share", "the largest |component mean| over the sum of them all", _R,
               when="`rldiag.reward_components`"),
    ),
    uses=("adv", "agg_mode", "actor_norm", "mask", "mask0", "policy"),
    sets=(),
)
