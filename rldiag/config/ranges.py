"""The valid range of every numeric setting.

A value outside it is refused when the settings are resolved (from the run's config file or
``--set``), naming the key and the range, instead of running into NaN advantages or a torch
overflow halfway through a recompute.

Where verl validates a key, its check is kept where the key is used (``clip_ratio_c > 1`` for
dual-clip PPO in ``verl.trainer.ppo.core_algos.compute_policy_loss_vanilla``, the rollout
thresholds in ``rollout_corr_helper``, the batch sizes of ``ActorConfig``: see
``rldiag.engine.policy_loss``, ``rollout_correction`` and ``microbatch``). The ranges here are
what the quantity means (a discount factor, a fraction of tokens, a length) and what verl's
arithmetic can take: verl computes in float32, so a float setting must be finite and within
float32's range (``--set actor_rollout_ref.actor.clip_ratio=1e308`` overflows in ``1 + clip``),
and a length or a count fits in an int32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FLOAT32_MAX = 3.4028234663852886e38
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Range:
    lo: float
    hi: float
    lo_open: bool = False  # lo itself is not valid
    why: str = ""

    def contains(self, x: float) -> bool:
        return math.isfinite(x) and (x > self.lo if self.lo_open else x >= self.lo) and x <= self.hi

    def describe(self, key: str) -> str:
        name = key.rsplit(".", 1)[-1]
        text = f"{_num(self.lo)} {'<' if self.lo_open else '<='} {name} <= {_num(self.hi)}"
        return f"{text} ({self.why})" if self.why else text


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e12 else f"{x:g}"


#: any float setting without a narrower range: finite, as float32 holds it
FLOAT = Range(-FLOAT32_MAX, FLOAT32_MAX, why="a finite float32")
#: any integer setting without a narrower range
INT = Range(-INT32_MAX - 1, INT32_MAX, why="an int32")

_A = "actor_rollout_ref.actor"
_P = f"{_A}.policy_loss"
_NONNEG = Range(0.0, FLOAT32_MAX)
_POSITIVE = Range(0.0, FLOAT32_MAX, lo_open=True)
_COUNT = Range(1, INT32_MAX)
#: a torch.Generator seed (verl seeds data_loader_seed + rank), within an int32 as every count here
_SEED = Range(0, INT32_MAX, why="a torch.Generator seed")

RANGES: dict[str, Range] = {
    "algorithm.gamma": Range(0.0, 1.0, why="a discount factor"),
    "algorithm.lam": Range(0.0, 1.0, why="GAE's lambda"),
    "algorithm.kl_ctrl.kl_coef": _NONNEG,
    "algorithm.kl_ctrl.target_kl": _NONNEG,
    "algorithm.kl_ctrl.horizon": Range(1, INT32_MAX, why="steps; the adaptive controller divides by it"),
    f"{_A}.clip_ratio": _NONNEG,
    f"{_A}.clip_ratio_low": _NONNEG,
    f"{_A}.clip_ratio_high": _NONNEG,
    f"{_A}.loss_scale_factor": Range(0.0, FLOAT32_MAX, lo_open=True, why="the loss is divided by it"),
    "critic.loss_scale_factor": Range(0.0, FLOAT32_MAX, lo_open=True, why="the loss is divided by it"),
    f"{_A}.kl_loss_coef": _NONNEG,
    "critic.cliprange_value": _NONNEG,
    f"{_A}.tau_pos": Range(0.0, FLOAT32_MAX, lo_open=True, why="SAPO divides by it"),
    f"{_A}.tau_neg": Range(0.0, FLOAT32_MAX, lo_open=True, why="SAPO divides by it"),
    f"{_P}.clip_cov_ratio": Range(0.0, 1.0, why="a fraction of the tokens"),
    f"{_P}.kl_cov_ratio": Range(0.0, 1.0, why="a fraction of the tokens"),
    f"{_P}.ppo_kl_coef": _NONNEG,
    f"{_P}.dro_beta": _POSITIVE,
    "data.max_response_length": Range(1, INT32_MAX, why="tokens"),
    "data.max_prompt_length": Range(1, INT32_MAX, why="tokens"),
    "rldiag.micro_batch_size": _COUNT,
    "rldiag.mini_batch_size": _COUNT,
    "rldiag.dp_size": _COUNT,
    "trainer.critic_warmup": Range(0, INT32_MAX, why="steps"),
    f"{_A}.ppo_max_token_len_per_gpu": Range(1, INT32_MAX, why="tokens per micro-batch"),
    "critic.ppo_max_token_len_per_gpu": Range(1, INT32_MAX, why="tokens per micro-batch"),
    f"{_A}.data_loader_seed": _SEED,
    "critic.data_loader_seed": _SEED,
    "critic.ppo_mini_batch_size": _COUNT,
    "critic.ppo_micro_batch_size_per_gpu": _COUNT,
}


def range_of(key: str, integer: bool) -> Range:
    return RANGES.get(key, INT if integer else FLOAT)


def check_range(key: str, value: float, integer: bool) -> None:
    """Raise ValueError (the caller names the source) when ``value`` is outside ``key``'s range."""
    r = range_of(key, integer)
    if not r.contains(value):
        raise ValueError(f"{value!r} is outside the valid range {r.describe(key)}")
