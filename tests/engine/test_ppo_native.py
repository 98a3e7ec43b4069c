"""The compiled PPO clipped surrogate (rldiag.engine.ppo_native, native/ppo_clip.c) against its
torch twin (rldiag.engine.policy_loss.clip's ppo_terms and indicators): the same losses to the
bit, signed zeros included, the same clip indicator and dual-clip counts, with masks as float32
and bool, with and without IS weights, asymmetric clips and dual-clip constants, advantages of
either zero, NaN and infinities; and the whole loss's metrics the same through verl's vanilla
loss."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import rldiag.engine.ppo_native as native
from rldiag.engine import host, kernels
from rldiag.engine.layout import Rows
from rldiag.engine.policy_loss.clip import ppo_terms

pytestmark = pytest.mark.skipif(not native.built(),
                                reason="the compiled kernel was not built (no C compiler at install); .ci/run requires it")

HS = hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, zeros of the same sign, NaN where NaN."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    keep = ~nan_a
    return bool(torch.equal(nan_a, nan_b) and torch.equal(a[keep], b[keep])
                and torch.equal(torch.signbit(a[keep]), torch.signbit(b[keep])))


def inputs(seed: int, lengths: list[int], bool_mask: bool, weighted: bool):
    g = torch.Generator().manual_seed(seed)
    rows = Rows.from_lengths(torch.tensor(lengths))
    n = rows.n_tokens
    adv = torch.randn(n, generator=g) * 2
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e30, -1e-30])
    if n:
        at = torch.randint(0, n, (min(n, 10),), generator=g)
        adv[at] = special[torch.randint(0, len(special), (len(at),), generator=g)]
    log_ratio = (torch.randn(n, generator=g) * 0.3).clamp(-20, 20)
    log_ratio[torch.rand(n, generator=g) < 0.05] = 20.0  # ratios far past the clip
    ratio = torch.exp(log_ratio)
    mask = torch.rand(n, generator=g) < 0.85
    weights = torch.rand(n, generator=g) * 2 if weighted else None
    return adv, ratio, (mask if bool_mask else mask.float()), weights, rows


def twin(adv, ratio, mask, weights, rows, lo, hi, c):
    _, l2_, c1, l3, losses = ppo_terms(adv, ratio, lo, hi, c)
    l1 = -adv * ratio
    if weights is not None:
        losses = losses * weights
    return losses, host.greater_on(l2_, l1, mask), kernels.count_greater_masked(c1, l3, mask, rows)


@HS
@given(st.integers(0, 10_000), st.lists(st.integers(0, 200), min_size=1, max_size=6), st.booleans(), st.booleans(),
       st.sampled_from([(0.2, 0.2, 3.0), (0.2, 0.28, 3.0), (0.1, 0.3, 10.0), (0.0, 0.0, 1.5)]))
def test_the_same_bits_as_the_torch_twin(seed, lengths, bool_mask, weighted, clip):
    lo, hi, c = clip
    adv, ratio, mask, weights, rows = inputs(seed, lengths, bool_mask, weighted)
    got = native.ppo_tokens(adv, ratio, mask, weights, rows.offsets, 1 - lo, 1 + hi, c)
    assert got is not None
    want = twin(adv, ratio, mask, weights, rows, lo, hi, c)
    assert same_bits(got[0], want[0])
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[2], want[2]) and got[2].dtype == torch.float32


def test_a_worked_token_each_branch():
    # A = 1, r = 1.5: clipped at 1.2 (l2 = -1.2 > l1 = -1.5): loss -1.2, clipped
    # A = -1, r = 5: l1 = 5, l2 = 1.2, clipped1 = 5 > l3 = 3: the dual clip binds, loss 3
    # A = -1, r = 0.9: inside the clip, loss 0.9, nothing binds
    # A = +0, r = 2: zeros: the loss is -0 (clipped1's sign)
    adv = torch.tensor([1.0, -1.0, -1.0, 0.0])
    ratio = torch.tensor([1.5, 5.0, 0.9, 2.0])
    losses, clipped, lower = native.ppo_tokens(adv, ratio, torch.ones(4), None, torch.tensor([0, 2, 4]), 0.8, 1.2, 3.0)
    assert losses[:3].tolist() == pytest.approx([-1.2, 3.0, 0.9])
    assert losses[3].item() == 0.0 and torch.signbit(losses[3])
    assert clipped.tolist() == [1.0, 0.0, 0.0, 0.0]  # l2 > l1 only on the first (A > 0, r past the clip)
    assert lower.tolist() == [1.0, 0.0]


def test_the_twin_runs_where_the_kernel_does_not_apply():
    adv, ratio, mask, _, rows = inputs(1, [5, 3], False, False)
    assert native.ppo_tokens(adv.double(), ratio.double(), mask, None, rows.offsets, 0.8, 1.2, 3.0) is None
    assert native.ppo_tokens(adv, ratio, mask.to(torch.int8), None, rows.offsets, 0.8, 1.2, 3.0) is None
    assert native.ppo_tokens(adv, ratio, mask, torch.ones(8, dtype=torch.float64), rows.offsets, 0.8, 1.2, 3.0) is None


def test_verls_vanilla_loss_the_same_through_the_kernel(monkeypatch):
    from rldiag.engine.pipeline import recompute_batch
    from tests.conftest import make_batch
    from tests.conftest import settings as engine_settings

    gen = torch.Generator().manual_seed(3)
    lp = [(-torch.rand(7, generator=gen) * 2).tolist() for _ in range(6)]
    new = [(torch.tensor(r) + torch.randn(7, generator=gen) * 0.4).tolist() for r in lp]
    scores = [[0.0] * 6 + [float(i % 3)] for i in range(6)]
    mask = [[1, 1, 1, 1, 1, 0, 1]] * 3 + [[1, 1, 1, 1, 1, 1, 1]] * 3
    batch = make_batch(scores=scores, mask=mask, uids=["a", "a", "a", "b", "b", "b"], old_log_probs=lp, log_probs=new)
    s = engine_settings(estimator="grpo")
    got = recompute_batch(batch, s)
    assert got.metrics["actor/pg_clipfrac"].item() > 0  # the clip fires on some tokens
    monkeypatch.setattr(native, "_LIB", None)
    want = recompute_batch(batch, s)
    for name in ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"):
        assert torch.equal(got.metrics[name], want.metrics[name]), name
    assert same_bits(got.tokens["pg_losses"], want.tokens["pg_losses"])
    assert torch.equal(got.rows["clipped_tokens"], want.rows["clipped_tokens"])
