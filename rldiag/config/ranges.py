"""Valid ranges of numeric settings: the :class:`Range` type and the limits of float32 and int32.

Each setting's range is declared with the setting, in :mod:`rldiag.config.schema`.

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
