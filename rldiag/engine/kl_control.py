"""The reward-side KL coefficient carried from step to step (``algorithm.kl_ctrl``: verl's
``FixedKLController`` / ``AdaptiveKLController``), and coefficients fixed in advance for a
distributed recompute (:mod:`rldiag.executors.klchain` chains the adaptive one over every step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rldiag.engine.settings import EngineSettings
from rldiag.errors import ConfigError, UnknownKeyError


@dataclass
class KLControllerState:
    """The reward-side KL coefficient carried from step to step (verl's Fixed/Adaptive
    controllers; adaptive from Ziegler et al. 2019, arXiv:1909.08593)."""

    value: float

    def advance(self, settings: EngineSettings, current_kl: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Coefficients used by each step ``(n_steps,)`` in order; updates ``self.value`` past them.

        ``current_kl`` and ``rows`` are ``(n_steps,)``; the update of step s uses its own KL and
        its number of rows (verl passes the batch size as ``n_steps``).
        """
        kind = settings["algorithm.kl_ctrl.type"]
        if kind == "fixed":
            return torch.full_like(current_kl, float(settings["algorithm.kl_ctrl.kl_coef"]))
        target = float(settings["algorithm.kl_ctrl.target_kl"])
        horizon = float(settings["algorithm.kl_ctrl.horizon"])
        used = []
        for kl, n in zip(current_kl.tolist(), rows.tolist()):
            used.append(self.value)
            err = min(max(kl / target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + err * n / horizon
        return torch.tensor(used, dtype=current_kl.dtype, device=current_kl.device)


@dataclass
class PresetKLCoefficients:
    """Reward-side KL coefficients fixed in advance, one per packed step in order: a distributed
    recompute chains the adaptive controller over every step first (from each step's
    :func:`~rldiag.engine.reward_kl.reward_kl`), then recomputes a pack with its steps'
    coefficients. Same interface as :class:`KLControllerState`."""

    values: list[float]

    def advance(self, settings: EngineSettings, current_kl: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if len(self.values) != current_kl.numel():
            raise ValueError(f"{len(self.values)} preset KL coefficients for {current_kl.numel()} steps")
        return torch.tensor(self.values, dtype=current_kl.dtype, device=current_kl.device)


def initial_kl_state(settings: EngineSettings) -> KLControllerState:
    kind = settings["algorithm.kl_ctrl.type"]
    if kind not in ("fixed", "adaptive"):
        raise UnknownKeyError("KL controller type", kind, ["fixed", "adaptive"])
    if kind == "adaptive" and not float(settings["algorithm.kl_ctrl.horizon"]) > 0:
        raise ConfigError("algorithm.kl_ctrl.horizon must be > 0 for the adaptive KL controller")
    return KLControllerState(float(settings["algorithm.kl_ctrl.kl_coef"]))
