"""``--device``: which torch device a recompute runs on in this process."""

from __future__ import annotations

import torch

from rldiag.errors import ConfigError


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when present, else the CPU; ``cuda`` or ``cuda:N`` must name a GPU this
    process sees (an error before any step is read, not a failure of every step)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: expected auto, cpu, cuda or cuda:N")
    if dev.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available (use --device cpu or auto)")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ConfigError(f"--device {device}: this process sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return dev
