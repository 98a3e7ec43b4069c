"""Reverse linear recurrences without a loop over token positions.

``x_t = a_t * x_{t+1} + b_t`` with ``x_T = 0``, for ``(rows, tokens)`` tensors, is an
associative scan over the pairs ``(a_t, b_t)``: composing two maps gives
``(a_1 a_2, a_1 b_2 + b_1)``. The Hillis-Steele doubling form (Hillis & Steele 1986; for linear
recurrences, Blelloch 1990, "Prefix sums and their applications") needs ceil(log2 T) passes of
whole-tensor operations, so a GPU runs a handful of kernels instead of one per position, and
zeros in ``a`` (resets) need no special case. GAE's two recursions and REINFORCE++'s
reward-to-go are of this form.
"""

from __future__ import annotations

import torch


def reverse_linear_scan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Solve ``x_t = a_t x_{t+1} + b_t`` (``x_T = 0``) along the last dimension.

    ``a``, ``b``: ``(rows, tokens)``. Returns ``x``: ``(rows, tokens)``.
    """
    A = a.clone()
    B = b.clone()
    T = A.shape[-1]
    off = 1
    while off < T:
        # element t currently maps x_{t+off} -> x_t; compose with the map of element t+off
        B_next = B.clone()
        B_next[..., : T - off] += A[..., : T - off] * B[..., off:]
        A_next = torch.zeros_like(A)
        A_next[..., : T - off] = A[..., : T - off] * A[..., off:]
        A, B = A_next, B_next
        off *= 2
    return B


def reverse_linear_scan_loop(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The same recurrence, one vectorised step per position (the reference; verl's form)."""
    out = torch.empty_like(b)
    x = torch.zeros_like(b[..., 0])
    for t in range(b.shape[-1] - 1, -1, -1):
        x = a[..., t] * x + b[..., t]
        out[..., t] = x
    return out
