"""Every advantage estimator verl 0.9.1 registers, called through verl's own registry, against
``rldiag recompute`` on the same run directory (advantages and returns per token)."""

from __future__ import annotations

import zlib

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.verl.harness import assert_close, in_rows, long_tail_table, padded, run_rldiag, scalar, write_run

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
from verl.trainer.config import AlgoConfig  # noqa: E402

#: rldiag's estimators verl's core_algos does not hold (agentic ones, from verl's recipes)
NOT_IN_CORE = {"step_gae", "token_gae_cross_step", "traj_grpo"}
GAMMA, LAM = 0.9, 0.8


GDPO_KEYS = ["format_reward", "accuracy_reward"]
GDPO_WEIGHTS = [0.5, 2.0]


def verl_estimate(name: str, table, norm_by_std: bool = True):
    """verl's advantages for ``table``, with the arguments verl's trainer passes each estimator
    (``ray_trainer.compute_advantage``: gae and grpo by name, every other key with
    ``token_level_rewards``, ``response_mask``, ``config``, ``index``, remax's ``reward_baselines``, gdpo's
    batch, the optimal-token-baseline inputs)."""
    mask = padded(table, "response_mask")
    rewards = padded(table, "token_level_scores")
    index = scalar(table, "uid").astype(object)
    config = AlgoConfig(
        gamma=GAMMA, lam=LAM, norm_adv_by_std_in_grpo=norm_by_std,
        gdpo_reward_keys=GDPO_KEYS, gdpo_reward_weights=GDPO_WEIGHTS,
    )
    if name == "gae":
        return core_algos.compute_gae_advantage_return(rewards, padded(table, "values"), mask, GAMMA, LAM)
    if name == "grpo":
        return core_algos.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm_by_std)
    kwargs = dict(token_level_rewards=rewards, response_mask=mask, config=config, index=index)
    if name == "remax":  # a batch holds reward_baselines only where remax's greedy rollout made it
        kwargs["reward_baselines"] = torch.tensor(scalar(table, "reward_baselines"))
    if name == "gdpo":
        rows = mask.shape[0]
        # the response length verl reads is attention_mask's count after the prompt, minus one
        attention = torch.cat([torch.ones(rows, 1), in_rows(table).float()], 1).long()
        kwargs["batch"] = {"prompts": torch.zeros(rows, 1), "attention_mask": attention}
        kwargs["non_tensor_batch"] = {k: scalar(table, k) for k in GDPO_KEYS}
    if name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        kwargs.update(sum_pi_squared=padded(table, "sum_pi_squared"), old_log_probs=padded(table, "old_log_probs"),
                      rollout_is_weights=None)
    return core_algos.get_adv_estimator_fn(name)(**kwargs)


def _names():
    from rldiag.engine.advantage import ESTIMATORS

    return [n for n in ESTIMATORS.names() if n not in NOT_IN_CORE]


def test_every_core_estimator_is_covered():
    from rldiag.engine.advantage import ESTIMATORS

    assert set(core_algos.ADV_ESTIMATOR_REGISTRY) <= set(ESTIMATORS.names())
    assert set(_names()) == set(core_algos.ADV_ESTIMATOR_REGISTRY)


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("name", _names())
def test_estimator_matches_verl(tmp_path, name, norm_by_std):
    # a seed of the case that every process agrees on (hash() of a str changes per process:
    # the data, and the float32 rounding of verl's own row sums, would change from run to run)
    rng = np.random.default_rng(zlib.crc32(f"{name}/{norm_by_std}".encode()))
    tables = [long_tail_table(rng, step, dense=True) for step in (1, 2)]
    algorithm = {"gamma": GAMMA, "lam": LAM, "gdpo_reward_keys": GDPO_KEYS, "gdpo_reward_weights": GDPO_WEIGHTS}
    run = write_run(tmp_path / "run", tables, {"algorithm": algorithm})
    _, tokens = run_rldiag(
        run, {"algorithm.adv_estimator": name, "algorithm.norm_adv_by_std_in_grpo": norm_by_std}
    )
    for table in tables:
        step = int(table["step"][0].as_py())
        adv, ret = verl_estimate(name, table, norm_by_std)
        inside = in_rows(table)
        assert_close(padded(tokens[step], "advantages"), adv, f"{name} advantages, step {step}", inside)
        assert_close(padded(tokens[step], "returns"), ret, f"{name} returns, step {step}", inside)


@pytest.mark.parametrize("centre,spread", [(0.9, 1e-3), (0.5, 1e-4)])
def test_grpo_vectorized_close_scores_match_verl(tmp_path, centre, spread):
    """2,000 groups of 8 reward-model scores with a small spread around a non-zero mean: verl centres
    them before squaring (verl.utils.groupwise.group_mean_std), and so must rldiag (a one-pass
    float32 variance was off by a median 3 % at 0.9 +- 1e-3, by 65x at 0.5 +- 1e-4)."""
    rng = np.random.default_rng(zlib.crc32(f"close/{centre}".encode()))
    groups, n, length = 2000, 8, 3
    rows = groups * n
    score = (centre + spread * rng.standard_normal(rows)).astype(np.float32)
    scores = np.zeros((rows, length), dtype=np.float32)
    scores[:, -1] = score
    lengths = np.full(rows, length)
    from rldiag.synth import list_array

    table = pa.table({
        "uid": pa.array(np.repeat([f"p{i}" for i in range(groups)], n), pa.string()),
        "step": pa.array(np.ones(rows, dtype=np.int64)),
        "token_level_scores": list_array(scores.ravel(), lengths, pa.float32()),
        "response_mask": list_array(np.ones(rows * length, dtype=np.int8), lengths, pa.int8()),
    })
    run = write_run(tmp_path / "run", [table])
    _, tokens = run_rldiag(run, {"algorithm.adv_estimator": "grpo_vectorized"})
    adv, _ = verl_estimate("grpo_vectorized", table)
    got = padded(tokens[1], "advantages")
    # both sides in float32 from the same centred form and the same reductions: the same bits
    # up to float32 rounding
    assert_close(got, adv, "grpo_vectorized advantages", atol=1e-5, rtol=1e-5)
