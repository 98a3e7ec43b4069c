"""The filters (rldiag/engine/stages/filter.py): verl's group filter ``algorithm.filter_groups``,
the outcome gate ``rldiag.filter.gate_*``, the no-signal groups out of the denominators
``rldiag.filter.drop_no_signal_from_denominator``, and the gradient weight they report
(rldiag/engine/gradient_weight.py). Worked examples by hand, a per-group reference over random
batches, the drop against a batch without the dropped rows, and defaults that change nothing."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as hst

from rldiag.config.settings import resolve_settings
from rldiag.engine import pipeline
from rldiag.engine.batch import Batch
from rldiag.engine.filtering import flat_groups
from rldiag.engine.gradient_weight import gradient_weight
from rldiag.engine.pipeline import recompute_batch
from rldiag.engine.stages import FILTER, FILTER_WEIGHT, STAGES
from rldiag.errors import ConfigError, MissingInputError
from tests.conftest import make_batch, settings

FG = "algorithm.filter_groups"
F = "rldiag.filter"
KEPT, TOKENS, SHARE = "rldiag/filter/kept_rows", "rldiag/filter/effective_tokens", "rldiag/filter/dropped_weight_share"

# ---- the worked example: one step, three groups -------------------------------------------------
# A: 3 rows (2, 3, 1 tokens), scores 1, 0, 1 -> GRPO advantages +a, -2a, +a with
#    a = (1/3) / (std + 1e-6), std = sqrt(1/3) (Bessel: deviations 1/3, -2/3, 1/3)
# B: 2 rows (2, 2 tokens), scores 1, 1 -> flat: std 0, advantages 0; verl's filter drops it
# C: 1 row (4 tokens), score 1 -> a singleton: kept; verl's GRPO takes mean 0, std 1: 1 / (1 + 1e-6)
# 14 tokens, all mask 1; acc per row 1, 0, 1, 1, 1, 0 (the gate at 0.5 drops A2 and C1)
LENGTHS = [2, 3, 1, 2, 2, 4]
UIDS = ["A", "A", "A", "B", "B", "C"]
SCORE = [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
ACC = [1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
STD = math.sqrt(1 / 3) + 1e-6
A_POS, A_NEG, C_ADV = (1 / 3) / STD, (2 / 3) / STD, 1 / (1 + 1e-6)


def example(ratio_a2: float = 1.0) -> Batch:
    """The worked example; ``log_probs`` equal ``old_log_probs`` (ratio 1) but on A2's tokens,
    whose ratio is ``ratio_a2``."""
    width = max(LENGTHS)
    scores = [[0.0] * (L - 1) + [s] + [0.0] * (width - L) for L, s in zip(LENGTHS, SCORE)]
    mask = [[1] * L + [0] * (width - L) for L in LENGTHS]
    old = [[-1.0] * width for _ in LENGTHS]
    new = [[-1.0 + (math.log(ratio_a2) if i == 1 else 0.0)] * width for i in range(len(LENGTHS))]
    b = make_batch(scores=scores, mask=mask, uids=UIDS, lengths=LENGTHS, old_log_probs=old, log_probs=new)
    b.extra["acc"] = torch.tensor(ACC)
    return b


def run(batch: Batch, **keys):
    return recompute_batch(batch, settings(estimator="grpo", **{k.replace(".", "__"): v for k, v in keys.items()}))


def one(result, name: str) -> float:
    return float(result.metrics[name][0])


def test_defaults_write_nothing_of_the_filters():
    r = run(example())
    assert not any(k.startswith("rldiag/filter/") for k in r.metrics)


def test_group_filter_worked_example():
    base, r = run(example()), run(example(), **{f"{FG}.enable": True})
    # B (flat, 2 rows) goes; the singleton C and the group A stay
    assert one(r, KEPT) == 4 and one(r, TOKENS) == 14 - 4
    assert r.tokens["response_mask"].tolist() == [1.0] * 6 + [0.0] * 4 + [1.0] * 4
    adv = r.tokens["advantages"].tolist()
    assert adv == pytest.approx([A_POS] * 2 + [-A_NEG] * 3 + [A_POS] + [0.0] * 4 + [C_ADV] * 4, abs=1e-6)
    # ratio 1: the vanilla loss is -A per token; token-mean over 14 tokens, then over the 10 kept
    summed = 3 * A_POS - 3 * A_NEG + 4 * C_ADV
    assert one(base, "actor/pg_loss") == pytest.approx(-summed / 14, rel=1e-6)
    assert one(r, "actor/pg_loss") == pytest.approx(-summed / 10, rel=1e-6)
    # B's advantages are 0: it carried no gradient weight
    assert one(r, SHARE) == 0.0


def test_gate_worked_example():
    r = run(example(), **{f"{F}.gate_column": "acc", f"{F}.gate_min": 0.5})
    # rows out of the update make no metric NaN that was not already, but the shares of the
    # gradient weight: the kept rows' advantages are all 0 (below), a share of no weight is undefined
    nan = {k for k, v in run(example()).metrics.items() if not math.isfinite(float(v[0]))}
    now = {k for k, v in r.metrics.items() if not math.isfinite(float(v[0]))}
    assert now - nan == {"rldiag/grad_weight/top1pct_share", "rldiag/grad_weight/clipped_share"}
    # A2 and C1 go (acc 0 < 0.5): A1, A3, B1, B2 stay with 2 + 1 + 2 + 2 tokens
    assert one(r, KEPT) == 4 and one(r, TOKENS) == 7
    # the gradient weight |A| x 1/14 (token-mean, nothing clipped) without the gate:
    total = 3 * A_POS + 3 * A_NEG + 4 * C_ADV
    assert one(r, SHARE) == pytest.approx((3 * A_NEG + 4 * C_ADV) / total, rel=1e-6)
    # the estimator ran on the kept rows: A1 and A3 alone are a flat group, B is flat
    assert r.tokens["advantages"].abs().max().item() == 0.0
    assert one(r, "actor/pg_loss") == 0.0


def test_clipped_tokens_carry_no_gradient_weight():
    # A2's ratio 0.5 < 1 - 0.2 with a negative advantage: PPO's clip cuts its gradient
    r = run(example(ratio_a2=0.5), **{f"{F}.gate_column": "acc", f"{F}.gate_min": 0.5})
    assert one(r, SHARE) == pytest.approx(4 * C_ADV / (3 * A_POS + 4 * C_ADV), rel=1e-6)


def test_every_filter_together():
    r = run(example(), **{f"{FG}.enable": True, f"{F}.gate_column": "acc", f"{F}.gate_min": 0.5,
                          f"{F}.drop_no_signal_from_denominator": True})
    # B by the group filter, A2 and C1 by the gate; A1 and A3 are then a flat group (advantages 0)
    assert one(r, KEPT) == 0 and one(r, TOKENS) == 0
    assert one(r, SHARE) == pytest.approx(1.0, rel=1e-6)
    # no NaN but the means over no token at all: the advantages' and returns' statistics (verl's
    # masked_select of nothing), the per-turn means (an empty turn), the mismatch's, the shares of no gradient weight
    empty = ("critic/advantages/", "critic/returns/", "rldiag/turns/", "rldiag/mismatch/", "rldiag/grad_weight/")
    assert all(math.isfinite(float(v[0])) for k, v in r.metrics.items() if not k.startswith(empty))
    assert one(r, "actor/pg_loss") == 0.0


def test_no_signal_groups_leave_the_denominator_worked_example():
    base = run(example())
    r = run(example(), **{f"{F}.drop_no_signal_from_denominator": True})
    # B's advantages are all 0: its 4 tokens leave the token-mean denominator, its rows stay
    assert one(r, KEPT) == 4 and one(r, TOKENS) == 10 and one(r, SHARE) == 0.0
    assert one(r, "actor/pg_loss") == pytest.approx(one(base, "actor/pg_loss") * 14 / 10, rel=1e-6)
    assert torch.equal(r.tokens["advantages"], base.tokens["advantages"])


@pytest.mark.parametrize("agg, before, after", [("token-mean", 14, 10), ("seq-mean-token-mean", 6, 4),
                                                ("seq-mean-token-sum", 6, 4), ("token-sum", 1, 1)])
def test_no_signal_denominator_by_aggregation_mode(agg, before, after):
    base = run(example(), **{"actor_rollout_ref.actor.loss_agg_mode": agg})
    r = run(example(), **{"actor_rollout_ref.actor.loss_agg_mode": agg, f"{F}.drop_no_signal_from_denominator": True})
    assert one(r, "actor/pg_loss") == pytest.approx(one(base, "actor/pg_loss") * before / after, rel=1e-6)


def test_metric_names_and_derived_metrics():
    # seq_reward: the summed token_level_scores, as the DAPO recipe derives it; reward the same
    # (verl's V1 canonical metric); score the same (a scalar score sits on the row's last token)
    for metric in ("seq_reward", "seq_final_reward", "reward", "score"):
        r = run(example(), **{f"{FG}.enable": True, f"{FG}.metric": metric})
        assert one(r, KEPT) == 4, metric
    # acc: A (1, 0, 1) keeps, B (1, 1) flat, C singleton
    assert one(run(example(), **{f"{FG}.enable": True, f"{FG}.metric": "acc"}), KEPT) == 4


def test_reward_is_a_column_before_the_v1_replay_buffer():
    keys = {f"{FG}.enable": True, f"{FG}.metric": "reward", "rldiag.verl_version": "0.8.0"}
    with pytest.raises(MissingInputError, match="'reward'"):
        run(example(), **keys)
    b = example()
    b.extra["reward"] = torch.tensor([3.0, 3.0, 3.0, 1.0, 2.0, 5.0])  # A flat here, B not
    assert run(b, **keys).tokens["response_mask"].tolist() == [0.0] * 6 + [1.0] * 8


def test_seq_final_reward_has_the_kl_penalty():
    # with KL in the reward the summed token_level_rewards differ within B: B is kept
    b = example()
    b.ref_log_prob = b.old_log_probs.clone()
    b.ref_log_prob[b.rows.offsets[3]] = -2.0  # B1's first token: KL 1 under kl (k1)
    keys = {"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.kl_coef": 0.1, f"{FG}.enable": True}
    assert one(run(b, **keys, **{f"{FG}.metric": "seq_reward"}), KEPT) == 4
    assert one(run(b, **keys, **{f"{FG}.metric": "seq_final_reward"}), KEPT) == 6


def test_configuration_errors_name_the_key():
    with pytest.raises(ConfigError, match="gate_min"):
        run(example(), **{f"{F}.gate_column": "acc"})
    with pytest.raises(ConfigError, match="filter_groups.metric"):
        run(example(), **{f"{FG}.enable": True, f"{FG}.metric": None})
    with pytest.raises(MissingInputError, match="'nope'"):
        run(example(), **{f"{F}.gate_column": "nope", f"{F}.gate_min": 0.0})


def test_flat_groups_edge_values():
    v = torch.tensor([1.0, 1.0, float("nan"), float("nan"), float("inf"), float("inf"), 2.0, 0.1, 0.1, 0.1],
                     dtype=torch.float32).to(torch.float64)  # the loader reads columns as float32
    g = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4, 4, 4])
    # verl's np.std: 0 for (1, 1) and for three float32 0.1s, NaN for the NaN and inf pairs; a single row is kept
    groups = [[1.0, 1.0], [math.nan] * 2, [math.inf] * 2, [2.0], v[7:].tolist()]
    with np.errstate(invalid="ignore"):  # inf - inf
        assert [len(x) > 1 and float(np.std(x)) == 0.0 for x in groups] == [True, False, False, False, True]
    assert flat_groups(v, g, 5).tolist() == [True, False, False, False, True]


# ---- the gradient weight ------------------------------------------------------------------------


def test_gradient_weight_is_abs_advantage_times_aggregation_weight_unclipped():
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0])
    weights = torch.tensor([0.25, 0.25, 0.25, 0.0, 0.25])  # token-mean over 4 masked tokens
    clipped = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5])  # clip_cov: a probability
    assert gradient_weight(adv, weights, clipped).tolist() == pytest.approx([0.0, 0.5, 0.125, 0.0, 0.125])
    assert gradient_weight(adv, weights).tolist() == pytest.approx([0.25, 0.5, 0.125, 0.0, 0.25])


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo", "cispo", "gpg", "clip_cov", "geo_mean"])
def test_the_share_uses_the_losses_own_weights_and_clip_indicator(loss_mode):
    """The weights and the clip indicator are the policy loss's own (PolicyLossOutput): the share
    is the dropped rows' part of sum |A| w (1 - c) of a recompute without the filter."""
    from rldiag.engine.stages import State
    from rldiag.engine.step_failures import StepErrors

    batch = example(ratio_a2=0.5)
    keys = {"actor_rollout_ref.actor.policy_loss.loss_mode": loss_mode}
    state = State(batch, settings(estimator="grpo", **{k.replace(".", "__"): v for k, v in keys.items()}), None,
                  StepErrors(batch.steps))
    for stage in STAGES[: [x.name for x in STAGES].index("actor_loss") + 1]:
        stage.run(state)
    out = state.policy
    g = gradient_weight(state.adv, out.weights, out.clipped)
    dropped = batch.rows.expand(torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 1.0]))  # the gate drops A2 and C1
    want = float((g * dropped).sum() / g.sum())
    r = run(batch, **keys, **{f"{F}.gate_column": "acc", f"{F}.gate_min": 0.5})
    assert one(r, SHARE) == pytest.approx(want, rel=1e-6)


# ---- random batches ------------------------------------------------------------------------------


@hst.composite
def grouped_step(draw, steps=2):
    """Rows in groups of 1-4 per step, scores from {0, 0.5, 1} (flat groups likely), tool gaps,
    an ``acc`` column, log-probs with ratios around 1."""
    rng = np.random.default_rng(draw(hst.integers(0, 2**31 - 1)))
    uids, step_of, lengths, scores, mask, acc = [], [], [], [], [], []
    for s in range(1, steps + 1):
        for g in range(int(rng.integers(1, 5))):
            for _ in range(int(rng.integers(1, 5))):
                L = int(rng.integers(1, 9))
                m = [1] * L
                if L > 2 and rng.random() < 0.3:
                    m[int(rng.integers(1, L - 1))] = 0
                uids.append(f"p{g}")
                step_of.append(s)
                lengths.append(L)
                scores.append(float(rng.choice([0.0, 0.5, 1.0])))
                mask.append(m)
                acc.append(float(rng.choice([0.0, 1.0])))
    width = max(lengths)
    pad = [m + [0] * (width - len(m)) for m in mask]
    tok = [[0.0] * (L - 1) + [s] + [0.0] * (width - L) for L, s in zip(lengths, scores)]
    old = (-np.abs(rng.normal(1.0, 0.5, (len(lengths), width)))).astype(np.float32)
    new = (old + rng.normal(0, 0.3, old.shape)).astype(np.float32)
    b = make_batch(scores=tok, mask=pad, uids=uids, steps=step_of, lengths=lengths,
                   old_log_probs=old.tolist(), log_probs=new.tolist())
    b.extra["acc"] = torch.tensor(acc)
    return b, scores, uids, step_of


def _reference_dropped(values, uids, step_of) -> list[bool]:
    """verl's rule, group by group: more than one row and np.std of the values exactly 0."""
    groups: dict = {}
    for i, key in enumerate(zip(step_of, uids)):
        groups.setdefault(key, []).append(i)
    out = [False] * len(values)
    for members in groups.values():
        vals = [values[i] for i in members]
        if len(vals) > 1 and float(np.std(vals)) == 0.0:
            for i in members:
                out[i] = True
    return out


@hsettings(max_examples=30, derandomize=True)
@given(grouped_step())
def test_group_filter_matches_a_per_group_reference(case):
    batch, scores, uids, step_of = case
    r = run(batch, **{f"{FG}.enable": True})
    dropped = _reference_dropped(scores, uids, step_of)
    kept_mask = batch.rows.expand(torch.tensor([not d for d in dropped], dtype=torch.float32)) * batch.response_mask
    assert torch.equal(r.tokens["response_mask"], kept_mask)
    for s in (0, 1):
        assert float(r.metrics[KEPT][s]) == sum(1 for d, st in zip(dropped, step_of) if st == s + 1 and not d)


def _without(batch: Batch, dropped: torch.Tensor) -> Batch:
    """The batch with the dropped rows removed (group ids made dense again)."""
    kept = torch.nonzero(~dropped).flatten()
    sub = batch.select_rows(kept)
    groups, dense = torch.unique(sub.group_ids, return_inverse=True)
    return replace(sub, group_ids=dense, n_groups=int(groups.numel()))


@hsettings(max_examples=30, derandomize=True)
@given(grouped_step(), hst.sampled_from(["grpo", "rloo", "reinforce_plus_plus", "grpo_vectorized", "opo"]),
       hst.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]))
def test_a_drop_is_the_update_without_those_rows(case, estimator, agg):
    """The gate's (and the group filter's) update is the update of the batch without the dropped
    rows: the actor's metrics and the kept rows' advantages."""
    batch, _, uids, step_of = case
    keys = {"algorithm.adv_estimator": estimator, "actor_rollout_ref.actor.loss_agg_mode": agg,
            f"{F}.gate_column": "acc", f"{F}.gate_min": 0.5, f"{FG}.enable": True}
    s = resolve_settings(overrides=keys)
    r = recompute_batch(batch, s)
    dropped = r.tokens["response_mask"].new_zeros(batch.n_rows).bool()
    dropped |= batch.extra["acc"] < 0.5
    dropped |= torch.tensor(_reference_dropped(batch.rows.sum(batch.token_level_scores).tolist(), uids, step_of))
    kept_steps = [i for i in range(batch.n_steps) if bool((~dropped & (batch.step_ids == i)).any())]
    if not kept_steps or len(kept_steps) < batch.n_steps:
        return  # a step with no kept row has no batch of its own to compare with
    alone = recompute_batch(_without(batch, dropped), resolve_settings(overrides={
        k: v for k, v in keys.items() if not k.startswith(("rldiag.filter", FG))}))
    _, tok = batch.rows.take(torch.nonzero(~dropped).flatten())
    assert r.tokens["advantages"][tok].tolist() == pytest.approx(alone.tokens["advantages"].tolist(), abs=1e-5)
    for name in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert r.metrics[name].tolist() == pytest.approx(alone.metrics[name].tolist(), rel=1e-5, abs=1e-6), name


@hsettings(max_examples=30, derandomize=True)
@given(grouped_step(), hst.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]))
def test_no_signal_denominator_scales_pg_loss_by_the_ratio_of_denominators(case, agg):
    batch, *_ = case
    keys = {"actor_rollout_ref.actor.loss_agg_mode": agg}
    base = run(batch, **keys)
    r = run(batch, **keys, **{f"{F}.drop_no_signal_from_denominator": True})
    adv, mask, rows = base.tokens["advantages"], base.tokens["response_mask"], batch.rows
    nonzero = rows.masked_count(adv != 0, mask)
    signal = torch.zeros(batch.n_groups).index_add_(0, batch.group_ids, nonzero)[batch.group_ids] > 0
    per_row = rows.mask_count(mask) if agg == "token-mean" else torch.ones(batch.n_rows)
    for s in range(batch.n_steps):
        here = batch.step_ids == s
        before, after = float(per_row[here].sum()), max(float(per_row[here & signal].sum()), 1.0)
        want = float(base.metrics["actor/pg_loss"][s]) * before / after
        assert float(r.metrics["actor/pg_loss"][s]) == pytest.approx(want, rel=1e-5, abs=1e-7)
        assert float(r.metrics[SHARE][s]) == 0.0


def test_default_settings_run_the_pipeline_as_without_the_filter_stages(synth_run, monkeypatch):
    """With none of the keys set the two stages change nothing: every metric and token output is
    the one of the pipeline without them (bit for bit), under several configurations."""
    from rldiag.engine.batch import pack
    from rldiag.engine.requirements import recompute_columns
    from rldiag.io.loader import load_step
    from rldiag.io.rundir import RunDir

    for overrides in ({}, {"algorithm.adv_estimator": "grpo", "rldiag.mini_batch_size": 8, "rldiag.dp_size": 2},
                      {"algorithm.adv_estimator": "reinforce_plus_plus",
                       "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean"}):
        s = resolve_settings(synth_run, overrides)
        batch = pack([load_step(sf, s, recompute_columns(s)).batch for sf in RunDir(synth_run).require_steps()])
        now = recompute_batch(batch, s)
        monkeypatch.setattr(pipeline, "STAGES", tuple(x for x in STAGES if x not in (FILTER, FILTER_WEIGHT)))
        before = recompute_batch(batch, s)
        monkeypatch.undo()
        assert now.metrics.keys() == before.metrics.keys() and now.tokens.keys() == before.tokens.keys()
        for name, value in before.metrics.items():
            assert torch.equal(now.metrics[name].nan_to_num(7.0), value.nan_to_num(7.0)), name
        for name, value in before.tokens.items():
            assert torch.equal(now.tokens[name], value), name
