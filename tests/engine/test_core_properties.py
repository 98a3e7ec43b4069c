"""Property tests (hypothesis) of the core engine against per-row reference loops, and the
invariances: row permutation, extra padding, packing several steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from rldiag.engine.batch import Batch, pack
from rldiag.engine.pipeline import recompute_batch
from tests.conftest import settings
from tests.engine import reference_core as ref
from tests.engine.gen_batches import flat

HS = hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def step_data(draw, min_rows=2, max_rows=9, max_len=12):
    """A random step: rows with lengths, tool gaps, fully masked rows, singleton / equal groups."""
    rows = draw(st.integers(min_rows, max_rows))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len + 1, rows)
    n_groups = draw(st.integers(1, rows))
    uids = [f"u{x}" for x in rng.integers(0, n_groups, rows)]
    mask = [list((rng.random(L) > 0.25).astype(int)) for L in lengths]
    if rows > 2 and draw(st.booleans()):
        mask[0] = [0] * lengths[0]  # a fully masked row
    # make sure the step has >= 2 actor tokens so whitening is defined
    mask[-1] = [1] * lengths[-1] if lengths[-1] >= 2 else [1]
    if sum(map(sum, mask)) < 2:
        mask[-2] = [1] * lengths[-2]
    equal = draw(st.booleans())
    scores = []
    for L in lengths:
        s = [0.0] * L
        s[-1] = 1.0 if equal else float(rng.integers(0, 3))
        if rng.random() < 0.3:
            s[rng.integers(0, L)] += float(rng.normal())
        scores.append(s)
    values = [list(rng.normal(0.3, 0.5, L)) for L in lengths]
    old = [list(-np.abs(rng.normal(1, 0.5, L))) for L in lengths]
    new = [list(np.array(o) + rng.normal(0, 0.3, len(o))) for o in old]
    return dict(lengths=lengths, uids=uids, mask=mask, scores=scores, values=values, old=old, new=new)


def to_batch(d, step=1) -> Batch:
    lengths = d["lengths"]
    rows = len(lengths)
    codes = {u: i for i, u in enumerate(dict.fromkeys(d["uids"]))}
    return Batch(
        response_mask=flat(d["mask"]),
        token_level_scores=flat(d["scores"]),
        lengths=torch.tensor(lengths, dtype=torch.long),
        step_ids=torch.zeros(rows, dtype=torch.long),
        group_ids=torch.tensor([codes[u] for u in d["uids"]]),
        steps=[step],
        n_groups=len(codes),
        max_response_length=torch.tensor([int(max(lengths))]),
        values=flat(d["values"]),
        old_log_probs=flat(d["old"]),
        log_probs=flat(d["new"]),
    )


def unpad(t: torch.Tensor, lengths):
    """A packed ``(tokens,)`` output as one list per row."""
    return [x.tolist() for x in torch.split(t, list(lengths))]


def assert_close(got, want, tol=2e-5):
    for g_row, w_row in zip(got, want):
        assert g_row == pytest.approx(w_row, rel=tol, abs=tol)


@HS
@given(step_data(), st.sampled_from([(1.0, 1.0), (1.0, 0.95), (0.9, 0.8)]))
def test_gae_matches_reference(d, gl):
    gamma, lam = gl
    r = recompute_batch(to_batch(d), settings(estimator="gae", gamma=gamma, lam=lam))
    adv, ret = ref.gae_ref(d["scores"], d["values"], d["mask"], gamma, lam)
    assert_close(unpad(r.tokens["returns"], d["lengths"]), ret)
    assert_close(unpad(r.tokens["advantages"], d["lengths"]), adv, tol=1e-4)


@HS
@given(step_data(), st.booleans())
def test_grpo_matches_reference(d, norm):
    r = recompute_batch(to_batch(d), settings(estimator="grpo", norm_by_std=norm))
    assert_close(unpad(r.tokens["advantages"], d["lengths"]), ref.grpo_ref(d["scores"], d["mask"], d["uids"], norm), tol=1e-4)


@HS
@given(step_data())
def test_rloo_matches_reference(d):
    r = recompute_batch(to_batch(d), settings(estimator="rloo"))
    assert_close(unpad(r.tokens["advantages"], d["lengths"]), ref.rloo_ref(d["scores"], d["mask"], d["uids"]), tol=1e-4)


@HS
@given(step_data(), st.sampled_from([(0.2, 0.2, 3.0), (0.2, 0.28, 3.0), (0.1, 0.3, 1.5)]))
def test_vanilla_matches_reference(d, clips):
    lo, hi, c = clips
    r = recompute_batch(to_batch(d), settings(estimator="grpo", clip_low=lo, clip_high=hi, clip_c=c))
    adv = unpad(r.tokens["advantages"], d["lengths"])
    losses, clipped, lower = ref.vanilla_token_losses_ref(d["old"], d["new"], adv, lo, hi, c)
    assert_close(unpad(r.tokens["pg_losses"], d["lengths"]), losses, tol=1e-4)
    m = [x for row in d["mask"] for x in row]
    flat_l = [x for row in losses for x in row]
    n = sum(m)
    token_mean = sum(v * k for v, k in zip(flat_l, m)) / n
    assert r.metrics["actor/pg_loss"].item() == pytest.approx(token_mean, rel=1e-4, abs=1e-5)
    clipfrac = sum(c_ * k for c_, k in zip((x for row in clipped for x in row), m)) / (n + 1e-8)
    assert r.metrics["actor/pg_clipfrac"].item() == pytest.approx(clipfrac, rel=1e-5, abs=1e-6)
    lowfrac = sum(c_ * k for c_, k in zip((x for row in lower for x in row), m)) / (n + 1e-8)
    assert r.metrics["actor/pg_clipfrac_lower"].item() == pytest.approx(lowfrac, rel=1e-5, abs=1e-6)


def _compare(r1, r2, tok=None):
    """Token results equal (``tok``: the token order of ``r2`` in ``r1``'s layout), metrics equal."""
    for k in ("advantages", "returns", "pg_losses"):
        a, b = r1.tokens[k], r2.tokens[k]
        if tok is not None:
            a = a[tok]
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for k, v in r1.metrics.items():
        torch.testing.assert_close(v, r2.metrics[k], rtol=1e-4, atol=1e-5, equal_nan=True)


@HS
@given(step_data(min_rows=3), st.sampled_from(["gae", "grpo", "rloo"]), st.integers(0, 10_000))
def test_row_permutation_permutes_results_and_keeps_metrics(d, est, seed):
    b = to_batch(d)
    perm = torch.from_numpy(np.random.default_rng(seed).permutation(b.n_rows))
    s = settings(estimator=est)
    _compare(recompute_batch(b, s), recompute_batch(b.select_rows(perm), s), tok=b.rows.take(perm)[1])


@HS
@given(step_data(), st.sampled_from(["gae", "grpo", "rloo"]), st.integers(1, 7),
       st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum"]))
def test_where_the_step_sits_in_a_pack_changes_nothing(d, est, extra, agg):
    """A step after ``extra`` one-token rows of another step (its tokens start elsewhere in the
    packed layout, so the scans' chunks fall elsewhere) gives what it gives alone."""
    s = settings(estimator=est, agg=agg)
    alone = to_batch(d, step=2)
    lead = to_batch(dict(lengths=[1] * extra, uids=list(range(extra)), mask=[[1]] * extra, scores=[[0.5]] * extra,
                         values=[[0.1]] * extra, old=[[-1.0]] * extra, new=[[-0.9]] * extra), step=1)
    both = recompute_batch(pack([lead, alone]), s)
    one = recompute_batch(alone, s)
    for k in ("advantages", "returns", "pg_losses"):
        torch.testing.assert_close(both.tokens[k][extra:], one.tokens[k], rtol=1e-4, atol=1e-5)
    for k, v in one.metrics.items():
        torch.testing.assert_close(both.metrics[k][1:], v, rtol=1e-4, atol=1e-5, equal_nan=True)


@HS
@given(st.lists(step_data(), min_size=2, max_size=4), st.sampled_from(["gae", "grpo", "rloo"]),
       st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]))
def test_packing_steps_equals_one_at_a_time(ds, est, agg):
    s = settings(estimator=est, agg=agg)
    singles = [to_batch(d, step=i + 1) for i, d in enumerate(ds)]
    packed = recompute_batch(pack(singles), s)
    tok0 = 0
    for i, b in enumerate(singles):
        one = recompute_batch(b, s)
        toks = slice(tok0, tok0 + b.n_tokens)
        tok0 += b.n_tokens
        for k in ("advantages", "returns", "pg_losses", "ratio"):
            torch.testing.assert_close(packed.tokens[k][toks], one.tokens[k], rtol=1e-4, atol=1e-5)
        for k, v in one.metrics.items():
            torch.testing.assert_close(packed.metrics[k][i : i + 1], v, rtol=1e-4, atol=1e-5, equal_nan=True)
