"""The per-step signals the doctor's rules read: logged metrics (``metrics.jsonl``), the
metrics of a streamed recompute under the run's settings, and three per-step statistics the
engine does not report as metrics:

- ``rldiag/mask/credit_cut_fraction``: share of actor tokens (mask 1) followed, later in their
  row, by a mask-0 position (a tool observation): under verl's REINFORCE++ (mask-resetting
  reward-to-go, seed 002 section 9.1) such a token receives none of the outcome reward.
- ``rldiag/advantages/centre_offset``: masked mean of the advantages over their masked
  (population) standard deviation; 0 when every advantage is 0.
- ``rldiag/rewards/kl_sign_flip_fraction``: among non-aborted rows with a nonzero score, the
  share whose summed ``token_level_rewards`` has the opposite sign of the summed score (only
  with ``algorithm.use_kl_in_reward``).

These three are small pure tensor functions kept here until the engine reports them itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from rldiag.doctor.evaluators import Series


def credit_cut_fraction(mask: torch.Tensor, lengths: torch.Tensor) -> float:
    """``mask`` ``(rows, tokens)``, ``lengths`` ``(rows,)``: share of mask-1 tokens that have a
    mask-0 position after them in their row (NaN without mask-1 tokens)."""
    width = mask.shape[1]
    pos = torch.arange(width, device=mask.device).unsqueeze(0)
    valid = pos < lengths.unsqueeze(1)
    zero = valid & (mask == 0)
    last_zero = torch.where(zero, pos.expand_as(mask), torch.full_like(pos.expand_as(mask), -1)).amax(dim=1)
    live = valid & (mask > 0)
    cut = live & (pos < last_zero.unsqueeze(1))
    n = int(live.sum())
    return float(cut.sum()) / n if n else math.nan


def centre_offset(advantages: torch.Tensor, mask: torch.Tensor) -> float:
    """Masked mean over masked population std of ``advantages`` (NaN without masked tokens)."""
    a = advantages[mask > 0].to(torch.float64)
    if a.numel() == 0:
        return math.nan
    mean = float(a.mean())
    std = float(a.std(unbiased=False))
    if std == 0.0:
        return 0.0 if mean == 0.0 else math.copysign(math.inf, mean)
    return mean / std


def kl_sign_flip_fraction(scores: torch.Tensor, rewards: torch.Tensor, lengths: torch.Tensor) -> float:
    """Share of non-aborted rows with a nonzero summed score whose summed reward has the
    opposite sign (NaN when no row has a nonzero score)."""
    live = lengths > 0
    s = scores.sum(-1)[live].to(torch.float64)
    r = rewards.sum(-1)[live].to(torch.float64)
    keep = s != 0
    if not bool(keep.any()):
        return math.nan
    return float((torch.sign(r[keep]) != torch.sign(s[keep])).to(torch.float64).mean())


@dataclass
class SignalTable:
    """``metric -> {step: value}`` per source."""

    logged: dict[str, dict[int, float]] = field(default_factory=dict)
    recomputed: dict[str, dict[int, float]] = field(default_factory=dict)

    def add_logged(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.logged.setdefault(k, {})[step] = float(v)

    def add_recomputed(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.recomputed.setdefault(k, {})[step] = float(v)

    def series(self, name: str, source: str = "any") -> Series | None:
        """The metric over steps: ``logged``, ``recomputed``, or ``any`` (logged where present,
        recomputed elsewhere). None when the chosen source has no value."""
        lg = self.logged.get(name, {}) if source in ("any", "logged") else {}
        rc = self.recomputed.get(name, {}) if source in ("any", "recomputed") else {}
        merged = {**rc, **lg}
        if not merged:
            return None
        steps = np.array(sorted(merged), dtype=np.int64)
        values = np.array([merged[s] for s in steps], dtype=np.float64)
        used = (["logged"] if lg else []) + (["recomputed"] if any(s not in lg for s in rc) else [])
        return Series(name=name, steps=steps, values=values, source="+".join(used))

    @property
    def logged_steps(self) -> int:
        return len({s for d in self.logged.values() for s in d})

    @property
    def recomputed_steps(self) -> int:
        return len({s for d in self.recomputed.values() for s in d})
