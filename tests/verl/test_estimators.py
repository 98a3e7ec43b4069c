"""Every advantage estimator verl 0.9.1 registers, called through verl's own registry, against
``rldiag recompute`` on the same run directory (advantages and returns per token)."""

from __future__ import annotations

import zlib

import numpy as np
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
