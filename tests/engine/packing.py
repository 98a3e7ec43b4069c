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


def full_rows(*padded: torch.Tensor) -> tuple[list[torch.Tensor | None], Rows]:
    """The packed forms of full-width ``(rows, width)`` tensors (``None`` stays ``None``) and
    their layout: every row holds ``width`` tokens."""
    ref = next(t for t in padded if t is not None)
    lengths = torch.full((ref.shape[0],), ref.shape[1], dtype=torch.long)
    rows = Rows.from_lengths(lengths)
    return [None if t is None else to_packed(t, lengths)[0] for t in padded], rows


def recompute_padded(batch, settings, kl_state=None, width: int | None = None):
    """:func:`rldiag.engine.pipeline.recompute_batch` with its token outputs back as padded
    ``(rows, width)`` matrices (``width``: the longest row when None), so that row-wise
    assertions (``tokens["advantages"][:, 0]``) keep their meaning."""
    from rldiag.engine.pipeline import recompute_batch

    r = recompute_batch(batch, settings, kl_state)
    r.tokens = {k: to_padded(v, batch.rows, width) for k, v in r.tokens.items()}
    return r
