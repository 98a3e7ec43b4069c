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


def use_scan(t: torch.Tensor) -> bool:
    """The associative scan on accelerators (a few big kernels beat T small ones); the
    per-position loop on the CPU, where it does less arithmetic and is faster."""
    return t.device.type != "cpu"


def gae_scan(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """verl's mask-skipping GAE as two reverse linear scans; raw advantages ``(rows, tokens)``.

    ``nextvalues`` after position t is the value at the first mask-1 position at or after t:
    ``NV_t = m_t v_t + (1 - m_t) NV_{t+1}``. With ``delta_t = r_t + gamma NV_{t+1} - v_t`` the
    running advantage is ``A_t = (1 - m_t (1 - gamma lam)) A_{t+1} + m_t delta_t``.
    """
    nv = reverse_linear_scan(1 - mask, mask * values)
    nv_next = torch.nn.functional.pad(nv[..., 1:], (0, 1))
    delta = rewards + gamma * nv_next - values
    return reverse_linear_scan(1 - mask * (1 - gamma * lam), mask * delta)


def reward_to_go_scan(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++'s resetting reward-to-go as one scan. The running return is zeroed *after*
    writing position t+1 when ``m_{t+1} = 0``, so ``G_t = r_t + gamma m_{t+1} G_{t+1}``
    (nothing past the end). ``(rows, tokens)``"""
    m_next = torch.nn.functional.pad(mask[..., 1:], (0, 1))
    return reverse_linear_scan(gamma * m_next, rewards)
