"""The health stage's pure functions (rldiag/engine/health.py, rldiag/engine/repetition.py): exact
numbers on hand-built inputs, and the top share against a brute-force per-step sort."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rldiag.engine.health import (
    PIECE_TOKENS,
    component_means,
    empty_fraction,
    gradient_weight_shares,
    group_std_mean,
    top_sum,
    top_weight_share,
    weight_share,
)
from rldiag.engine.repetition import compression_ratio, compression_ratios, repetition_metrics


def test_top_share_hand_built():
    # step 0: 100 actor tokens, one of weight 10 and 99 of weight 1, plus a non-actor token of weight 50
    # step 1: 250 actor tokens, weights 1..250: ceil(2.5) = 3 top tokens, 250 + 249 + 248 of 31375
    g = torch.cat([torch.tensor([10.0] + [1.0] * 99 + [50.0]), torch.arange(1, 251, dtype=torch.float32)])
    step = torch.cat([torch.zeros(101, dtype=torch.long), torch.ones(250, dtype=torch.long)])
    actor = torch.ones(351, dtype=torch.bool)
    actor[100] = False
    got = top_weight_share(g, step, actor, 3)
    assert got[0].item() == pytest.approx(10 / 109)
    assert got[1].item() == pytest.approx(747 / 31375)
    assert math.isnan(got[2].item())  # a step without tokens
    assert top_weight_share(torch.zeros(4), torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool), 1).isnan().all()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0, 100), st.booleans()), min_size=1, max_size=400),
       st.sampled_from([0.01, 0.1, 0.5]))
def test_top_share_is_a_per_step_sort(tokens, frac):
    step = torch.tensor([t[0] for t in tokens])
    g = torch.tensor([t[1] for t in tokens], dtype=torch.float32)
    actor = torch.tensor([t[2] for t in tokens])
    got = top_weight_share(g, step, actor, 4, frac)
    for s in range(4):
        w = np.sort(g[(step == s) & actor].double().numpy())[::-1]
        if w.sum() == 0:
            assert math.isnan(got[s].item())
            continue
        k = max(1, math.ceil(len(w) * frac - 1e-9))
        assert got[s].item() == pytest.approx(w[:k].sum() / w.sum(), rel=1e-5)
        assert got[s].item() >= k / len(w) - 1e-6  # the top k carry at least their share of the count


def test_weight_share_empty_and_group_std():
    g = torch.tensor([1.0, 3.0, 0.0, 2.0, 2.0])
    on = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0])
    got = weight_share(g, on, torch.tensor([0, 0, 0, 1, 1]), 2)
    assert got.tolist() == pytest.approx([0.25, 0.25])
    assert empty_fraction(torch.tensor([3.0, 0.0, 5.0, 2.0]), torch.tensor([3, 2, 0, 4]), torch.tensor([0, 0, 0, 1]),
                          2).tolist() == pytest.approx([2 / 3, 0.0])
    # groups: {1, 0, 1} (std 0.57735), {0, 0} (0), {1} (single: out); step 1: only {2, 4} (std sqrt 2)
    values = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 2.0, 4.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3])
    got = group_std_mean(values, groups, 4, torch.tensor([0, 0, 0, 1]), 3)
    assert got[0].item() == pytest.approx(np.std([1, 0, 1], ddof=1) / 2)
    assert got[1].item() == pytest.approx(math.sqrt(2))
    assert math.isnan(got[2].item())


def test_component_means_and_top_share():
    means, share = component_means({"acc": torch.tensor([1.0, 0.0, 0.0, 0.0]), "fmt": torch.tensor([1.0, 1.0, 1.0, -1.0])},
                                   torch.tensor([0, 0, 1, 1]), 2)
    assert means["acc"].tolist() == pytest.approx([0.5, 0.0]) and means["fmt"].tolist() == pytest.approx([1.0, 0.0])
    assert share[0].item() == pytest.approx(2 / 3) and math.isnan(share[1].item())  # every mean 0: undefined
    _, none = component_means({}, torch.tensor([0]), 1)
    assert none.isnan().all()


def test_compression_ratio_of_known_strings():
    assert compression_ratio(b"a" * 1000) == pytest.approx(17 / 1000)  # zlib level 6: 17 bytes
    assert compression_ratio(b"hello world") == pytest.approx(19 / 11)  # short text: the header dominates
    assert compression_ratio(b"x" * 100 + b"abcd" * 1024) == pytest.approx(31 / 4096)  # only the last 4 KB
    assert math.isnan(compression_ratio(b""))


def test_compression_ratios_join_the_actor_tokens():
    text = pa.array([["ab", "cd", "ef"], [], ["xyz"] * 3, ["q"], []], pa.list_(pa.string()))
    mask = np.array([1, 0, 1, 1, 1, 1, 0], np.int8)  # row 0: "abef"; row 2: "xyzxyzxyz"; row 3: masked out
    got = compression_ratios(text, mask)
    assert got[0] == pytest.approx(compression_ratio(b"abef")) and got[2] == pytest.approx(compression_ratio(b"xyz" * 3))
    assert np.isnan(got[1]) and np.isnan(got[3]) and np.isnan(got[4]) and len(got) == 5


def test_repetition_metrics_counts_judged_rows():
    ratio = torch.tensor([0.05, 0.5, 0.1, float("nan"), 0.15])
    tokens = torch.tensor([100.0, 100.0, 10.0, 100.0, 64.0])  # row 2 too short to judge, row 3 without text
    got = repetition_metrics(ratio, tokens, torch.tensor([0, 0, 0, 0, 1]), 2)
    assert got["repetition_fraction"].tolist() == pytest.approx([0.25, 1.0])
    assert got["compression_ratio_mean"].tolist() == pytest.approx([0.275, 0.15])


def test_compression_of_a_long_tailed_step_is_finite_and_not_repetitive():
    """1,024 rows, lognormal lengths (median 600 tokens, cap 16k) of words drawn at random: every
    row gets a finite ratio, none as low as a loop's (its cost: bench/bench_recompute.py)."""
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(np.log(600), 1.0, 1024).astype(int) + 1, 16384)
    vocab = np.array([f" w{k}" for k in range(5000)])
    flat = vocab[rng.integers(0, 5000, int(lengths.sum()))]
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int32)
    text = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
    mask = np.ones(int(lengths.sum()), np.int8)
    got = compression_ratios(text, mask)
    assert got.shape == (1024,) and np.isfinite(got).all() and (got > 0.3).all()


def test_top_sum_selection_is_the_full_top_k():
    # ties (GRPO: one weight per row) and a long tail; the threshold path against a plain topk
    gen = torch.Generator().manual_seed(3)
    rows = torch.randint(1, 2000, (400,), generator=gen)
    x = torch.repeat_interleave(torch.rand(400, generator=gen) ** 3, rows)
    x[torch.rand(x.numel(), generator=gen) < 0.2] = -1.0  # off the actor tokens
    for k in (1, 7, x.numel() // 100, x.numel() // 20):
        plain = torch.topk(x, k).values.to(torch.float64).cumsum(0)[-1]
        assert torch.equal(top_sum(x, k), plain), k
    # few distinct weights, each on many tokens: the k-th largest is the sampled threshold (the tie branch)
    ties = torch.tensor([0.5, 0.25, 0.125, 0.1])[torch.randint(0, 4, (200_000,), generator=gen)]
    ties[:3] = torch.tensor([0.9, 0.8, 0.7])
    for k in (2, 3, 40, 1000, 2000):
        assert torch.equal(top_sum(ties, k), torch.topk(ties, k).values.to(torch.float64).cumsum(0)[-1]), k


def test_shares_over_pieces_equal_one_step_sums():
    # a step longer than a piece: the piece-by-piece float64 sums against the exact ones
    gen = torch.Generator().manual_seed(4)
    n = PIECE_TOKENS * 2 + 12345
    g = torch.rand(n, generator=gen)
    actor = torch.rand(n, generator=gen) < 0.9
    clipped = (torch.rand(n, generator=gen) < 0.1).to(torch.float32)
    adv = torch.where(torch.rand(n, generator=gen) < 0.5, -g, g)  # |A| x 1 is g
    top, share = gradient_weight_shares(adv, torch.ones(n), actor.float(), [0, 100, n], 0.01, clipped)
    for s, (a, b) in enumerate(((0, 100), (100, n))):
        gs, acts, cs = g[a:b].double(), actor[a:b], clipped[a:b].double()
        unclipped = torch.where(acts, gs * (1 - cs), 0.0)
        k = math.ceil(int(acts.sum()) * 0.01 - 1e-9)
        want = torch.sort(unclipped, descending=True).values[:k].sum() / unclipped.sum()
        assert top[s].item() == pytest.approx(want.item(), rel=1e-6)
        assert share is not None and share[s].item() == pytest.approx(((gs * cs * acts).sum() / gs.sum()).item(), rel=1e-6)


def test_a_non_finite_weight_off_the_actor_tokens_counts_for_nothing():
    """The top share takes the tokens off the mask out by products with the 0/1 mask; an inf or
    NaN weight there (inf x 0 is NaN) takes the `where` form: the shares are those of the same
    tokens with weight 0 there, to the bit."""
    gen = torch.Generator().manual_seed(5)
    n = 3000
    adv = torch.randn(n, generator=gen)
    mask = (torch.rand(n, generator=gen) < 0.8).to(torch.float32)
    clipped = (torch.rand(n, generator=gen) < 0.1).to(torch.float32)
    off = torch.nonzero(mask == 0).flatten()
    bounds = [0, 1000, n]
    want = gradient_weight_shares(adv, torch.ones(n), mask, bounds, 0.01)[0]
    for bad in (float("inf"), float("nan")):
        for s in (0, 1):
            a = adv.clone()
            a[off[(off >= bounds[s]) & (off < bounds[s + 1])][:3]] = bad
            got = gradient_weight_shares(a, torch.ones(n), mask, bounds, 0.01)[0]
            assert torch.equal(got, want), (bad, s)
    # with the clip: the top share as without the inf; the clipped share reads every token (inf x 0: NaN)
    a = adv.clone()
    a[off[:2]] = float("inf")
    top, share = gradient_weight_shares(a, torch.ones(n), mask, bounds, 0.01, clipped)
    assert torch.equal(top, gradient_weight_shares(adv, torch.ones(n), mask, bounds, 0.01, clipped)[0])
    assert share is not None and math.isnan(share[0].item()) and not math.isnan(share[1].item())


def test_health_stage_on_rows_out_of_step_order():
    """Rows of two steps interleaved (step ids 0, 1, 0, 1): the stage sorts their tokens by step,
    and each step's gradient-weight shares are those of the same rows in step order."""
    from rldiag.engine.pipeline import recompute_batch
    from tests.conftest import make_batch
    from tests.conftest import settings as engine_settings

    gen = np.random.default_rng(5)
    lp = [list(-np.abs(gen.normal(1, 0.3, 6))) for _ in range(4)]
    new = [list(np.array(r) + gen.normal(0, 0.3, 6)) for r in lp]
    scores = [[0.0] * 5 + [s] for s in (1.0, 0.0, 0.0, 1.0)]
    mask = [[1, 1, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1], [1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    mixed = make_batch(scores=scores, mask=mask, uids=["a", "b", "a", "b"], steps=[1, 2, 1, 2],
                       old_log_probs=lp, log_probs=new)
    order = [0, 2, 1, 3]
    sorted_ = make_batch(scores=[scores[i] for i in order], mask=[mask[i] for i in order], uids=["a", "a", "b", "b"],
                         steps=[1, 1, 2, 2], old_log_probs=[lp[i] for i in order], log_probs=[new[i] for i in order])
    a, b = (recompute_batch(x, engine_settings(estimator="grpo")) for x in (mixed, sorted_))
    for name in ("rldiag/grad_weight/top1pct_share", "rldiag/grad_weight/clipped_share"):
        assert a.metrics[name].tolist() == pytest.approx(b.metrics[name].tolist(), rel=1e-6), name
    assert 0 < a.metrics["rldiag/grad_weight/top1pct_share"][0].item() < 1
