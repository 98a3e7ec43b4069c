"""Padded test tensors <-> the packed token layout, so that assertions written on ``(rows, width)``
matrices keep their meaning on flat ``(tokens,)`` tensors."""

from __future__ import annotations

import torch

from rldiag.engine.layout import Rows


def to_packed(padded: torch.Tensor, lengths) -> tuple[torch.Tensor, Rows]:
    """``(rows, width)`` right-padded -> flat ``(tokens,)`` values of each row's first
    ``lengths[i]`` tokens and their :class:`Rows` layout."""
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    return Rows.unpad(padded, lengths)


def to_padded(flat: torch.Tensor, rows: Rows, width: int | None = None) -> torch.Tensor:
    """Flat ``(tokens,)`` -> ``(rows, width)`` right-padded with 0."""
    return rows.pad(flat, width)
