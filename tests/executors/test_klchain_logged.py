"""The adaptive KL chain of a run captured under a capture policy: verl's logged statistic stands in
for a step whose batch is missing or sampled (rldiag.executors.klchain.with_logged)."""

from __future__ import annotations

import torch

from rldiag.config.settings import resolve_settings
from rldiag.engine.pipeline import KLControllerState
from rldiag.executors.klchain import chain, with_logged


def _stat(step: int, kl: float, rows: int):
    return [step], torch.tensor([kl], dtype=torch.float32), torch.tensor([rows])


def test_logged_statistics_replace_and_join_the_computed_ones_in_step_order():
    computed = [_stat(1, 0.5, 8), _stat(3, 0.2, 2), _stat(5, 0.1, 8)]  # step 3's batch: a sample
    merged = with_logged(computed, {2: (0.3, 8), 3: (0.25, 8), 4: (0.05, 8)})
    assert [st[0] for st in merged] == [[1], [2], [3], [4], [5]]
    assert [float(st[1]) for st in merged] == [0.5, 0.30000001192092896, 0.25, 0.05000000074505806, 0.10000000149011612]
    assert [int(st[2]) for st in merged] == [8] * 5  # the whole batch's rows, not the sample's
    assert with_logged(computed, {}) is computed


def test_the_chain_over_logged_statistics_is_the_trainers():
    settings = resolve_settings(None, {"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.type": "adaptive",
                                       "algorithm.kl_ctrl.kl_coef": 0.1, "algorithm.kl_ctrl.target_kl": 0.1,
                                       "algorithm.kl_ctrl.horizon": 100})
    state = KLControllerState(0.1)
    coefs = chain(state, settings, with_logged([_stat(1, 0.5, 10)], {2: (0.0, 10), 3: (0.1, 10)}))
    # verl's AdaptiveKLController: value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon
    want, value = {}, 0.1
    for step, kl in ((1, 0.5), (2, 0.0), (3, 0.1)):
        want[step] = float(torch.tensor(value, dtype=torch.float32))  # reported as the stat's dtype
        value *= 1 + min(max(float(torch.tensor(kl, dtype=torch.float32)) / 0.1 - 1, -0.2), 0.2) * 10 / 100
    assert coefs == want and state.value == value
