"""Hypothesis strategies for random steps with everything a loss or a rollout correction reads:
tool gaps, fully masked rows, singleton and all-equal groups (row-constant advantages repeated),
long rows, a log-ratio beyond the +-20 clamp now and then; and helpers to turn them into the
engine's packed token layout (flat ``(tokens,)`` tensors, :class:`rldiag.engine.layout.Rows`)
and engine outputs back into padded ``(rows, width)`` matrices for the row-wise assertions."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from rldiag.engine.aggregation import AggNorm
from rldiag.engine.batch import Batch
from rldiag.engine.layout import Rows


@st.composite
def loss_step(draw, min_rows=1, max_rows=7, max_len=10, need_token=True):
    rows = draw(st.integers(min_rows, max_rows))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    lengths = [int(x) for x in rng.integers(1, max_len + 1, rows)]
    if draw(st.booleans()):
        lengths[int(rng.integers(0, rows))] = int(rng.integers(25, 45))  # a long row
    mask = []
    for L in lengths:
        m = [1] * L
        if L > 2 and rng.random() < 0.4:  # a tool-observation gap
            a = int(rng.integers(1, L - 1))
            for t in range(a, min(L, a + int(rng.integers(1, 4)))):
                m[t] = 0
        mask.append(m)
    if rows > 1 and draw(st.booleans()):
        i = int(rng.integers(0, rows))
        mask[i] = [0] * lengths[i]  # a fully masked row
    if need_token and sum(map(sum, mask)) == 0:
        mask[-1] = [1] * lengths[-1]
    old = [list(np.minimum(-np.abs(rng.normal(1.0, 0.6, L)), -0.05)) for L in lengths]
    new = [list(np.minimum(np.array(o) + rng.normal(0, 0.3, len(o)), -0.05)) for o in old]
    if rng.random() < 0.2:  # one log-ratio past the +-20 clamp
        i = int(rng.integers(0, rows))
        old[i][0] = -30.0
    rollout = [list(np.minimum(np.array(o) + rng.normal(0, 0.15, len(o)), -0.01)) for o in old]
    # row-level advantages: groups of equal values (all-equal groups), zeros, singletons
    n_groups = int(rng.integers(1, rows + 1))
    group_adv = rng.normal(0, 1.0, n_groups)
    group_adv[rng.random(n_groups) < 0.2] = 0.0
    gid = rng.integers(0, n_groups, rows)
    adv = []
    for L, g, m in zip(lengths, gid, mask):
        a = np.full(L, group_adv[g])
        if rng.random() < 0.3:
            a = a + rng.normal(0, 0.5, L)  # token-level advantages (GAE-like)
        adv.append(list(a * np.array(m)))
    weights = [list(rng.uniform(0.2, 2.5, L) * np.array(m)) for L, m in zip(lengths, mask)]

    def f32(rows):  # the engine sees float32 inputs; give the references the same numbers
        return [[float(x) for x in np.asarray(r, dtype=np.float32)] for r in rows]

    return dict(lengths=lengths, mask=mask, old=f32(old), new=f32(new), rollout=f32(rollout), adv=f32(adv),
                weights=f32(weights))


def pad(lists, width=None):
    rows = len(lists)
    W = width or max(len(x) for x in lists)
    t = torch.zeros(rows, W)
    for i, x in enumerate(lists):
        t[i, : len(x)] = torch.tensor(x, dtype=torch.float32)
    return t


def flat(lists):
    """Rows of values, one after the other: a flat ``(tokens,)`` float32 tensor."""
    return torch.tensor([float(v) for x in lists for v in x], dtype=torch.float32)


def packed(steps, key):
    """``key`` of several steps in the packed layout ``(tokens,)`` (rows in step order)."""
    return flat([x for d in steps for x in d[key]])


def layout(steps) -> Rows:
    """The row layout of :func:`packed` tensors of ``steps``."""
    return Rows.from_lengths(torch.tensor([L for d in steps for L in d["lengths"]], dtype=torch.long))


def padded(t, steps, width=None):
    """A packed engine output of ``steps`` back as a right-padded ``(rows, width)`` matrix."""
    return layout(steps).pad(t, width)


def step_ids(steps):
    return torch.tensor([i for i, d in enumerate(steps) for _ in d["lengths"]], dtype=torch.long)


def unpad(t, lengths):
    return [t[i, :L].tolist() for i, L in enumerate(lengths)]


def batch_of(steps, **extra) -> Batch:
    """A Batch of the steps (one packed step each), uid = row (singleton groups)."""
    lengths = [L for d in steps for L in d["lengths"]]
    sid = step_ids(steps)
    return Batch(
        response_mask=packed(steps, "mask"),
        token_level_scores=torch.zeros_like(packed(steps, "mask")),
        lengths=torch.tensor(lengths, dtype=torch.long),
        step_ids=sid,
        group_ids=torch.arange(len(lengths)),
        steps=list(range(1, len(steps) + 1)),
        n_groups=len(lengths),
        max_response_length=torch.tensor([max(d["lengths"]) for d in steps]),
        old_log_probs=packed(steps, "old"),
        log_probs=packed(steps, "new"),
        rollout_log_probs=packed(steps, "rollout"),
        **extra,
    )


def step_norm(steps, sid, *, given_tokens=None, given_rows=True, scale=None) -> AggNorm:
    """Per-step normalisers: ``batch_num_tokens`` = masked tokens + ``given_tokens`` extra (a
    loss_mask larger than the mask), ``global_batch_size`` = rows (or None), horizon = longest row."""
    counts = [float(sum(map(sum, d["mask"]))) for d in steps]
    return AggNorm(
        seg_ids=sid,
        n_seg=len(steps),
        horizon=torch.tensor([max(d["lengths"]) for d in steps]),
        rows=layout(steps),
        batch_num_tokens=None if given_tokens is None else torch.tensor([c + given_tokens for c in counts]),
        global_batch_size=torch.tensor([float(len(d["lengths"])) for d in steps]) if given_rows else None,
        loss_scale_factor=scale,
    )
