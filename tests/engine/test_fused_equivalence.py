"""Fused / rewritten fast paths give verl's numbers: PPO's dual clip, the k3 estimator and the
per-row KL sums, the clipped value loss, the credit-cut signal, and GAE with gamma * lam = 1.
Engine inputs go through the packed layout (tests.engine.packing); references stay padded."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from rldiag.engine.advantage import gae_scan
from rldiag.engine.aggregation import AggNorm
from rldiag.engine.critic import value_loss
from rldiag.engine.kl import k3_from_diff, kl_estimate, kl_k3, kl_row_sums
from rldiag.engine.metrics import signal_metrics
from rldiag.engine.policy_loss.clip import ppo_terms
from tests.conftest import make_batch
from tests.engine.packing import to_packed, to_padded
from tests.engine.reference_core import gae_loop

HS = hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---- PPO clip with dual clip ---------------------------------------------------------------


def verl_ppo(adv: torch.Tensor, ratio: torch.Tensor, lo: float, hi: float, c: float):
    """verl's compute_policy_loss_vanilla, token level."""
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - lo, 1 + hi)
    clipped1 = torch.maximum(l1, l2)
    l3 = -adv * c
    clipped2 = torch.min(l3, clipped1)
    losses = torch.where(adv < 0, clipped2, clipped1)
    lower = torch.gt(clipped1, l3) & (adv < 0)
    return l1, l2, clipped1, l3, losses, lower


_ADV = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 1e-30, -1e-30]),
    st.floats(-50.0, 50.0, allow_nan=False, width=32),
)


def _check_ppo(adv, ratio, lo, hi, c):
    adv0, ratio0 = adv.clone(), ratio.clone()
    l1, l2, clipped1, l3, losses = ppo_terms(adv, ratio, lo, hi, c)
    v1, v2, vc1, vl3, vlosses, vlower = verl_ppo(adv, ratio, lo, hi, c)
    # inputs untouched by the in-place ops
    assert torch.equal(adv, adv0) and torch.equal(torch.signbit(adv), torch.signbit(adv0))
    assert torch.equal(ratio, ratio0)
    assert torch.equal(l1, v1) and torch.equal(l2, v2) and torch.equal(clipped1, vc1)
    neg = adv < 0
    assert torch.equal(l3[neg], vl3[neg])  # l3 is the dual-clip bound where it applies
    assert torch.equal(losses, vlosses)
    bad = (torch.signbit(losses) != torch.signbit(vlosses)).nonzero().flatten().tolist()
    assert not bad, (
        f"signed zeros differ from verl at {len(bad)} of {losses.numel()} tokens: "
        f"adv={adv.flatten()[bad[:4]].tolist()} rldiag={losses.flatten()[bad[:4]].tolist()} "
        f"verl={vlosses.flatten()[bad[:4]].tolist()}"
    )
    assert torch.equal(torch.gt(clipped1, l3) & neg, vlower)


@HS
@given(
    st.integers(1, 80).flatmap(lambda n: st.tuples(
        st.lists(_ADV, min_size=n, max_size=n),
        st.lists(st.floats(-20.0, 20.0, allow_nan=False, width=32), min_size=n, max_size=n),
    )),
    st.floats(0.0, 0.5),
    st.floats(0.0, 0.5),
    st.floats(1.01, 10.0),
)
def test_ppo_terms_equal_verl(data, lo, hi, c):
    advs, logs = data
    adv = torch.tensor(advs, dtype=torch.float32)
    ratio = torch.exp(torch.tensor(logs, dtype=torch.float32))
    assert (ratio > 0).all()
    _check_ppo(adv, ratio, lo, hi, c)
    _check_ppo(adv.view(1, -1), ratio.view(1, -1), lo, hi, c)


@pytest.mark.parametrize("lo, hi, c", [(0.2, 5.0, 3.0), (0.2, 0.28, 3.0), (0.0, 0.0, 1.01), (0.5, 0.5, 10.0)])
def test_ppo_terms_equal_verl_fixed(lo, hi, c):
    g = torch.Generator().manual_seed(7)
    rows, T = 4, 37
    adv = torch.randn(rows, T, generator=g)
    adv[:, ::5] = 0.0
    adv[1, 1::7] = -0.0
    ratio = torch.exp(torch.randn(rows, T, generator=g) * 3.0)
    ratio[0, :4] = torch.tensor([1e-9, 4e8, 1.0, 1.0 + hi])
    _check_ppo(adv, ratio, lo, hi, c)


def test_ppo_terms_zero_advantage_keeps_verls_negative_zero():
    """verl's where(A < 0, ...) keeps clipped1 = max(-0 * r, -0 * clip(r)) = -0.0 where A = 0;
    the fused min(clipped1, |A| c) must too, at every position of a realistic-size tensor."""
    adv = torch.zeros(2, 64)
    ratio = torch.exp(torch.linspace(-1, 1, 128)).view(2, 64)
    *_, losses = ppo_terms(adv, ratio, 0.2, 0.28, 3.0)
    *_, vlosses, _ = verl_ppo(adv, ratio, 0.2, 0.28, 3.0)
    assert torch.signbit(vlosses).all()
    assert torch.equal(torch.signbit(losses), torch.signbit(vlosses)), torch.signbit(losses).int().tolist()


# ---- KL: k3 and the per-row sums -----------------------------------------------------------


def k3_direct(lp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    x = torch.clamp(ref - lp, -20, 20)
    return torch.clamp(torch.exp(x) - x - 1, -10, 10)


def _logprobs(rows: int, T: int, seed: int, scale: float):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(rows, T, generator=g) * scale
    ref = -torch.rand(rows, T, generator=g) * scale
    return lp, ref


@HS
@given(st.integers(1, 6), st.integers(1, 50), st.integers(0, 10_000), st.sampled_from([0.01, 1.0, 5.0, 30.0, 200.0]))
def test_k3_from_diff_equals_direct_formula(rows, T, seed, scale):
    lp, ref = _logprobs(rows, T, seed, scale)
    want = k3_direct(lp, ref)
    d = lp - ref
    d0 = d.clone()
    got = k3_from_diff(d)
    assert torch.equal(d, d0)  # works on a new tensor
    assert torch.equal(got, want)
    assert torch.equal(kl_k3(lp, ref), want)
    assert torch.equal(kl_estimate("k3", lp, ref), want)
    assert torch.equal(kl_estimate("low_var_kl+", lp, ref), want)


def test_k3_from_diff_extremes():
    lp = torch.tensor([[0.0, -100.0, -1e-8, -25.0, -19.99, -20.01, float("-inf"), -3.0]])
    ref = torch.tensor([[-100.0, 0.0, -1e-8, 0.0, 0.0, 0.0, -1.0, float("-inf")]])
    want = k3_direct(lp, ref)
    got = k3_from_diff(lp - ref)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert got.max() <= 10.0 and got[0, 1] == 10.0  # clamped high
    assert got[0, 2] == 0.0


@HS
@given(st.integers(1, 6), st.integers(1, 50), st.integers(0, 10_000), st.sampled_from([0.1, 2.0, 40.0]),
       st.sampled_from([0.0, 0.5, 1.0]))
def test_kl_row_sums_match_masked_estimates(rows, T, seed, scale, p):
    lp, ref = _logprobs(rows, T, seed, scale)
    g = torch.Generator().manual_seed(seed + 1)
    mask = (torch.rand(rows, T, generator=g) < p).float()
    (lpf, layout), (reff, _), (mf, _) = (to_packed(t, [T] * rows) for t in (lp, ref, mask))
    sums, d = kl_row_sums(lpf, reff, mf, layout)
    assert set(sums) == {"k1", "k2", "k3"}
    assert torch.equal(to_padded(d, layout, T), lp - ref)
    for name in ("k1", "k2", "k3"):
        est = kl_estimate(name, lp, ref).double() * mask.double()
        want = est.sum(-1)
        assert sums[name].shape == (rows,)
        # float32 sums: the error scales with the sum of magnitudes, not with the result
        atol = 1e-6 * (1.0 + float(est.abs().sum(-1).max()))
        torch.testing.assert_close(sums[name].double(), want, rtol=1e-5, atol=atol, msg=name)


def test_kl_row_sums_nonfinite_outside_mask():
    lp = torch.tensor([[float("-inf"), -1.0, -2.0], [-0.5, float("nan"), -0.1]])
    ref = torch.tensor([[-1.0, -1.5, -1.0], [-0.4, -0.3, -0.2]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    (lpf, layout), (reff, _), (mf, _) = (to_packed(t, [3, 3]) for t in (lp, ref, mask))
    sums, _ = kl_row_sums(lpf, reff, mf, layout)
    for name in ("k1", "k2", "k3"):
        est = kl_estimate(name, lp, ref)
        want = torch.where(mask.bool(), est, 0.0).double().sum(-1)
        assert torch.isfinite(sums[name]).all(), name
        torch.testing.assert_close(sums[name].double(), want, rtol=1e-6, atol=1e-6, msg=name)


# ---- critic value loss ---------------------------------------------------------------------


def verl_value_loss(vpreds, values, returns, mask, c, step_ids, n_steps):
    """verl's compute_value_loss with token-mean, per step; sums in float64."""
    clipped = torch.max(torch.min(vpreds, values + c), values - c)
    l1 = (vpreds - returns) ** 2
    l2 = (clipped - returns) ** 2
    loss = torch.max(l1, l2)
    m = mask.double()
    out = {"critic/vf_loss": [], "critic/vf_clipfrac": [], "critic/vpred_mean": []}
    for s in range(n_steps):
        rows = step_ids == s
        ms = m[rows]
        cnt = ms.sum()
        out["critic/vf_loss"].append(0.5 * (loss[rows].double() * ms).sum() / cnt)
        out["critic/vf_clipfrac"].append((torch.gt(l2, l1)[rows].double() * ms).sum() / (cnt + 1e-8))
        out["critic/vpred_mean"].append((vpreds[rows].double() * ms).sum() / (cnt + 1e-8))
    return {k: torch.stack(v) for k, v in out.items()}


def _critic_inputs(rows, T, seed, n_steps):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, T, generator=g)
    vpreds = values + torch.randn(rows, T, generator=g) * 0.5
    returns = torch.randn(rows, T, generator=g)
    mask = (torch.rand(rows, T, generator=g) < 0.7).float()
    mask[:, 0] = 1.0
    step_ids = torch.arange(rows) % n_steps
    return vpreds, values, returns, mask, _norm(step_ids, n_steps, T, rows)


def _norm(step_ids, n_steps, T, rows):
    layout = to_packed(torch.zeros(rows, T), [T] * rows)[1]
    return AggNorm(seg_ids=step_ids, n_seg=n_steps, horizon=torch.full((n_steps,), T), rows=layout)


def _value_loss_packed(vpreds, values, returns, mask, c, norm):
    """The engine's value loss on the packed form of padded full-width inputs."""
    T = vpreds.shape[1]
    flat = [to_packed(t, [T] * t.shape[0])[0] for t in (vpreds, values, returns, mask)]
    return value_loss(*flat, c, "token-mean", norm)


@HS
@given(st.integers(1, 6), st.integers(1, 40), st.integers(0, 10_000), st.integers(1, 2),
       st.sampled_from([0.0, 0.05, 0.2, 0.5, 3.0, 1e6, -0.2, -1.0]))
def test_value_loss_equals_verl(rows, T, seed, n_steps, c):
    assume(rows >= n_steps)
    vpreds, values, returns, mask, norm = _critic_inputs(rows, T, seed, n_steps)
    before = [t.clone() for t in (vpreds, values, returns, mask)]
    got = _value_loss_packed(vpreds, values, returns, mask, c, norm)
    for t, b in zip((vpreds, values, returns, mask), before):
        assert torch.equal(t, b)  # inputs untouched
    want = verl_value_loss(vpreds, values, returns, mask, c, norm.seg_ids, n_steps)
    for k, v in want.items():
        assert got[k].shape == (n_steps,)
        torch.testing.assert_close(got[k].double(), v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("c", [0.0, 0.2, -0.2])
def test_value_loss_examples(c):
    vpreds = torch.tensor([[1.0, 0.0, 2.0, 5.0]])
    values = torch.tensor([[0.5, 0.1, 2.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    norm = _norm(torch.zeros(1, dtype=torch.long), 1, 4, 1)
    got = _value_loss_packed(vpreds, values, returns, mask, c, norm)
    want = verl_value_loss(vpreds, values, returns, mask, c, norm.seg_ids, 1)
    for k, v in want.items():
        torch.testing.assert_close(got[k].double(), v, rtol=1e-6, atol=1e-7, msg=k)
    if c == 0.2:
        # token 0: clip(1.0, 0.3, 0.7) = 0.7 -> l2 = 0.49 < l1 = 1; token 1: clip(0, -0.1, 0.3) = 0
        # -> equal; token 2: 0 both. vf_loss = 0.5 * (1 + 1 + 0) / 3
        assert got["critic/vf_loss"].item() == pytest.approx(1.0 / 3.0)
        assert got["critic/vf_clipfrac"].item() == pytest.approx(0.0)
    if c == -0.2:
        # the old path: max(min(v', v - 0.2), v + 0.2) = v + 0.2 everywhere
        # token 0: (0.7)^2 = 0.49 < 1; token 1: (0.3 - 1)^2 = 0.49 < 1; token 2: 0.04 > 0
        assert got["critic/vf_loss"].item() == pytest.approx(0.5 * (1.0 + 1.0 + 0.04) / 3.0)
        assert got["critic/vf_clipfrac"].item() == pytest.approx(1.0 / 3.0)


# ---- credit-cut fraction -------------------------------------------------------------------


def credit_cut_reference(mask_rows, lengths, steps):
    cut: dict[int, int] = {}
    actor: dict[int, int] = {}
    for m, L, s in zip(mask_rows, lengths, steps):
        for t in range(L):
            if m[t] != 1:
                continue
            actor[s] = actor.get(s, 0) + 1
            if any(m[u] == 0 for u in range(t + 1, L)):
                cut[s] = cut.get(s, 0) + 1
    order = sorted(set(steps), key=steps.index)
    return [cut.get(s, 0) / actor[s] if actor.get(s) else float("nan") for s in order]


def _credit_cut(mask_rows, lengths, steps, resets=True):
    batch = make_batch(mask=mask_rows, lengths=lengths, steps=steps)
    adv = torch.randn(batch.response_mask.shape) * batch.response_mask
    out = signal_metrics(batch, batch.token_level_scores, adv, batch.response_mask, kl_in_reward=False,
                         mask_resets_return=resets)
    return out["rldiag/mask/credit_cut_fraction"]


def test_credit_cut_fraction_examples():
    rows = [
        [1, 1, 1, 1, 1, 1],  # no zeros: nothing cut
        [1, 1, 1, 0, 0, 0],  # zeros only at the end (inside the row): 3 cut
        [1, 1, 0, 0, 1, 1],  # gap in the middle: 2 cut of 4
        [1, 0, 1, 0, 0, 0],  # length 3, padding after: 1 cut of 2
        [0, 1, 1, 1, 0, 0],  # leading zero only, length 4: none cut of 3
        [1, 1, 0, 1, 0, 1],  # two gaps: 3 cut of 4
    ]
    lengths = [6, 6, 6, 3, 4, 6]
    steps = [1, 1, 1, 2, 2, 2]
    got = _credit_cut(rows, lengths, steps)
    want = credit_cut_reference(rows, lengths, steps)
    assert want == [5 / 13, 4 / 9]
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-7)
    # a release that carries the return through mask-0 tokens cuts no credit
    assert _credit_cut(rows, lengths, steps, resets=False).tolist() == [0.0, 0.0]


@HS
@given(
    st.integers(1, 8).flatmap(lambda rows: st.tuples(
        st.lists(st.integers(0, 12), min_size=rows, max_size=rows),
        st.lists(st.lists(st.sampled_from([0, 1, 1]), min_size=12, max_size=12), min_size=rows, max_size=rows),
        st.lists(st.integers(1, 3), min_size=rows, max_size=rows),
    ))
)
def test_credit_cut_fraction_matches_loop(data):
    lengths, raw, steps = data
    assume(max(lengths) > 0)
    W = max(lengths)
    rows = [[r[t] if t < L else 0 for t in range(W)] for r, L in zip(raw, lengths)]  # zero padding
    got = _credit_cut(rows, lengths, steps)
    want = torch.tensor(credit_cut_reference(rows, lengths, steps), dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, equal_nan=True)


# ---- GAE with gamma * lam = 1 --------------------------------------------------------------


def _gae_packed(r, v, m, gamma, lam):
    T = r.shape[1]
    (rf, layout), (vf, _), (mf, _) = (to_packed(t, [T] * t.shape[0]) for t in (r, v, m))
    return to_padded(gae_scan(rf, vf, mf, gamma, lam, layout), layout, T)


@HS
@given(st.integers(1, 6), st.integers(1, 70), st.integers(0, 10_000),
       st.sampled_from([(1.0, 1.0), (0.5, 2.0), (2.0, 0.5), (0.8, 1.25)]), st.sampled_from([0.0, 0.3, 0.7]))
def test_gae_unit_gamma_lam_equals_loop(rows, T, seed, gl, p_gap):
    gamma, lam = gl
    assert gamma * lam == 1.0
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(rows, T, generator=g)
    v = torch.randn(rows, T, generator=g)
    m = (torch.rand(rows, T, generator=g) >= p_gap).float()
    # zero padding at the end of some rows
    lengths = torch.randint(0, T + 1, (rows,), generator=g)
    m = m * (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1))
    want = gae_loop(r, v, m, gamma, lam)
    got = _gae_packed(r, v, m, gamma, lam)
    assert got.shape == (rows, T) and got.dtype == r.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gae_unit_gamma_lam_example():
    # one row, positions 1 and 3 masked out: A_t = sum over masked k >= t of
    # r_k + NV_{k+1} - v_k, NV = value at the next mask-1 position (0 past the end)
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0, 2.0]])
    v = torch.tensor([[0.5, 9.0, 0.25, 9.0, 1.0]])
    m = torch.tensor([[1.0, 0.0, 1.0, 0.0, 1.0]])
    d0 = 1.0 + 0.25 - 0.5
    d2 = 0.0 + 1.0 - 0.25
    d4 = 2.0 + 0.0 - 1.0
    want = torch.tensor([[d0 + d2 + d4, d2 + d4, d2 + d4, d4, d4]])
    torch.testing.assert_close(_gae_packed(r, v, m, 1.0, 1.0), want)
    torch.testing.assert_close(gae_loop(r, v, m, 1.0, 1.0), want)


def test_gae_long_row_unit_gamma_lam():
    # more positions than one scan chunk, and a long tail of mask 0
    g = torch.Generator().manual_seed(3)
    T = 300
    r = torch.randn(2, T, generator=g)
    v = torch.randn(2, T, generator=g)
    m = torch.ones(2, T)
    m[0, 100:140] = 0.0
    m[1, 250:] = 0.0
    torch.testing.assert_close(_gae_packed(r, v, m, 1.0, 1.0), gae_loop(r, v, m, 1.0, 1.0), rtol=1e-5, atol=1e-4)
    assert not math.isnan(float(_gae_packed(r, v, m, 1.0, 1.0).sum()))
