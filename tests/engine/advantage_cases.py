"""Random training steps for the estimator property tests, and the glue that turns them into
engine batches (with ``extra`` columns) and runs one estimator.

A :class:`Case` is one training step as verl would see it: padded ``(rows, W)`` float32 tensors
plus per-row Python lists (uid, trajectory, session, ...). The hypothesis strategy draws singleton
groups, all-equal groups, tool gaps, fully masked rows, empty (aborted) rows and long rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from hypothesis import HealthCheck
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from rldiag.config.settings import resolve_settings
from rldiag.engine.advantage import ESTIMATORS, AdvInput
from rldiag.engine.batch import Batch, pack
from rldiag.engine.step_failures import StepErrors
from tests.engine.packing import to_packed, to_padded

HS = hsettings(max_examples=35, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DYADIC = np.array([0.0, 0.5, 1.0, 1.5, 2.0, -1.0])


@dataclass
class Case:
    rewards: torch.Tensor  # (rows, W) token-level rewards
    mask: torch.Tensor  # (rows, W)
    lengths: list[int]
    uids: list[str]
    values: torch.Tensor
    old_lp: torch.Tensor
    spp: torch.Tensor
    baselines: torch.Tensor  # (rows,)
    comps: dict[str, torch.Tensor]  # reward components (rows,)
    traj: list[str]
    step_idx: list[int]
    sessions: list[str]
    out_idx: list[int]
    extra_width: int = 0
    tags: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return len(self.lengths)


def make_case(seed: int, rows: int, max_len: int, equal_groups: bool, long_row: bool, noise: bool) -> Case:
    rng = np.random.default_rng(seed)
    n_uid = int(rng.integers(1, rows + 1))
    uids = [f"u{x}" for x in rng.integers(0, n_uid, rows)]
    lengths = rng.integers(1, max_len + 1, rows)
    if long_row:
        lengths[int(rng.integers(0, rows))] = 3 * max_len
    if rows > 3 and rng.random() < 0.2:
        lengths[int(rng.integers(0, rows))] = 0  # an aborted (empty) row
    width = int(max(lengths.max(), 1))
    mask = np.zeros((rows, width), np.float32)
    rewards = np.zeros((rows, width), np.float32)
    for i, L in enumerate(lengths):
        if L == 0:
            continue
        m = np.ones(L, np.float32)
        if L >= 3 and rng.random() < 0.4:  # a tool-observation span
            a = int(rng.integers(1, L - 1))
            m[a : a + int(rng.integers(1, L - a))] = 0
        if rng.random() < 0.1:
            m[:] = 0  # fully masked (e.g. rejected) row
        mask[i, :L] = m
        rewards[i, L - 1] = DYADIC[rng.integers(0, len(DYADIC))]
        if rng.random() < 0.3:
            rewards[i, int(rng.integers(0, L))] += DYADIC[rng.integers(0, len(DYADIC))]
        if noise and rng.random() < 0.3:
            rewards[i, int(rng.integers(0, L))] += np.float32(rng.normal())
    if equal_groups:  # every row of the first uid gets the same single terminal reward
        for i, u in enumerate(uids):
            if u == uids[0]:
                rewards[i] = 0
                if lengths[i]:
                    rewards[i, lengths[i] - 1] = 1.0
    valid = np.arange(width)[None, :] < lengths[:, None]
    values = (rng.normal(0.3, 0.5, (rows, width)) * valid).astype(np.float32)
    pi = rng.uniform(0.05, 0.99, (rows, width))
    old_lp = (np.log(pi) * valid).astype(np.float32)
    spp = ((pi**2 + rng.uniform(0, 1, (rows, width)) * (1 - pi**2)) * valid).astype(np.float32)
    # trajectories nest in uid groups: each row is one step of a trajectory of its uid
    traj, step_idx = [], []
    counter: dict = {}
    for u in uids:
        t = f"{u}-t{int(rng.integers(0, 2))}"
        k = counter.get(t, 0)
        gap = int(rng.random() < 0.15)  # a missing step index now and then
        traj.append(t)
        step_idx.append(k + gap)
        counter[t] = k + gap + 1
    # sessions nest in uid groups; output indices distinct within a session
    sessions, out_idx = [], []
    seen: dict = {}
    for u in uids:
        s = f"{u}-s{int(rng.integers(0, 2))}"
        k = seen.get(s, int(rng.integers(0, 3)))
        sessions.append(s)
        out_idx.append(k)
        seen[s] = k + 1 + int(rng.integers(0, 2))
    comps = {
        "acc": torch.from_numpy(rng.integers(0, 2, rows).astype(np.float32)),
        "fmt": torch.from_numpy(rng.choice([0.0, 0.5, 1.0], rows).astype(np.float32)),
    }
    return Case(
        rewards=torch.from_numpy(rewards),
        mask=torch.from_numpy(mask),
        lengths=[int(x) for x in lengths],
        uids=uids,
        values=torch.from_numpy(values),
        old_lp=torch.from_numpy(old_lp),
        spp=torch.from_numpy(spp),
        baselines=torch.from_numpy(rng.uniform(0, 1.5, rows).astype(np.float32)),
        comps=comps,
        traj=traj,
        step_idx=step_idx,
        sessions=sessions,
        out_idx=out_idx,
    )


@st.composite
def cases(draw, min_rows=2, max_rows=8, max_len=8):
    rows = draw(st.integers(min_rows, max_rows))
    return make_case(
        draw(st.integers(0, 2**31 - 1)), rows, max_len,
        equal_groups=draw(st.booleans()), long_row=draw(st.booleans()), noise=draw(st.booleans()),
    )


def _codes(keys: list) -> torch.Tensor:
    index = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    return torch.tensor([index[k] for k in keys], dtype=torch.long)


def to_batch(c: Case, step: int = 1) -> Batch:
    """One-step engine batch of a case (the packed layout of its padded tensors), with every
    extra column."""
    lengths = torch.tensor(c.lengths, dtype=torch.long)

    def flat(t: torch.Tensor) -> torch.Tensor:
        return to_packed(t, lengths)[0]

    g = _codes(c.uids)
    return Batch(
        response_mask=flat(c.mask),
        token_level_scores=flat(c.rewards),
        lengths=lengths,
        step_ids=torch.zeros(c.rows, dtype=torch.long),
        group_ids=g,
        steps=[step],
        n_groups=int(g.max()) + 1,
        max_response_length=torch.tensor([max(c.lengths)]),
        values=flat(c.values),
        old_log_probs=flat(c.old_lp),
        reward_baselines=c.baselines.clone(),
        extra={
            "sum_pi_squared": flat(c.spp),
            "traj_uid": _codes(c.traj),
            "step_index": torch.tensor(c.step_idx, dtype=torch.long),
            "session_id": _codes(c.sessions),
            "output_index": torch.tensor(c.out_idx, dtype=torch.long),
            **{k: v.clone() for k, v in c.comps.items()},
        },
        token_extra=("sum_pi_squared",),
    )


def settings_for(name: str, gamma: float = 1.0, lam: float = 1.0, norm: bool = True, **more):
    ov = {
        "algorithm.adv_estimator": name,
        "algorithm.gamma": gamma,
        "algorithm.lam": lam,
        "algorithm.norm_adv_by_std_in_grpo": norm,
        **more,
    }
    if name == "gdpo":
        ov.setdefault("algorithm.gdpo_reward_keys", "acc,fmt")
        ov.setdefault("algorithm.gdpo_reward_weights", "1.0,0.5")
    return resolve_settings(overrides=ov)


def run(name: str, batch: Batch, s=None, drop_extra: tuple[str, ...] = ()):
    """``(advantages, returns, failed)`` of one estimator on ``batch``; the token outputs back as
    padded ``(rows, longest row)`` matrices for the row-wise checks."""
    s = s or settings_for(name)
    if drop_extra:
        batch = replace(batch, extra={k: v for k, v in batch.extra.items() if k not in drop_extra})
    errors = StepErrors(batch.steps)
    adv, ret = ESTIMATORS.get(name)(AdvInput(batch, batch.token_level_scores, batch.response_mask, s, errors))
    return to_padded(adv, batch.rows), to_padded(ret, batch.rows), errors.failed()


def run_packed(name: str, cs: list[Case], s=None, drop_extra: tuple[str, ...] = ()):
    """Pack the cases as steps 1..n and run the estimator once."""
    return run(name, pack([to_batch(c, step=i + 1) for i, c in enumerate(cs)]), s, drop_extra)


#: estimators whose advantages are whitened over the step (verl's masked_whiten, 1e-8 inside the
#: square root; step_gae's std + 1e-8). When every whitened value of a step is (nearly) the same,
#: the output is float rounding noise amplified by up to 1e4, in verl as here: such steps are
#: compared at a tolerance of the noise, all others exactly to float32 tolerance.
WHITENING = {"gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gdpo", "token_gae_cross_step", "step_gae"}


def noise_tolerance(name: str, want: torch.Tensor, mask: torch.Tensor, atol: float) -> float:
    if name in WHITENING:
        on = want[:, : mask.shape[1]][mask > 0]
        if on.numel() and float(on.abs().max()) < 0.05:
            return 0.05
    return atol


def close(got: torch.Tensor, want: torch.Tensor, lengths: list[int], rtol=1e-5, atol=1e-5) -> None:
    """Compare within each row's length (the tokens a scenario keeps)."""
    for i, L in enumerate(lengths):
        torch.testing.assert_close(got[i, :L], want[i, :L], rtol=rtol, atol=atol, equal_nan=True)


def check_against(name: str, cs: list[Case], reference, s=None, rtol=1e-5, atol=1e-5, drop_extra=()):
    """Packed engine vs the reference one step at a time. A step where the reference raises
    ValueError (or gives NaN where verl would) must be flagged, and only those."""
    adv, ret, failed = run_packed(name, cs, s, drop_extra)
    row0 = 0
    expect_failed = set()
    for i, c in enumerate(cs):
        rows = slice(row0, row0 + c.rows)
        row0 += c.rows
        try:
            want_adv, want_ret = reference(c)
        except ValueError:
            expect_failed.add(i + 1)
            continue
        if bool(torch.isnan(want_adv).any()) and name in ("step_gae",):
            expect_failed.add(i + 1)
            continue
        close(adv[rows], want_adv, c.lengths, rtol, noise_tolerance(name, want_adv, c.mask, atol))
        # outcome estimators whose advantages are whitened (gdpo) return them as returns too:
        # the same noise rule applies
        close(ret[rows], want_ret, c.lengths, rtol, noise_tolerance(name, want_ret, c.mask, atol))
    assert set(failed) == expect_failed, (failed, expect_failed)
