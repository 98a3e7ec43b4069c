"""Turns (rldiag/engine/stages/turns.py): each token's turn, a maximal run of actor tokens in its
row numbered from 1; per step the statistics of turns 1..8 and 9plus (rldiag/turns/*), against a
worked example by hand and a per-row Python reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from rldiag.engine.batch import Batch
from rldiag.engine.layout import Rows
from rldiag.engine.pipeline import recompute_batch
from rldiag.engine.stages import STAGES, State
from rldiag.engine.stages.turns import (
    BUCKETS,
    TURNS,
    TURNS_LOSS,
    inner_turn_starts,
    multi_turn_stats,
    single_turn_stats,
    turn_index,
    turn_starts,
)
from rldiag.engine.step_failures import StepErrors
from tests.conftest import make_batch, settings

HS = hsettings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
STATS = ("tokens", "advantage", "ratio", "pg_clipfrac", "is_weight", "rollout_kl", "loss_weight")


def turns_ref(mask: list[int]) -> list[int]:
    """One row, token by token: a new turn at every 1 after a 0 (or at the row's start)."""
    out, k, prev = [], 0, 0
    for m in mask:
        if m and not prev:
            k += 1
        out.append(k if m else 0)
        prev = m
    return out


# ---- the turn of each token ---------------------------------------------------------------------


def test_turn_index_worked_example():
    rows = [[1, 1, 0, 0, 1, 1, 1, 0, 1], [0, 1, 1, 0], [], [0, 0], [1], [1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1]]
    layout = Rows.from_lengths(torch.tensor([len(r) for r in rows]))
    got = turn_index(torch.tensor([float(x) for r in rows for x in r]), layout)
    assert got.tolist() == [1, 1, 0, 0, 2, 2, 2, 0, 3] + [0, 1, 1, 0] + [0, 0] + [1] + [1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6]
    assert turn_index(torch.zeros(0), Rows.from_lengths(torch.zeros(2, dtype=torch.long))).tolist() == []


@HS
@given(st.lists(st.lists(st.integers(0, 1), max_size=40), min_size=1, max_size=8))
def test_turn_index_matches_a_per_row_loop(rows):
    layout = Rows.from_lengths(torch.tensor([len(r) for r in rows], dtype=torch.long))
    got = turn_index(torch.tensor([float(x) for r in rows for x in r], dtype=torch.float32), layout)
    assert got.tolist() == [t for r in rows for t in turns_ref(r)]


# ---- the per-turn statistics, by hand -----------------------------------------------------------


def _worked():
    """Two rows of one GRPO group, scores 1 and 0 (advantages +a and -a):
    row 0 mask 1 1 0 0 1 1 1 0 1 -> turns 1 1 - - 2 2 2 - 3; row 1 all 1 -> one turn of 9.
    Turn 2's tokens have ratio 1.5 (clipped: A > 0); turn 3's token rollout ratio 3 (IS weight 2)."""
    log15, log3 = math.log(1.5), math.log(3.0)
    old = [[-1.0] * 9, [-1.0] * 9]
    new = [[-1.0, -1.0, -1.0, -1.0, -1 + log15, -1 + log15, -1 + log15, -1.0, -1.0], [-1.0] * 9]
    rollout = [[-1.0] * 8 + [-1 - log3], [-1.0] * 9]
    b = make_batch(scores=[[0] * 8 + [1.0], [0.0] * 9], mask=[[1, 1, 0, 0, 1, 1, 1, 0, 1], [1] * 9],
                   uids=["A", "A"], old_log_probs=old, log_probs=new, rollout_log_probs=rollout)
    return b, recompute_batch(b, settings(estimator="grpo"))


def test_per_turn_statistics_worked_example():
    _, r = _worked()
    m = {k: v.item() for k, v in r.metrics.items() if k.startswith("rldiag/turns/")}
    a = float(r.tokens["advantages"][0].item())
    assert a == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6), rel=1e-6)  # grpo: (1 - 0.5) / (std([1, 0]) + eps)
    assert r.tokens["turn"].tolist() == [1, 1, 0, 0, 2, 2, 2, 0, 3] + [1] * 9
    assert r.rows["turns"].tolist() == [3, 1]
    assert m["rldiag/turns/count/mean"] == 2.0 and m["rldiag/turns/count/max"] == 3.0
    expect = {
        "1": dict(tokens=11, advantage=(2 * a - 9 * a) / 11, ratio=1.0, pg_clipfrac=0.0, is_weight=1.0, rollout_kl=0.0,
                  loss_weight=11 / 15),
        "2": dict(tokens=3, advantage=a, ratio=1.5, pg_clipfrac=1.0, is_weight=1.0, rollout_kl=0.0, loss_weight=3 / 15),
        "3": dict(tokens=1, advantage=a, ratio=1.0, pg_clipfrac=0.0, is_weight=2.0, rollout_kl=math.log(3.0),
                  loss_weight=1 / 15),
    }
    for k, stats in expect.items():
        for stat, value in stats.items():
            assert m[f"rldiag/turns/{k}/{stat}"] == pytest.approx(value, rel=1e-5, abs=1e-6), (k, stat)
    for k in BUCKETS[3:]:  # no row has a 4th turn: no tokens, no share of the loss, means 0 (not NaN)
        assert m[f"rldiag/turns/{k}/tokens"] == 0.0 and m[f"rldiag/turns/{k}/loss_weight"] == 0.0
        for stat in ("advantage", "ratio", "pg_clipfrac", "is_weight", "rollout_kl"):
            assert m[f"rldiag/turns/{k}/{stat}"] == 0.0
    assert r.metrics["actor/pg_clipfrac"].item() == pytest.approx(3 / 15)


def test_every_turn_name_is_written_on_every_step():
    b, r = _worked()
    for stat in STATS:
        for k in BUCKETS:
            assert f"rldiag/turns/{k}/{stat}" in r.metrics
    names = {n for n in r.metrics if n.startswith("rldiag/turns/")}
    assert len(names) == len(STATS) * len(BUCKETS) + 2
    assert TURNS.tokens == ("turn",) and TURNS_LOSS.tokens == ("loss_weight",) and r.tokens["turn"].dtype == torch.int32
    # each token's weight in actor/pg_loss: a row's sum is its per-row loss_weight
    assert torch.allclose(r.rows["loss_weight"].to(torch.float32), b.rows.sum(r.tokens["loss_weight"]).to(torch.float32))


def test_without_log_probs_only_the_data_statistics():
    b, _ = _worked()
    b.log_probs = None
    r = recompute_batch(b, settings(estimator="grpo"))
    got = {n.split("/")[-1] for n in r.metrics if n.startswith("rldiag/turns/") and "/count/" not in n}
    assert got == {"tokens", "advantage", "is_weight", "rollout_kl"}
    b.rollout_log_probs = None
    r = recompute_batch(b, settings(estimator="grpo"))
    got = {n.split("/")[-1] for n in r.metrics if n.startswith("rldiag/turns/") and "/count/" not in n}
    assert got == {"tokens", "advantage"}


def test_turns_follow_loss_mask_when_given():
    """The turns are the loss_mask's runs (the original mask), not the response_mask's."""
    b = make_batch(scores=[[0, 0, 0, 1.0]], mask=[[1, 1, 1, 1]], loss_mask=[[1, 0, 1, 1]])
    r = recompute_batch(b, settings(estimator="grpo"))
    assert r.tokens["turn"].tolist() == [1, 0, 2, 2]
    assert r.metrics["rldiag/turns/2/tokens"].item() == 2.0


# ---- the per-turn statistics against a per-row Python reference ----------------------------------


@st.composite
def turn_batches(draw):
    """1-3 steps of 1-5 rows, masks with many turns (now and then 9+), groups of 1-3 rows."""
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    n_steps = draw(st.integers(1, 3))
    rows = []
    for s in range(n_steps):
        for _ in range(int(rng.integers(1, 6))):
            length = int(rng.integers(1, 40))
            p = rng.uniform(0.2, 0.9)
            mask = [int(x) for x in rng.random(length) < p]
            rows.append(dict(step=s + 1, uid=int(rng.integers(0, 3)), mask=mask,
                             score=[0.0] * (length - 1) + [float(rng.integers(0, 3))],
                             old=list(-np.abs(rng.normal(1, 0.5, length))),
                             new=list(-np.abs(rng.normal(1, 0.5, length))),
                             rollout=list(-np.abs(rng.normal(1, 0.5, length)))))
    return rows


def _batch(rows) -> Batch:
    width = max(len(r["mask"]) for r in rows)

    def pad(key):
        return [r[key] + [0.0] * (width - len(r[key])) for r in rows]

    return make_batch(scores=pad("score"), mask=pad("mask"), uids=[r["uid"] for r in rows],
                      steps=[r["step"] for r in rows], lengths=[len(r["mask"]) for r in rows],
                      old_log_probs=pad("old"), log_probs=pad("new"), rollout_log_probs=pad("rollout"))


def _tokens_per_row(r, rows):
    """Each token output back as per-row numpy float64 lists."""
    out, k = [], 0
    for row in rows:
        n = len(row["mask"])
        out.append({name: t[k:k + n].to(torch.float64).numpy() for name, t in r.tokens.items()})
        k += n
    return out


@HS
@given(turn_batches())
def test_per_turn_statistics_match_a_per_row_reference(rows):
    b = _batch(rows)
    r = recompute_batch(b, settings(estimator="grpo"))
    toks = _tokens_per_row(r, rows)
    steps = sorted({row["step"] for row in rows})
    acc = {(s, k): {stat: [] for stat in ("adv", "ratio", "clip", "w", "kl")} for s in steps for k in BUCKETS}
    n_tok = {s: 0.0 for s in steps}
    for row, t in zip(rows, toks):
        turns = turns_ref(row["mask"])
        assert t["turn"].tolist() == turns
        for j, (m, k) in enumerate(zip(row["mask"], turns)):
            if not m:
                continue
            n_tok[row["step"]] += 1
            a = acc[(row["step"], BUCKETS[min(k, len(BUCKETS)) - 1])]
            adv, ratio = t["advantages"][j], t["ratio"][j]
            a["adv"].append(adv)
            a["ratio"].append(ratio)
            a["clip"].append(float(-adv * np.clip(ratio, 0.8, 1.2) > -adv * ratio))  # vanilla PPO, clip 0.2
            d = float(np.float32(row["old"][j]) - np.float32(row["rollout"][j]))
            a["w"].append(min(math.exp(d), 2.0))
            a["kl"].append(d)
    for i, s in enumerate(steps):
        counts = [row_turns for row in rows if row["step"] == s for row_turns in [max(turns_ref(row["mask"]), default=0)]]
        assert r.metrics["rldiag/turns/count/mean"][i].item() == pytest.approx(np.mean(counts))
        assert r.metrics["rldiag/turns/count/max"][i].item() == max(counts)
        for k in BUCKETS:
            a = acc[(s, k)]
            n = len(a["adv"])
            got = {stat: r.metrics[f"rldiag/turns/{k}/{stat}"][i].item() for stat in STATS}
            assert got["tokens"] == n
            assert got["loss_weight"] == pytest.approx(n / n_tok[s] if n_tok[s] else 0.0, abs=1e-6)  # token-mean
            for stat, key in (("advantage", "adv"), ("ratio", "ratio"), ("pg_clipfrac", "clip"), ("is_weight", "w"),
                              ("rollout_kl", "kl")):
                if n == 0:
                    assert got[stat] == 0.0, (k, stat)
                else:
                    assert got[stat] == pytest.approx(float(np.mean(a[key])), rel=1e-5, abs=1e-5), (k, stat)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"])
def test_turn_loss_weights_add_up_to_the_rows_and_the_loss(agg):
    """Summed over turns, the loss weights are the rows' and the step's total aggregation weight."""
    b, _ = _worked()
    r = recompute_batch(b, settings(estimator="grpo", agg=agg))
    per_turn = sum(r.metrics[f"rldiag/turns/{k}/loss_weight"] for k in BUCKETS)
    assert per_turn.item() == pytest.approx(r.rows["loss_weight"].sum().item(), rel=1e-6)


def _state_before_turns(b):
    s = settings(estimator="grpo")
    state = State(b, s, None, StepErrors(b.steps))
    for stage in STAGES:
        if stage is TURNS:
            return state
        stage.run(state)
    raise AssertionError("no turns stage")


def test_single_turn_rows_take_the_rows_as_spans_to_the_bit():
    """Rows with at most one turn from their first token (trailing tool tokens, empty rows, rows
    without an actor token): the single-turn path writes what the general one does, to the bit."""
    gen = np.random.default_rng(2)
    rows = []
    for s in (1, 2):
        for _ in range(12):
            length = int(gen.integers(0, 150))
            on = int(gen.integers(0, length + 1)) if gen.random() < 0.5 else length  # 1s then 0s
            rows.append(dict(step=s, uid=int(gen.integers(0, 3)), mask=[1] * on + [0] * (length - on),
                             score=[0.0] * max(length - 1, 0) + [float(gen.integers(0, 3))] * min(length, 1),
                             old=list(-np.abs(gen.normal(1, 0.5, length))), new=list(-np.abs(gen.normal(1, 0.5, length))),
                             rollout=list(-np.abs(gen.normal(1, 0.5, length)))))
    rows[0]["mask"] = [0] * len(rows[0]["mask"])
    b = _batch(rows)
    on = b.response_mask > 0
    starts = turn_starts(on, b.rows)
    assert inner_turn_starts(starts, b.rows) == 0
    out = []
    for single in (True, False):
        state = _state_before_turns(b)
        if single:
            single_turn_stats(state, on)
        else:
            multi_turn_stats(state, on, starts)
        TURNS_LOSS.run(state)
        out.append(state)
    one, general = out
    for kind in ("metrics", "rows", "tokens"):
        a, c = getattr(one, kind), getattr(general, kind)
        assert set(a) == set(c)
        for name in a:
            assert a[name].dtype == c[name].dtype and torch.equal(a[name], c[name]), (kind, name)
    # a turn after the first token (a leading tool token, a second turn) is counted
    for mask, lengths, inner in (([0, 1, 1], [3], 1), ([1, 0, 1, 1], [2, 0, 2], 0), ([1, 0, 1, 0, 0, 1], [4, 2], 2)):
        layout = Rows.from_lengths(torch.tensor(lengths))
        assert inner_turn_starts(turn_starts(torch.tensor(mask) > 0, layout), layout) == inner, mask
