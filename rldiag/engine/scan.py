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

import math

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


def reward_to_go_carry_scan(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++'s carrying reward-to-go as one scan: the running return passes mask-0 tokens
    unchanged (their reward is not added), ``x_t = (m_t gamma + 1 - m_t) x_{t+1} + m_t r_t``;
    the return is ``m_t x_t`` (0 at mask 0). ``(rows, tokens)``"""
    m = mask.to(rewards.dtype)
    return reverse_linear_scan(m * gamma + (1.0 - m), m * rewards) * m


def _next_masked_index(mask: torch.Tensor) -> torch.Tensor:
    """For each position t, the first position >= t with mask 1 (``T`` when none). ``(rows, T)``"""
    T = mask.shape[-1]
    dt = torch.int32 if T < 2**30 else torch.int64
    pos = torch.arange(T, device=mask.device, dtype=dt)
    # t where the (0/1) mask is 1, t + T elsewhere: integer arithmetic, no bool pass or `where`
    idx = torch.sub(1, mask.to(dt)).mul_(T).add_(pos)
    return idx.flip(-1).cummin(-1).values.flip(-1).clamp_(max=T).long()


def _gather_or_zero(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[..., index]`` with index ``T`` (none) reading 0: one zero column appended."""
    return torch.nn.functional.pad(x, (0, 1)).gather(-1, index)


def gae_blocked(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float,
                block: int = 128) -> torch.Tensor:
    """verl's mask-skipping GAE with a loop over blocks of positions instead of positions.

    ``NV_{t+1}`` (the value at the first mask-1 position after t) is a gather at the next-masked
    index; the advantage recursion ``A_t = a_t A_{t+1} + b_t`` (``a_t = 1 - m_t (1 - gamma lam)``,
    ``b_t = m_t delta_t``) is solved in closed form inside each block with prefix products in
    float64, ``A_j = (sum_{k>=j} P_k b_k + P_C A_next) / P_j``, and carried across blocks. The
    block length keeps ``(gamma lam)^block`` inside float64's range. Raw advantages ``(rows, T)``.
    """
    rows, T = rewards.shape
    nxt = _next_masked_index(mask)
    nv = _gather_or_zero(values, nxt)
    nv_next = torch.nn.functional.pad(nv[..., 1:], (0, 1))
    delta = rewards + gamma * nv_next - values
    gl = gamma * lam
    if gl == 0.0:  # A_t = delta at the first mask-1 position at or after t
        return _gather_or_zero(delta, nxt) if T else delta
    if gl == 1.0:  # verl's defaults: a_t = 1, A_t is the sum of b over positions >= t
        b = (delta * mask).flip(-1)
        if b.device.type == "cpu":  # the CPU's cumsum accumulates float32 in float64 already
            return torch.cumsum(b, -1).flip(-1)
        return torch.cumsum(b, -1, dtype=torch.float64).flip(-1).to(rewards.dtype)
    C = max(1, min(block, int(600.0 / max(abs(math.log(gl)), 1e-12))))
    nb = -(-T // C)
    pad = nb * C - T
    dt = torch.float64
    m = torch.nn.functional.pad(mask.to(dt), (0, pad))
    b = torch.nn.functional.pad(delta.to(dt), (0, pad)) * m
    # log a_t = log(1 - m_t (1 - gl)) is m_t log(gl) for a 0/1 mask: one multiply, no log pass
    la = m * math.log(gl)
    la, b = la.view(rows, nb, C), b.view(rows, nb, C)
    lp = torch.cumsum(la, -1) - la  # exclusive prefix sums of log a: log P_j
    P = torch.exp(lp)
    P_C = torch.exp(lp[..., -1] + la[..., -1])  # (rows, nb)
    Q = (P * b).flip(-1).cumsum(-1).flip(-1)  # sum_{k>=j} P_k b_k
    first = torch.empty(rows, nb, dtype=dt, device=rewards.device)
    carry = torch.zeros(rows, dtype=dt, device=rewards.device)
    nxt_first = torch.empty_like(first)
    for i in range(nb - 1, -1, -1):
        nxt_first[:, i] = carry
        carry = Q[:, i, 0] + P_C[:, i] * carry
        first[:, i] = carry
    out = (Q + P_C.unsqueeze(-1) * nxt_first.unsqueeze(-1)) / P
    return out.view(rows, nb * C)[:, :T].to(rewards.dtype)


def gae_loop(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """verl's GAE recursion one position at a time, vectorised over rows (the reference form)."""
    r, v, m = rewards.T.contiguous(), values.T.contiguous(), mask.T.contiguous()
    out = torch.empty_like(r)
    nextvalues = torch.zeros(r.shape[1], dtype=r.dtype, device=r.device)
    lastgaelam = torch.zeros(r.shape[1], dtype=r.dtype, device=r.device)
    for t in range(r.shape[0] - 1, -1, -1):
        delta = r[t] + gamma * nextvalues - v[t]
        candidate = delta + gamma * lam * lastgaelam
        nextvalues = v[t] * m[t] + (1 - m[t]) * nextvalues
        lastgaelam = candidate * m[t] + (1 - m[t]) * lastgaelam
        out[t] = lastgaelam
    return out.T
