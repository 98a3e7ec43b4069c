"""Reverse linear recurrences over packed rows, without a loop over token positions.

``x_t = a_t * x_{t+1} + b_t`` with ``x = 0`` past the end, over flat ``(tokens,)`` tensors of
the packed layout (:mod:`rldiag.engine.layout`). GAE's two recursions, REINFORCE++'s
reward-to-go and the agentic estimators' cross-step GAE are of this form; so are the reverse
and forward cumulative sums of a row.

Rows are packed one after the other (rldiag.engine.layout.Rows). A recursion restarts at a row
boundary because its coefficient is 0 at the row's last token: nothing flows from the next row.
The flat array is cut into chunks of ``block`` tokens (the only padding: fewer than ``block``
zeros at the end, whatever the longest row); each chunk is solved locally, one vectorised step
per position inside a chunk over every chunk at once, and the chunks' first values are a
recurrence of the same form, ``block`` times shorter, solved the same way (Blelloch 1990,
"Prefix sums and their applications", section 1.4: first-order recurrences by blocks).
"""

from __future__ import annotations

import torch


def segmented_reverse_linear_scan(a: torch.Tensor, b: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Solve ``x_t = a_t x_{t+1} + b_t`` (``x_n = 0``) over flat ``(tokens,)`` tensors.

    ``a_t = 0`` restarts the recursion (callers zero ``a`` at each row's last token). Computed
    in float64, returned in ``b``'s dtype. Work in proportion to the tokens; ``2 * block`` small
    vectorised steps per level and ``log_block(tokens)`` levels.
    """
    out_dtype = b.dtype
    n = int(b.numel())
    if n == 0:
        return b.clone()
    A = a.to(torch.float64)
    B = b.to(torch.float64)
    return _blocked_scan(A, B, max(2, block)).to(out_dtype)


def _blocked_scan(A: torch.Tensor, B: torch.Tensor, C: int) -> torch.Tensor:
    n = int(B.numel())
    if n <= SMALL:  # a short recurrence: ceil(log2 n) whole-array doubling passes
        return _doubling_scan(A, B)
    nb = -(-n // C)
    pad = nb * C - n
    # (C, nb): position inside the chunk first, so each step reads one contiguous row
    Ac = torch.nn.functional.pad(A, (0, pad)).view(nb, C).T.contiguous()
    Bc = torch.nn.functional.pad(B, (0, pad)).view(nb, C).T.contiguous()
    loc = torch.empty_like(Bc)  # the chunk's own solution, nothing entering from the next chunk
    prod = torch.empty_like(Ac)  # a_t ... a_{C-1}: how the next chunk's first value enters
    loc[C - 1] = Bc[C - 1]
    prod[C - 1] = Ac[C - 1]
    for j in range(C - 2, -1, -1):  # each step written in place into its row of loc and prod
        torch.addcmul(Bc[j], Ac[j], loc[j + 1], out=loc[j])
        torch.mul(Ac[j], prod[j + 1], out=prod[j])
    # the chunks' first values: X_i = loc_0(i) + prod_0(i) X_{i+1}, the same recurrence
    first = _blocked_scan(prod[0].contiguous(), loc[0].contiguous(), C)
    nxt = torch.nn.functional.pad(first[1:], (0, 1))
    full = torch.addcmul(loc, prod, nxt.unsqueeze(0))
    return full.T.reshape(-1)[:n]


#: recurrences up to this length are solved by doubling (a few whole-array passes) rather than
#: by chunks (``block`` steps per level): fewer, larger operations for small inputs
SMALL = 4096


def _doubling_scan(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``x_t = A_t x_{t+1} + B_t`` by recursive doubling (Hillis & Steele 1986): after the pass
    with offset ``d``, element t maps ``x_{t+2d}`` to ``x_t``; composing two maps gives
    ``(A_1 A_2, A_1 B_2 + B_1)``."""
    A, B = A.clone(), B.clone()
    n = int(B.numel())
    d = 1
    while d < n:
        B[: n - d] = torch.addcmul(B[: n - d], A[: n - d], B[d:])
        A_next = torch.zeros_like(A)
        A_next[: n - d] = A[: n - d] * A[d:]
        A = A_next
        d *= 2
    return B


def _not_last(last: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (~last).to(dtype)


def _next_in_row(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``x_{t+1}`` inside the row, 0 at each row's last token ``(tokens,)``."""
    return torch.nn.functional.pad(x[1:], (0, 1)) * keep


def gae_segmented(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, last: torch.Tensor,
                  gamma: float, lam: float) -> torch.Tensor:
    """verl's mask-skipping GAE over packed rows; raw advantages ``(tokens,)``.

    ``last`` ``(tokens,)`` bool marks each row's last token. ``NV_t = m_t v_t + (1 - m_t) NV_{t+1}``
    (the value at the first mask-1 position at or after t in the row, 0 past its end) and
    ``A_t = (1 - m_t (1 - gamma lam)) A_{t+1} + m_t delta_t`` with
    ``delta_t = r_t + gamma NV_{t+1} - v_t`` (Schulman et al. 2016, arXiv:1506.02438; verl's
    ``compute_gae_advantage_return`` keeps both running values at mask-0 positions).
    """
    keep = _not_last(last, torch.float64)
    m = mask.to(torch.float64)
    v = values.to(torch.float64)
    nv = segmented_reverse_linear_scan((1.0 - m) * keep, m * v)
    delta = rewards.to(torch.float64) + gamma * _next_in_row(nv, keep) - v
    adv = segmented_reverse_linear_scan((1.0 - m * (1.0 - gamma * lam)) * keep, m * delta)
    return adv.to(rewards.dtype)


def reward_to_go_segmented(rewards: torch.Tensor, mask: torch.Tensor, last: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++'s resetting reward-to-go over packed rows ``(tokens,)``:
    ``G_t = r_t + gamma m_{t+1} G_{t+1}`` inside the row (the running return is zeroed after a
    mask-0 token; Hu 2025, arXiv:2501.03262)."""
    keep = _not_last(last, torch.float64)
    a = gamma * _next_in_row(mask.to(torch.float64), keep)
    return segmented_reverse_linear_scan(a, rewards)


def reward_to_go_carry_segmented(rewards: torch.Tensor, mask: torch.Tensor, last: torch.Tensor,
                                 gamma: float) -> torch.Tensor:
    """REINFORCE++'s carrying reward-to-go over packed rows ``(tokens,)`` (verl commit 8a1bf6d5b):
    a mask-0 token neither adds its reward nor resets, the running return passes it unchanged,
    ``x_t = (m_t gamma + 1 - m_t) x_{t+1} + m_t r_t`` inside the row; the return is ``m_t x_t``
    (0 at mask 0)."""
    keep = _not_last(last, torch.float64)
    m = mask.to(torch.float64)
    x = segmented_reverse_linear_scan((m * gamma + (1.0 - m)) * keep, m * rewards.to(torch.float64))
    return (x * m).to(rewards.dtype)


def reverse_cumsum_segmented(x: torch.Tensor, rows) -> torch.Tensor:
    """Sum of ``x`` from each token to the end of its row ``(tokens,)`` (``rows``: the
    :class:`rldiag.engine.layout.Rows` layout), accumulated in float64."""
    c = torch.nn.functional.pad(x.to(torch.float64).flip(0).cumsum(0).flip(0), (0, 1))
    end = rows.offsets[1:].index_select(0, rows.row_ids)
    return (c[:-1] - c.index_select(0, end)).to(x.dtype)


def cumsum_segmented(x: torch.Tensor, rows) -> torch.Tensor:
    """Sum of ``x`` from the start of each token's row to the token ``(tokens,)``, in float64."""
    c = torch.nn.functional.pad(x.to(torch.float64).cumsum(0), (1, 0))
    start = rows.offsets[:-1].index_select(0, rows.row_ids)
    return (c[1:] - c.index_select(0, start)).to(x.dtype)
