"""Turns as a unit: a turn is a maximal run of actor tokens (mask 1 of the original mask:
``loss_mask`` when the batch has it, else ``response_mask``) inside a row, numbered from 1 in its
row; tool-observation tokens (mask 0) belong to no turn (turn 0). Per step, the statistics of
turns 1..8 and of every later turn together (``9plus``), and the turns per row.

The statistics are over the tokens the update trains on (the mask after rollout rejection: the
actor mask itself without ``rollout_rs``): for turn ``k``, ``T_k`` those of its tokens over the
step. A turn no row of the step has gives ``tokens`` 0 and 0 for every other statistic (as the
mismatch statistics do: a mean over no token is 0, ``tokens`` says there was none), so every name
is written on every step and ordinary runs hold no NaN.

Vectorised: a token's turn is the running count of its row's turn starts (a mask-1 token whose
predecessor in the row is mask 0, or the row's first token; :func:`number_turns`); the per-turn sums are per-row
segment reductions over *spans* (each row cut at its turn starts, so a span is one turn and the
tool tokens after it, or a row's leading tool tokens), then per (step, turn). Where no row has a
turn after its first token (single-turn rows without leading tool tokens:
:func:`inner_turn_starts` is 0), the spans are the rows themselves and nothing is cut.
"""

from __future__ import annotations

import torch

from rldiag.engine import span_native
from rldiag.engine.host import count_true, nonzero_indices, positive, running_sum_on
from rldiag.engine.kl import kl_k1
from rldiag.engine.layout import OffsetRows, Rows
from rldiag.engine.segments import seg_max, seg_mean
from rldiag.engine.stages.base import Metric, Stage, State, TurnSpans, per_bucket

#: turns reported one by one; later turns are pooled as ``9plus``
MAX_TURN = 8
BUCKETS = tuple(str(k) for k in range(1, MAX_TURN + 1)) + (f"{MAX_TURN + 1}plus",)
PREFIX = "rldiag/turns/"


def turn_index(mask: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``(tokens,)`` int32: each token's turn in its row (1, 2, ...: the maximal runs of ``mask``
    1 in order), 0 where ``mask`` is 0 (:func:`number_turns` of :func:`turn_starts`)."""
    on = positive(mask)
    if rows.n_tokens == 0:
        return torch.zeros(0, dtype=torch.int32, device=mask.device)
    starts = turn_starts(on, rows)
    return number_turns(starts, on, rows, rows.count(starts))


def number_turns(starts: torch.Tensor, on: torch.Tensor, rows: Rows, turns: torch.Tensor) -> torch.Tensor:
    """``(tokens,)`` int32 each token's turn from the turn starts ``starts`` ``(tokens,)`` bool, the
    actor tokens ``on`` ``(tokens,)`` bool and each row's turns ``turns`` ``(rows,)``. No loop over
    rows and no per-token gather: one int32 running count of the starts, from which each row's end
    takes away the row's turns (so the count restarts at 0 in the next row), times ``on``."""
    count = starts.to(torch.int32)
    ends = rows.offsets[1:-1]  # where each row but the last ends
    inside = ends < rows.n_tokens
    count.index_add_(0, ends[inside], turns[:-1][inside].to(torch.int32).neg_())
    return running_sum_on(count, on)


def turn_starts(on: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``(tokens,)`` bool: the token starts a turn (``on``, and the row's first token or after an
    off one): ``on > previous on`` (true only for on after off), then each row's first token
    set to its own ``on``."""
    out = on.clone()
    if on.numel() > 1:
        torch.gt(on[1:], on[:-1], out=out[1:])
    first = rows.offsets[:-1][rows.lengths > 0]
    out[first] = on.index_select(0, first)
    return out


def step_loss_weights(st: State) -> torch.Tensor | None:
    """``(tokens,)`` each token's weight in its step's ``actor/pg_loss`` (the loss's aggregation
    weights over the step's micro-batches, averaged over mini-batches as verl logs it): a row's sum
    is its share of the loss. None without the actor's loss."""
    if st.policy is None or st.policy.weights is None:
        return None
    scale = st.segs.loss_scale().index_select(0, st.segs.seg_ids)
    return st.policy.weights * st.batch.rows.expand(scale)


def _per_turn(key: torch.Tensor, live: torch.Tensor, n: int, span_sums: torch.Tensor) -> torch.Tensor:
    return per_bucket(key, live, n, len(BUCKETS), span_sums)


def _write(st: State, out: dict[str, torch.Tensor]) -> None:
    for stat, table in out.items():
        by_bucket = table.t().to(torch.float32).contiguous()  # (buckets, n_steps): one conversion
        for b, bucket in enumerate(BUCKETS):
            st.metrics[f"{PREFIX}{bucket}/{stat}"] = by_bucket[b]


def inner_turn_starts(starts: torch.Tensor, rows: Rows) -> int:
    """How many of the turn starts ``starts`` ``(tokens,)`` bool (:func:`turn_starts`) are after
    their row's first token (0: every row has at most one turn, from its first token)."""
    first = rows.offsets[:-1][rows.lengths > 0]
    return count_true(starts) - int(torch.count_nonzero(starts.index_select(0, first)))


def _write_turn_stats(st: State, ts: TurnSpans, span_sums: dict[str, torch.Tensor]) -> None:
    """The per-turn means of the span sums (and the turns' tokens) as metrics."""
    sums = {"advantage": ts.per_turn(span_sums["advantage"])}
    if "is_weight" in span_sums:
        sums["is_weight"] = ts.per_turn(span_sums["is_weight"])
        sums["rollout_kl"] = ts.per_turn(span_sums["rollout_kl"])
    _write(st, {"tokens": ts.count, **ts.means(sums)})


def _span_sums(st: State, spans: Rows) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mask's sum over each span (or row) and the masked sums the per-turn means read
    ``(spans,)``: on the host in one compiled read (:mod:`rldiag.engine.span_native`), else
    torch's masked sums."""
    mask, is_w, old, roll = st.mask, st.diag_is_token, st.old_lp, st.batch.rollout_log_probs
    if is_w is not None and old is not None and roll is not None:
        fused = span_native.span_sums([st.adv, is_w], mask, spans.offsets, (old, roll))
        if fused is not None:
            return fused[0], dict(zip(("advantage", "is_weight", "rollout_kl"), fused[1]))
        return spans.mask_count(mask), {"advantage": spans.masked_sum(st.adv, mask),
                                        "is_weight": spans.masked_sum(is_w, mask),
                                        "rollout_kl": spans.masked_sum(kl_k1(old, roll), mask)}
    fused = span_native.span_sums([st.adv], mask, spans.offsets)
    if fused is not None:
        return fused[0], {"advantage": fused[1][0]}
    return spans.mask_count(mask), {"advantage": spans.masked_sum(st.adv, mask)}


def single_turn_stats(st: State, on0: torch.Tensor) -> None:
    """The turns where no row has a turn after its first token (:func:`inner_turn_starts` is 0):
    a row's one turn is every actor token of it, so the spans are the rows themselves (the same
    sums as :func:`multi_turn_stats` over them, to the bit) and every token's turn is its mask.
    ``on0`` ``(tokens,)`` bool: the original mask's actor tokens."""
    batch = st.batch
    rows, sid, n = batch.rows, batch.step_ids, batch.n_steps
    st.tokens["turn"] = st.turn = on0.to(torch.int32)
    first = rows.offsets[:-1].clamp(max=max(rows.n_tokens - 1, 0))
    has = (rows.lengths > 0) & (st.mask0.index_select(0, first) > 0) if rows.n_tokens else rows.lengths > 0
    turns = has.to(torch.float32)  # a row has its one turn where its first token is an actor token
    st.rows["turns"] = turns.to(torch.long)
    st.metrics[f"{PREFIX}count/mean"] = seg_mean(turns, sid, n)
    st.metrics[f"{PREFIX}count/max"] = seg_max(turns, sid, n)
    key = sid * len(BUCKETS)  # every row's turn is turn 1
    count, sums = _span_sums(st, rows)
    ts = TurnSpans(rows, key, has, n, _per_turn(key, has, n, count))
    st.turn_spans = ts
    _write_turn_stats(st, ts, sums)


def multi_turn_stats(st: State, on0: torch.Tensor, starts: torch.Tensor, turn_at: torch.Tensor | None = None) -> None:
    """The turns in general: each token's turn numbered from the turn starts, and the rows cut at
    their turn starts into spans whose masked sums are added up per (step, turn bucket). ``on0``
    ``(tokens,)`` bool the original mask's actor tokens, ``starts`` their turn starts, ``turn_at``
    ``(turns,)`` where they are (found from ``starts`` when None)."""
    batch = st.batch
    rows, sid, n = batch.rows, batch.step_ids, batch.n_steps
    if turn_at is None:
        turn_at = nonzero_indices(starts)  # where each turn starts
    turns = torch.bincount(rows.row_ids.index_select(0, turn_at), minlength=rows.n_rows)[:rows.n_rows].to(torch.float32)
    st.tokens["turn"] = st.turn = turn = number_turns(starts, on0, rows, turns)
    st.rows["turns"] = turns.to(torch.long)
    st.metrics[f"{PREFIX}count/mean"] = seg_mean(turns, sid, n)
    st.metrics[f"{PREFIX}count/max"] = seg_max(turns, sid, n)

    # spans: every row cut at its turn starts; each span lies in one turn (or before the first)
    first = rows.offsets[:-1][rows.lengths > 0]
    cut = torch.unique(torch.cat([turn_at, first]))  # sorted: the turn starts and the rows' first tokens
    # the spans' sums read their offsets only: no token's span id is made (8 bytes a token)
    spans = OffsetRows(torch.cat([cut, torch.full((1,), rows.n_tokens, dtype=torch.long, device=cut.device)]),
                       rows.n_tokens)
    span_turn = turn.index_select(0, cut)
    nb = len(BUCKETS)
    key = sid.index_select(0, rows.row_ids.index_select(0, cut)) * nb + (span_turn.clamp(min=1, max=nb) - 1)
    live = span_turn > 0  # a row's leading tool tokens: no turn
    count, sums = _span_sums(st, spans)
    ts = TurnSpans(spans, key, live, n, _per_turn(key, live, n, count))
    st.turn_spans = ts
    _write_turn_stats(st, ts, sums)


def _turns(st: State) -> None:
    rows = st.batch.rows
    on0 = positive(st.mask0)
    starts = turn_starts(on0, rows)
    turn_at = nonzero_indices(starts)  # where each turn starts; as inner_turn_starts counts them:
    first = rows.offsets[:-1][rows.lengths > 0]
    if turn_at.numel() == int(torch.count_nonzero(starts.index_select(0, first))):  # no turn after a row's first token
        del starts, turn_at
        single_turn_stats(st, on0)
    else:
        multi_turn_stats(st, on0, starts, turn_at)


def _turns_loss(st: State) -> None:
    ts = st.turn_spans
    assert ts is not None  # the turns stage ran
    st.loss_weights = step_loss_weights(st)
    pol, spans = st.policy, ts.spans
    sums = {}
    if pol is not None:
        fused = span_native.span_sums([pol.ratio], st.mask, spans.offsets)  # one compiled read where it applies
        sums["ratio"] = ts.per_turn(fused[1][0] if fused is not None else spans.masked_sum(pol.ratio, st.mask))
    plain = {k: v for k, v in (("pg_clipfrac", None if pol is None else pol.clipped), ("loss_weight", st.loss_weights))
             if v is not None}
    fused = span_native.span_sums(list(plain.values()), None, spans.offsets) if plain else None
    totals = dict(zip(plain, fused[1])) if fused is not None else {k: spans.sum(v) for k, v in plain.items()}
    if "pg_clipfrac" in totals:
        sums["pg_clipfrac"] = ts.per_turn(totals["pg_clipfrac"])
    out = ts.means(sums)
    if st.loss_weights is not None:
        st.tokens["loss_weight"] = st.loss_weights
        out["loss_weight"] = ts.per_turn(totals["loss_weight"])
    _write(st, out)
    st.turn_spans = None  # no later stage reads them: the spans' token ids (8 bytes a token) go


_R = "rldiag"
_K = "{" + ",".join(BUCKETS) + "}"
_LOSS = ("log_probs", "old_log_probs")
_DIAG = ("rollout_log_probs", "old_log_probs")
TURNS = Stage(
    "turns",
    "each token's turn (maximal runs of actor tokens in a row, from 1); per turn 1..8 and 9plus the "
    "tokens, advantages, diagnostic IS weights and rollout KL (the policy loss's part: turns_loss)",
    _turns,
    optional=("loss_mask", "old_log_probs", "rollout_log_probs"),
    metrics=(
        Metric(f"{PREFIX}count/{{mean,max}}", "turns per row (maximal runs of actor tokens: loss_mask, else "
               "response_mask), mean and max over the step's rows", _R),
        Metric(f"{PREFIX}{_K}/tokens", "T_k: actor tokens of turn k (9plus: of every turn after the 8th) over the "
               "step that the update trains on (after rollout rejection); 0 where no row has turn k", _R),
        Metric(f"{PREFIX}{_K}/advantage", "the mean advantage over the T_k tokens (0 where T_k = 0)", _R),
        Metric(f"{PREFIX}{_K}/is_weight", "the mean diagnostic token IS weight (rldiag/diag_is: min(exp(old - "
               "rollout), 2)) over the T_k tokens (0 where T_k = 0)", _R, needs=_DIAG, when="not `bypass_mode`"),
        Metric(f"{PREFIX}{_K}/rollout_kl", "the mean of old_log_probs - rollout_log_probs over the T_k tokens (k1 "
               "of KL(pi_old || pi_rollout), the reference KL's convention; 0 where T_k = 0)", _R, needs=_DIAG,
               when="not `bypass_mode`"),
    ),
    tokens=("turn",),
    rows=("turns",),
    uses=("adv", "diag_is_token", "mask", "mask0", "old_lp"),
    sets=("turn", "turn_spans"),
)

TURNS_LOSS = Stage(
    "turns_loss",
    "per turn 1..8 and 9plus the policy loss's part: ratios, clipping and loss share (each token's "
    "weight in actor/pg_loss), over the turns the turns stage found",
    _turns_loss,
    optional=("loss_mask", "log_probs", "old_log_probs"),
    metrics=(
        Metric(f"{PREFIX}{_K}/ratio", "the mean over the T_k tokens of the ratio the policy loss uses (the token "
               "output ratio; 0 where T_k = 0)", _R, needs=_LOSS),
        Metric(f"{PREFIX}{_K}/pg_clipfrac", "the share of the T_k tokens counted as clipped, by actor/pg_clipfrac's "
               "definition for the loss_mode (0 where T_k = 0)", _R, needs=_LOSS,
               when="every `loss_mode` but gpg, dro, kl_cov"),
        Metric(f"{PREFIX}{_K}/loss_weight", "the T_k tokens' summed weight in actor/pg_loss (the loss's aggregation "
               "weights: turn k's share of the loss; 0 where T_k = 0)", _R, needs=_LOSS),
    ),
    tokens=("loss_weight",),
    uses=("mask", "policy", "segs", "turn_spans"),
    sets=("loss_weights", "turn_spans"),
)
