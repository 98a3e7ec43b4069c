"""KL estimators (kl/k1, abs, mse/k2, low_var_kl/k3, the straight-through '+' forms, 'full'
rejected), KL reward shaping and the KL loss for every estimator, and the adaptive KL controller
replayed across steps and packs exactly as verl's AdaptiveKLController + apply_kl_penalty."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rldiag.config.settings import resolve_settings
from rldiag.engine.batch import Batch, pack
from rldiag.engine.kl import KL_ESTIMATORS, kl_estimate
from rldiag.engine.pipeline import KLControllerState, initial_kl_state, recompute_batch
from rldiag.errors import ConfigError, UnknownKeyError
from tests.engine.advantage_cases import HS
from tests.engine.packing import recompute_padded, to_packed

BASES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


def _by_formula(kind: str, lp: float, ref: float) -> float:
    d = lp - ref
    if kind == "k1":
        return d
    if kind == "abs":
        return abs(d)
    if kind == "k2":
        return 0.5 * d * d
    x = min(max(ref - lp, -20.0), 20.0)  # k3 with verl's two clamps
    return min(max(math.exp(x) - x - 1.0, -10.0), 10.0)


def test_worked_values():
    lp = torch.tensor([-1.0, -0.5, 0.0, -60.0])
    ref = torch.tensor([-1.2, -0.5, -50.0, 0.0])
    assert kl_estimate("k1", lp, ref).tolist() == pytest.approx([0.2, 0.0, 50.0, -60.0], abs=1e-6)
    assert kl_estimate("abs", lp, ref).tolist() == pytest.approx([0.2, 0.0, 50.0, 60.0], abs=1e-6)
    assert kl_estimate("k2", lp, ref).tolist() == pytest.approx([0.02, 0.0, 1250.0, 1800.0], rel=1e-6, abs=1e-7)
    k3 = kl_estimate("k3", lp, ref).tolist()
    assert k3[0] == pytest.approx(math.exp(-0.2) + 0.2 - 1, rel=1e-5)  # 0.0187307...
    assert k3[1] == 0.0
    assert k3[2] == pytest.approx(10.0)  # x clamped to -20: e^-20 + 19 -> clamped to 10
    assert k3[3] == pytest.approx(10.0)  # x clamped to +20: e^20 - 21 -> clamped to 10


@pytest.mark.parametrize("name", sorted(KL_ESTIMATORS.names()))
def test_every_key_and_its_plus_form_has_the_forward_value_of_its_base(name):
    rng = np.random.default_rng(0)
    lp = torch.from_numpy(rng.normal(-1, 2, 50).astype(np.float32))
    ref = torch.from_numpy(rng.normal(-1, 2, 50).astype(np.float32))
    base = BASES[name.rstrip("+")]
    want = torch.tensor([_by_formula(base, a, b) for a, b in zip(lp.tolist(), ref.tolist())], dtype=torch.float32)
    torch.testing.assert_close(kl_estimate(name, lp, ref), want, rtol=1e-5, atol=1e-6)
    if name.endswith("+"):
        torch.testing.assert_close(kl_estimate(name, lp, ref), kl_estimate(name[:-1], lp, ref), rtol=0, atol=0)


def test_registry_holds_exactly_verls_keys():
    plain = {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"}
    assert set(KL_ESTIMATORS.names()) == plain | {k + "+" for k in plain}


@pytest.mark.parametrize("name", ["full", "full+"])
def test_full_is_rejected_with_a_clear_error(name):
    with pytest.raises(ConfigError, match="full vocabulary.*NotImplementedError"):
        kl_estimate(name, torch.zeros(2), torch.zeros(2))
    s = resolve_settings(overrides={"algorithm.use_kl_in_reward": True, "algorithm.kl_penalty": name})
    with pytest.raises(ConfigError, match="not supported"):
        recompute_batch(_batch([_step(np.random.default_rng(1), 3, 4)]), s)


def test_unknown_estimator_lists_the_valid_keys():
    with pytest.raises(UnknownKeyError, match="low_var_kl"):
        kl_estimate("k4", torch.zeros(1), torch.zeros(1))


# ---- KL in the reward, KL loss, adaptive controller --------------------------------------------


def _step(rng, rows, width):
    lengths = rng.integers(1, width + 1, rows)
    valid = np.arange(width)[None, :] < lengths[:, None]
    mask = valid & (rng.random((rows, width)) > 0.2)
    if rows > 2:
        mask[0] = False  # a fully masked row still counts in the batch mean of the row KLs
    scores = np.zeros((rows, width), np.float32)
    scores[np.arange(rows), lengths - 1] = rng.integers(0, 2, rows)
    old = (-np.abs(rng.normal(1, 0.5, (rows, width))) * valid).astype(np.float32)
    ref = (old + rng.normal(0, 0.3, (rows, width)) * valid).astype(np.float32)
    new = (old + rng.normal(0, 0.2, (rows, width)) * valid).astype(np.float32)
    return dict(lengths=lengths, mask=mask.astype(np.float32), scores=scores, old=old, ref=ref, new=new)


def _batch(steps, first=1) -> Batch:
    parts = []
    for i, d in enumerate(steps):
        rows = len(d["lengths"])
        lengths = torch.from_numpy(d["lengths"].astype(np.int64))
        t = {k: to_packed(torch.from_numpy(d[k]), lengths)[0] for k in ("mask", "scores", "old", "ref", "new")}
        parts.append(Batch(
            response_mask=t["mask"], token_level_scores=t["scores"],
            lengths=torch.from_numpy(d["lengths"].astype(np.int64)), step_ids=torch.zeros(rows, dtype=torch.long),
            group_ids=torch.arange(rows) // 2, steps=[first + i], n_groups=(rows + 1) // 2,
            max_response_length=torch.tensor([int(d["lengths"].max())]),
            old_log_probs=t["old"], ref_log_prob=t["ref"], log_probs=t["new"],
        ))
    return pack(parts)


class _VerlAdaptive:
    """The controller as verl's AdaptiveKLController / FixedKLController define it."""

    def __init__(self, kind, coef, target, horizon):
        self.kind, self.value, self.target, self.horizon = kind, coef, target, horizon

    def update(self, current_kl, n_steps):
        if self.kind == "adaptive":
            err = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
            self.value *= 1 + err * n_steps / self.horizon


def _apply_kl_penalty(d, ctrl, kind):
    """verl's apply_kl_penalty on one step: (token_level_rewards, current_kl, beta)."""
    mask = torch.from_numpy(d["mask"])
    kld = kl_estimate(kind, torch.from_numpy(d["old"]), torch.from_numpy(d["ref"])) * mask
    beta = ctrl.value
    rewards = torch.from_numpy(d["scores"]) - beta * kld
    per_row = [float((kld[i] * mask[i]).sum() / (mask[i].sum() + 1e-8)) for i in range(mask.shape[0])]
    current = float(torch.tensor(per_row).mean())
    ctrl.update(current, mask.shape[0])
    return rewards, current, beta


@HS
@given(st.integers(0, 10**6), st.sampled_from(sorted(BASES)), st.sampled_from(["fixed", "adaptive"]),
       st.lists(st.integers(2, 7), min_size=2, max_size=6), st.integers(1, 3))
def test_kl_in_reward_and_controller_match_verl_across_steps_and_packs(seed, kind, ctrl_type, sizes, per_pack):
    rng = np.random.default_rng(seed)
    steps = [_step(rng, rows, 6) for rows in sizes]
    target = float(rng.choice([0.001, 0.05, 1.0]))
    s = resolve_settings(overrides={
        "algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": True, "algorithm.kl_penalty": kind,
        "algorithm.kl_ctrl.type": ctrl_type, "algorithm.kl_ctrl.kl_coef": 0.2, "algorithm.kl_ctrl.target_kl": target,
        "algorithm.kl_ctrl.horizon": 20,
    })
    verl = _VerlAdaptive(ctrl_type, 0.2, target, 20)
    want = [_apply_kl_penalty(d, verl, kind) for d in steps]
    state = initial_kl_state(s)
    for start in range(0, len(steps), per_pack):  # packs of per_pack steps, in step order
        chunk = steps[start : start + per_pack]
        res = recompute_padded(_batch(chunk, first=start + 1), s, state, width=max(d["mask"].shape[1] for d in chunk))
        row0 = 0
        for j, d in enumerate(chunk):
            rewards, current, beta = want[start + j]
            rows = slice(row0, row0 + len(d["lengths"]))
            row0 += len(d["lengths"])
            # rel 1e-5: the controller reads the step's KL in float32, verl's in float64
            assert res.metrics["actor/reward_kl_penalty_coeff"][j].item() == pytest.approx(beta, rel=1e-5)
            assert res.metrics["actor/reward_kl_penalty"][j].item() == pytest.approx(current, rel=1e-5, abs=1e-7)
            w = rewards.shape[1]
            torch.testing.assert_close(res.tokens["token_level_rewards"][rows, :w], rewards, rtol=1e-5, atol=1e-6)
    assert state.value == pytest.approx(verl.value, rel=1e-5)
    if ctrl_type == "fixed":
        assert state.value == 0.2


def test_adaptive_coefficient_moves_by_at_most_20_percent_times_rows_over_horizon():
    st_ = KLControllerState(1.0)
    s = resolve_settings(overrides={"algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.target_kl": 0.1,
                                    "algorithm.kl_ctrl.horizon": 100})
    used = st_.advance(s, torch.tensor([10.0, 0.0, 0.1]), torch.tensor([50.0, 50.0, 8.0]))
    # step 1 used 1.0, then *(1 + 0.2*0.5); step 2 used 1.1, then *(1 - 0.2*0.5); step 3: error 0
    assert used.tolist() == pytest.approx([1.0, 1.1, 1.1 * 0.9], rel=1e-6)
    assert st_.value == pytest.approx(1.1 * 0.9, rel=1e-7)  # the KL 0.1 is a float32, as verl's .item()


def test_controller_settings_are_validated():
    with pytest.raises(ConfigError, match="horizon"):
        initial_kl_state(resolve_settings(overrides={"algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.horizon": 0}))
    with pytest.raises(UnknownKeyError, match="adaptive"):
        initial_kl_state(resolve_settings(overrides={"algorithm.kl_ctrl.type": "pid"}))


@pytest.mark.parametrize("kind", sorted(BASES))
def test_kl_loss_uses_current_vs_reference(kind):
    d = _step(np.random.default_rng(3), 5, 6)
    s = resolve_settings(overrides={
        "algorithm.adv_estimator": "grpo", "actor_rollout_ref.actor.use_kl_loss": True,
        "actor_rollout_ref.actor.kl_loss_type": kind, "actor_rollout_ref.actor.kl_loss_coef": 0.01,
    })
    res = recompute_batch(_batch([d]), s)
    m = torch.from_numpy(d["mask"])
    kld = kl_estimate(kind, torch.from_numpy(d["new"]), torch.from_numpy(d["ref"]))
    assert res.metrics["actor/kl_loss"].item() == pytest.approx(float((kld * m).sum() / m.sum()), rel=1e-5)
    assert res.metrics["actor/kl_coef"].item() == pytest.approx(0.01)
