"""``--device``: which torch device a recompute runs on in this process."""

from __future__ import annotations

import torch

from rldiag.errors import ConfigError


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when present, else the CPU; ``cuda`` without a GPU is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is available (use --device cpu or auto)")
        return torch.device(device)
    raise ConfigError(f"--device {device!r}: expected auto, cpu or cuda")
