"""The per-step signals the doctor's rules read: logged metrics (``metrics.jsonl``) and the
metrics of a recompute under the run's settings, among them the engine's health signals
(:func:`rldiag.engine.metrics.signal_metrics`):

- ``rldiag/mask/credit_cut_fraction``: share of actor tokens (mask 1) followed, later in their
  row, by a mask-0 position (a tool observation): under verl 0.8.0's REINFORCE++ (a reward-to-go
  that resets at mask 0, ``compute_reinforce_plus_plus_outcome_advantage``) such a token receives
  none of the outcome reward.
- ``rldiag/advantages/centre_offset``: masked mean of the advantages over their masked
  (population) standard deviation; 0 when every advantage is 0.
- ``rldiag/rewards/kl_sign_flip_fraction``: among non-aborted rows with a nonzero score, the
  share whose summed ``token_level_rewards`` has the opposite sign of the summed score (only
  with ``algorithm.use_kl_in_reward``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rldiag.doctor.evaluators import Series


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
