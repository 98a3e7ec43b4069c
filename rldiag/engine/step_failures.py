"""Per-step failures inside a packed batch.

Where verl raises for an input (whitening over fewer than two tokens, say), the affected step
fails with a message and every other step of the packed batch goes on: :class:`StepErrors`
collects those messages (it raises nothing; rldiag's error classes are in :mod:`rldiag.errors`).
"""

from __future__ import annotations

import torch


class StepErrors:
    """Collects ``step index -> message`` for the steps of one packed batch."""

    def __init__(self, steps: list[int]):
        self.steps = steps
        self.messages: dict[int, str] = {}

    def flag(self, bad: torch.Tensor, message: str) -> None:
        """Mark every step where ``bad`` ``(n_steps,)`` is true as failed (first message wins)."""
        for idx in torch.nonzero(bad.cpu(), as_tuple=False).flatten().tolist():
            self.messages.setdefault(idx, message)

    def flag_all(self, message: str) -> None:
        for idx in range(len(self.steps)):
            self.messages.setdefault(idx, message)

    def failed(self) -> dict[int, str]:
        """``run step number -> message``."""
        return {self.steps[i]: m for i, m in sorted(self.messages.items())}

    def ok_mask(self, device=None) -> torch.Tensor:
        ok = torch.ones(len(self.steps), dtype=torch.bool, device="cpu")  # set flag by flag on the CPU, then moved
        for i in self.messages:
            ok[i] = False
        return ok.to(device) if device is not None else ok
