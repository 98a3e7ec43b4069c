"""For every registered estimator: packing several steps gives the same as one step at a time,
permuting rows within a step permutes the results, and the same steps fail. Plus the registry
metadata and Batch packing of extra columns."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from rldiag.config.settings import resolve_settings
from rldiag.engine.advantage import ESTIMATORS
from rldiag.engine.batch import pack
from rldiag.engine.requirements import estimator_need, estimator_optional
from tests.engine.advantage_cases import cases, close, noise_tolerance, run, settings_for, to_batch

HS15 = hsettings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", ESTIMATORS.names())
@HS15
@given(cs=st.lists(cases(max_rows=7), min_size=1, max_size=3), seed=st.integers(0, 10**6))
def test_packing_and_permutation(name, cs, seed):
    s = settings_for(name, gamma=0.9, lam=0.95)
    packed = pack([to_batch(c, step=i + 1) for i, c in enumerate(cs)])
    adv_p, ret_p, failed_p = run(name, packed, s)
    failed_1: dict = {}
    tol: dict = {}
    ret_tol: dict = {}
    row0 = 0
    blocks = []
    rng = np.random.default_rng(seed)
    for i, c in enumerate(cs):
        rows = slice(row0, row0 + c.rows)
        blocks.append(torch.from_numpy(rng.permutation(c.rows) + row0))
        row0 += c.rows
        a1, r1, f1 = run(name, to_batch(c, step=i + 1), s)
        failed_1.update(f1)
        if not f1:
            tol[i] = noise_tolerance(name, a1, c.mask, 1e-5)
            # estimators that return the (whitened) advantages as returns get the same tolerance
            ret_tol[i] = tol[i] if torch.equal(r1, a1) else 1e-5
            close(adv_p[rows], a1, c.lengths, atol=tol[i])
            close(ret_p[rows], r1, c.lengths, atol=ret_tol[i])
    assert failed_p == failed_1
    perm = torch.cat(blocks)
    adv_q, ret_q, failed_q = run(name, packed.select_rows(perm), s)
    assert failed_q == failed_p
    lengths = [L for c in cs for L in c.lengths]
    ok = [packed.steps[int(packed.step_ids[j])] not in failed_p for j in range(packed.n_rows)]
    for k, j in enumerate(perm.tolist()):
        if ok[j]:
            L = lengths[j]
            atol = tol[int(packed.step_ids[j])]
            torch.testing.assert_close(adv_q[k, :L], adv_p[j, :L], rtol=1e-5, atol=atol, equal_nan=True)
            torch.testing.assert_close(ret_q[k, :L], ret_p[j, :L], rtol=1e-5, atol=ret_tol[int(packed.step_ids[j])],
                                       equal_nan=True)


def test_every_estimator_declares_its_needs_and_source():
    expected = {
        "gae": ("values",),
        "remax": ("reward_baselines",),
        "optimal_token_baseline": ("old_log_probs", "sum_pi_squared"),
        "tir_optimal_token_baseline": ("old_log_probs", "sum_pi_squared"),
        "step_gae": ("values", "traj_uid", "step_index"),
        "token_gae_cross_step": ("values", "traj_uid", "step_index"),
        "traj_grpo": ("traj_uid",),
    }
    verl_keys = {
        "gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo", "opo", "grpo_passk",
        "gpg", "rloo_vectorized", "grpo_vectorized", "optimal_token_baseline", "tir_optimal_token_baseline", "gdpo",
    }
    assert verl_keys | set(expected) <= set(ESTIMATORS.names())
    for name in ESTIMATORS.names():
        meta = ESTIMATORS.meta(name)
        assert meta.source
        assert estimator_need(name).all_of == expected.get(name, ())
    assert estimator_optional("grpo") == ("session_id", "output_index")
    whitens = {n: ESTIMATORS.meta(n).whitens for n in ESTIMATORS.names() if ESTIMATORS.meta(n).whitens}
    assert whitens == {"grpo": "group", "grpo_vectorized": "group", "traj_grpo": "group", "gae": "step",
                       "reinforce_plus_plus": "step", "reinforce_plus_plus_baseline": "step", "gdpo": "step",
                       "step_gae": "step", "token_gae_cross_step": "step"}
    gd = resolve_settings(overrides={"algorithm.gdpo_reward_keys": "acc,fmt"})
    assert estimator_need("gdpo", gd).all_of == ("acc", "fmt")
    assert "algorithm.gdpo_reward_keys" in estimator_need("gdpo", resolve_settings()).all_of[0]


def test_pack_keeps_id_codes_distinct_and_concatenates_token_extras():
    c1 = to_batch(_tiny(3, 2), step=1)
    c2 = to_batch(_tiny(2, 5), step=2)
    p = pack([c1, c2])
    t1, t2 = c1.extra["traj_uid"], c2.extra["traj_uid"]
    assert p.extra["traj_uid"].tolist() == t1.tolist() + (t2 + int(t1.max()) + 1).tolist()
    s1 = c1.extra["session_id"]
    assert p.extra["session_id"][3:].min() > s1.max()
    assert p.extra["step_index"].tolist() == c1.extra["step_index"].tolist() + c2.extra["step_index"].tolist()
    n1 = c1.n_tokens
    assert p.token_extra == ("sum_pi_squared",)
    assert p.extra["sum_pi_squared"].shape == (n1 + c2.n_tokens,)
    torch.testing.assert_close(p.extra["sum_pi_squared"][:n1], c1.extra["sum_pi_squared"])
    torch.testing.assert_close(p.extra["sum_pi_squared"][n1:], c2.extra["sum_pi_squared"])
    # selecting rows selects their tokens of the token extras too
    sel = p.select_rows(torch.tensor([4, 0]))
    want = torch.cat([p.extra["sum_pi_squared"][n1 + c2.rows.offsets[1]:], p.extra["sum_pi_squared"][: c1.rows.offsets[1]]])
    torch.testing.assert_close(sel.extra["sum_pi_squared"], want)


def _tiny(rows, width):
    from tests.engine.advantage_cases import make_case

    c = make_case(7, rows, width, equal_groups=False, long_row=False, noise=False)
    return c


def test_pack_of_steps_with_and_without_session_columns_folds_only_where_present():
    from dataclasses import replace

    from tests.engine.advantage_cases import make_case

    c1, c2 = make_case(3, 6, 5, False, False, False), make_case(4, 6, 5, False, False, False)
    b1 = to_batch(c1, step=1)
    b2 = to_batch(c2, step=2)
    b2 = replace(b2, extra={k: v for k, v in b2.extra.items() if k not in ("session_id", "output_index")})
    packed_adv, _, _ = run("grpo", pack([b1, b2]))
    one, _, _ = run("grpo", b1)
    two, _, _ = run("grpo", b2)
    close(packed_adv[:6], one, c1.lengths)
    close(packed_adv[6:], two, c2.lengths)
