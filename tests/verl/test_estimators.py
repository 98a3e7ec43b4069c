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


# ---- exact ties: a whitened constant is rounding noise in float32 -----------------------------
#
# Whitening an exactly tied group (or step) of n float32 copies of c divides the deviation of the
# float32 mean from c by (std + eps) with std = 0 (GRPO: eps = 1e-6; verl's masked_whiten: the
# square root of var + 1e-8, so 1e-4). A float32 sum of n copies of c, in any order, is within
# n(n+1)/2 ulp(c) of n c (each partial sum j c is rounded by at most ulp(j c) / 2 <= j ulp(c));
# with the division's rounding, each side's mean is within (n + 1) / 2 ulp(c) of c, so the two
# sides differ by at most (n + 1) ulp(c) / (std + eps). verl 0.9.1's GRPO on 16 x 0.1 gives
# -0.0074, rldiag -0.0147 (8 x 0.7: both 0.0560).


def ulp32(x: float) -> float:
    """The spacing of float32 numbers at ``|x|``."""
    return float(np.spacing(np.float32(abs(x))))


def tie_bound(n: int, value: float, whitens: str) -> float:
    """The largest ``|rldiag - verl|`` on a whitened exact tie of ``n`` float32 copies of ``value``."""
    eps = 1e-6 if whitens == "group" else 1e-8**0.5
    return (n + 1) * ulp32(value) / eps


def with_row_scores(table: pa.Table, scores: dict[int, float]) -> pa.Table:
    """``table`` with the given rows' token_level_scores replaced: 0, and the score on the last token."""
    from rldiag.synth import list_array

    col = table["token_level_scores"].combine_chunks()
    lengths = np.diff(col.offsets.to_numpy())
    flat = col.values.to_numpy(zero_copy_only=False).copy()
    offsets = col.offsets.to_numpy()
    for row, score in scores.items():
        flat[offsets[row]:offsets[row + 1]] = 0
        flat[offsets[row + 1] - 1] = np.float32(score)
    i = table.schema.get_field_index("token_level_scores")
    return table.set_column(i, "token_level_scores", list_array(flat, lengths, pa.float32()))


def _whitens(name: str) -> str:
    from rldiag.engine.advantage import ESTIMATORS

    return ESTIMATORS.meta(name).whitens


def _estimate_both(tmp_path, name: str, table: pa.Table):
    algorithm = {"gamma": GAMMA, "lam": LAM, "gdpo_reward_keys": GDPO_KEYS, "gdpo_reward_weights": GDPO_WEIGHTS}
    run = write_run(tmp_path / "run", [table], {"algorithm": algorithm})
    _, tokens = run_rldiag(run, {"algorithm.adv_estimator": name})
    adv, ret = verl_estimate(name, table)
    return padded(tokens[1], "advantages"), padded(tokens[1], "returns"), adv, ret


TIES = {0: 0.1, 1: 0.7, 2: 0.3}  # tied groups of 16: their score


@pytest.mark.parametrize("name", _names())
def test_tied_groups_match_verl_within_the_rounding_noise(tmp_path, name):
    """Groups of 16 rows with one score each (0.1, 0.7, 0.3) beside 3 groups with a spread: an
    estimator that whitens per group agrees with verl within the tie bound on the tied groups
    (GRPO: 0.0073 on 0.1, 0.050 on 0.7), every other value to float32 tolerance."""
    n = 16
    rng = np.random.default_rng(zlib.crc32(f"ties/{name}".encode()))
    table = long_tail_table(rng, 1, prompts=6, n=n)
    table = with_row_scores(table, {g * n + k: s for g, s in TIES.items() for k in range(n)})
    got_adv, got_ret, adv, ret = _estimate_both(tmp_path, name, table)
    inside = in_rows(table)
    tied = torch.zeros_like(inside)
    tied[: len(TIES) * n] = True
    for what, got, want in (("advantages", got_adv, adv), ("returns", got_ret, ret)):
        # returns are the advantages for every estimator that whitens per group
        whitened = _whitens(name) == "group" and torch.equal(ret, adv)
        assert_close(got, want, f"{name} {what}, untied", inside & ~tied if whitened else inside)
        for g, score in TIES.items() if whitened else ():
            rows = slice(g * n, (g + 1) * n)
            err = float((got[rows] - want[rows]).abs()[inside[rows]].max())
            assert err <= tie_bound(n, score, "group"), (name, what, score, err)


@pytest.mark.parametrize("score", [0.1, 0.7])
@pytest.mark.parametrize("name", _names())
def test_a_tied_step_matches_verl_within_the_rounding_noise(tmp_path, name, score):
    """64 one-token rows (4 groups of 16), each scoring ``score``, values 0: GAE's and REINFORCE++'s
    whitened quantity is ``score`` at every token, gdpo's a constant below the sum of its weights,
    GRPO's groups are tied; those agree with verl within the tie bound (verl's masked_whiten of 64
    x 0.1: -7.5e-5, rldiag's 6.0e-4), everything else to float32 tolerance."""
    rows, n = 64, 16
    lengths = np.ones(rows, dtype=np.int64)
    from rldiag.synth import list_array

    def tokens(x, dtype=None):
        return list_array(np.asarray(x), lengths, dtype or pa.float32())

    table = pa.table({
        "uid": pa.array([f"p{i // n}" for i in range(rows)]), "step": pa.array(np.ones(rows, dtype=np.int64)),
        "token_level_scores": tokens(np.full(rows, score, np.float32)),
        "response_mask": tokens(np.ones(rows, np.int8), pa.int8()),
        "values": tokens(np.zeros(rows, np.float32)),
        "old_log_probs": tokens(np.full(rows, -0.5, np.float32)),
        "sum_pi_squared": tokens(np.full(rows, 0.5, np.float32)),
        "reward_baselines": pa.array(np.zeros(rows, np.float32)),
        "format_reward": pa.array(np.ones(rows, np.float32)),
        "accuracy_reward": pa.array(np.full(rows, score, np.float32)),
    })
    got_adv, got_ret, adv, ret = _estimate_both(tmp_path, name, table)
    whitens = _whitens(name)
    # the constant each side whitens: the score (GAE, REINFORCE++), a sum of whitened ties
    # below the sum of the weights (gdpo), the score of each group (GRPO); rpp_baseline whitens
    # each group's R - mean, itself within ulps of 0, and agrees to float32 tolerance
    constant = {"gdpo": sum(abs(w) for w in GDPO_WEIGHTS), "reinforce_plus_plus_baseline": None}.get(name, score)
    for what, got, want in (("advantages", got_adv, adv), ("returns", got_ret, ret)):
        if not whitens or constant is None or (what == "returns" and not torch.equal(ret, adv)):
            assert_close(got, want, f"{name} {what}")
            continue
        size = n if whitens == "group" else rows
        err = float((got - want).abs().max())
        assert err <= tie_bound(size, constant, whitens), (name, what, err)
