"""Claw-R1's three estimators against the float64 computation of their formulas
(tests/engine/reference_claw64.py), on training steps of 1,000+ agent-step rows and on exactly
tied steps and groups, within float32 tolerance (rtol 1e-5, atol 1e-6: the verl differential
tests' tolerance). A float32 left-to-right mean of a 1,000-row step was 2e-6 to 4e-6 off, and
whitening a tie by ``std + 1e-8`` turned one ulp of its mean into -0.909 (32 rows of 0.7)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from rldiag.engine import precise
from rldiag.engine.batch import pack
from tests.conftest import make_batch
from tests.engine import reference_claw64 as ref64
from tests.engine.advantage_cases import Case, make_case, run, run_packed, settings_for, to_batch
from tests.engine.test_precise import LargestFloat64

RTOL, ATOL = 1e-5, 1e-6


def agent_case(seed: int, rows: int, offset: float, max_len: int = 12) -> Case:
    """One training step of ``rows`` agent steps (trajectories of several steps in prompt groups,
    tool spans, gaps in step indices, fully masked and empty rows): each row's last token has an
    outcome reward ``offset + N(0, 1)``, a fifth of the tokens a small dense reward, values
    ``N(0.3, 0.5)``; all float32."""
    c = make_case(seed, rows, max_len, equal_groups=False, long_row=False, noise=False)
    rng = np.random.default_rng(seed + 1)
    lengths = np.array(c.lengths)
    inside = np.arange(c.rewards.shape[1])[None, :] < lengths[:, None]
    r = np.zeros(c.rewards.shape, np.float32)
    live = np.flatnonzero(lengths > 0)
    r[live, lengths[live] - 1] = offset + rng.normal(0, 1, live.size)
    r += (rng.normal(0, 0.1, r.shape) * (rng.random(r.shape) < 0.2) * inside).astype(np.float32)
    v = (rng.normal(0.3, 0.5, r.shape) * inside).astype(np.float32)
    return replace(c, rewards=torch.from_numpy(r), values=torch.from_numpy(v))


def reference(name: str, c: Case, gamma: float, lam: float):
    if name == "step_gae":
        return ref64.step_gae(c.rewards, c.mask, c.values, c.traj, c.step_idx, gamma, lam)
    if name == "token_gae_cross_step":
        return ref64.token_gae_cross_step(c.rewards, c.mask, c.values, c.traj, c.step_idx, gamma, lam)
    return ref64.traj_grpo(c.rewards, c.mask, c.uids, c.traj)


def assert_float32_close(got: torch.Tensor, want: np.ndarray, lengths: list[int], what: str) -> None:
    """Within each row's length: ``|got - want| <= ATOL + RTOL |want|``."""
    inside = np.arange(want.shape[1])[None, :] < np.array(lengths)[:, None]
    g = got[:, : want.shape[1]].double().numpy()[inside]
    w = want[inside]
    err = np.abs(g - w)
    bad = err > ATOL + RTOL * np.abs(w)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {w.size} values off, worst {err.max():.3g}"


NAMES = ["step_gae", "token_gae_cross_step", "traj_grpo"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("offset", [0.0, 2.0, 20.0])
@pytest.mark.parametrize("gl", [(1.0, 1.0), (0.9, 0.95)])
def test_large_steps_match_the_float64_formulas(name, offset, gl):
    cs = [agent_case(seed, rows, offset) for seed, rows in ((11, 1200), (12, 1700))]
    adv, ret, failed = run_packed(name, cs, settings_for(name, gamma=gl[0], lam=gl[1]))
    assert not failed
    row0 = 0
    for i, c in enumerate(cs):
        want_adv, want_ret = reference(name, c, *gl)
        rows = slice(row0, row0 + c.rows)
        row0 += c.rows
        assert_float32_close(adv[rows], want_adv, c.lengths, f"{name} advantages, step {i + 1}")
        assert_float32_close(ret[rows], want_ret, c.lengths, f"{name} returns, step {i + 1}")


def tied_batch(n: int, score: float, width: int = 3, step: int = 1):
    """``n`` one-step trajectories (``groups`` prompt groups), each row ``width`` action tokens
    with ``score`` on its last token and values 0, in one prompt group of run step ``step``:
    every step reward, raw advantage, trajectory score and group member is ``score`` (the
    token-level GAE's raw advantage is ``score`` on every token of a row)."""
    b = make_batch(scores=[[0.0] * (width - 1) + [score]] * n, mask=[[1] * width] * n,
                   values=[[0.0] * width] * n, uids=[0] * n, steps=[step] * n)
    b.extra["traj_uid"] = torch.arange(n)
    b.extra["step_index"] = torch.zeros(n, dtype=torch.long)
    return b


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n,score", [(32, 0.7), (16, 0.1), (1024, 0.1), (1500, 0.7), (8, 3.3)])
def test_an_exact_tie_whitens_to_zero(name, n, score):
    adv, ret, failed = run(name, tied_batch(n, score))
    assert not failed
    assert torch.equal(adv, torch.zeros_like(adv))
    if name == "step_gae":  # returns are A + V, not whitened
        assert torch.equal(ret, torch.full_like(ret, np.float32(score)))


def test_a_tied_group_in_a_spread_step_is_zero_and_the_rest_exact():
    """traj_grpo on a step of 1,200 rows with one extra group of 24 trajectories of 0.7: that
    group 0 exactly, every other value within float32 tolerance of float64."""
    c = agent_case(5, 1200, 2.0)
    tie = 24
    rewards = torch.zeros(tie, c.rewards.shape[1])
    rewards[:, 0] = 0.7
    mask = torch.zeros_like(rewards)
    mask[:, 0] = 1
    c = replace(
        c, rewards=torch.cat([c.rewards, rewards]), mask=torch.cat([c.mask, mask]),
        values=torch.cat([c.values, torch.zeros_like(rewards)]), lengths=c.lengths + [1] * tie,
        uids=c.uids + ["tied"] * tie, traj=c.traj + [f"tied-{k}" for k in range(tie)],
        step_idx=c.step_idx + [0] * tie, sessions=c.sessions + [f"s{k}" for k in range(tie)],
        out_idx=c.out_idx + [0] * tie, baselines=torch.cat([c.baselines, torch.zeros(tie)]),
        comps={k: torch.cat([v, torch.zeros(tie)]) for k, v in c.comps.items()},
        old_lp=torch.cat([c.old_lp, torch.zeros_like(rewards)]), spp=torch.cat([c.spp, torch.zeros_like(rewards)]),
    )
    adv, _, failed = run_packed("traj_grpo", [c], settings_for("traj_grpo"))
    assert not failed
    assert torch.equal(adv[-tie:], torch.zeros_like(adv[-tie:]))
    want, _ = ref64.traj_grpo(c.rewards, c.mask, c.uids, c.traj)
    assert_float32_close(adv, want, c.lengths, "traj_grpo advantages")


def test_a_tied_step_packed_with_a_spread_one():
    """Steps are whitened apart: a tied step packed after a 1,200-row step stays exactly 0, the
    other step is within tolerance of float64."""
    c = agent_case(7, 1200, 2.0)
    tie = tied_batch(40, 0.7, step=2)
    for name in ("step_gae", "token_gae_cross_step"):
        adv, _, failed = run(name, pack([to_batch(c, step=1), tie]), settings_for(name))
        assert not failed
        assert torch.equal(adv[c.rows:], torch.zeros_like(adv[c.rows:]))
        want, _ = reference(name, c, 1.0, 1.0)
        assert_float32_close(adv[: c.rows], want, c.lengths, f"{name} advantages")


@pytest.mark.parametrize("name", ["step_gae", "traj_grpo"])
def test_float64_per_row_never_per_token(monkeypatch, name):
    """Blocks of 64 tokens: no float64 tensor beyond a block, the rows or the (trajectory, step)
    table appears (token_gae_cross_step's float64 scan is verl's GAE recursion, shared)."""
    monkeypatch.setattr(precise, "BLOCK", 64)
    c = agent_case(3, 1200, 2.0, max_len=80)
    batch = to_batch(c)
    with LargestFloat64() as mode:
        run(name, batch, settings_for(name))
    n_traj = len(set(c.traj))
    assert batch.rows.n_tokens > 4 * (n_traj * (max(c.step_idx) + 1))
    assert 0 < mode.largest <= max(64, c.rows + 1, n_traj * (max(c.step_idx) + 1))
