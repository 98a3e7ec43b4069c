"""Per-token agreement of two advantage vectors of one step (``rldiag compare``).

Inputs are flat (row-major, unpadded) arrays over the step's tokens. Statistics over tokens are
taken where both sides' ``response_mask`` is 1 (the tokens that carry loss in both); the
effective-weight change over tokens where either mask is 1. A value with ``|x| <= ZERO_EPS``
counts as zero (no sign, no signal): GRPO and RLOO give exact zeros to groups without signal,
and float noise below this is not a learning signal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

from rldiag.io.arrays import rows_frame

if TYPE_CHECKING:
    import polars as pl

ZERO_EPS = 1e-6


def signs(x: np.ndarray, eps: float = ZERO_EPS) -> np.ndarray:
    """-1, 0 or 1 per value, with ``|x| <= eps`` as 0."""
    return np.where(np.abs(x) <= eps, 0, np.sign(x)).astype(np.int8)


def average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing their average rank (as Spearman's rho needs)."""
    x = np.asarray(x, dtype=np.float64)
    n = x.size
    if n == 0:
        return np.zeros(0)
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    starts = np.flatnonzero(np.concatenate([[True], sorted_x[1:] != sorted_x[:-1]]))
    ends = np.concatenate([starts[1:], [n]])  # exclusive
    avg = (starts + ends + 1) / 2.0  # mean of 1-based positions start+1..end
    ranks = np.empty(n)
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation; NaN with fewer than 2 values or when either side is constant."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.size < 2:
        return math.nan
    da, db = a - a.mean(), b - b.mean()
    denom = math.sqrt(_dot(da, da) * _dot(db, db))
    if denom == 0.0:
        return math.nan
    return _dot(da, db) / denom


def _dot(x: np.ndarray, y: np.ndarray) -> float:
    """``sum x y`` in one pass of numpy's own loop (``np.dot`` goes to the BLAS, whose threads
    cost several times the sum on a busy machine)."""
    return float(np.einsum("i,i->", x, y))


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (Pearson over average ranks)."""
    return pearson(average_ranks(a), average_ranks(b))


@dataclass
class TokenAgreement:
    """One step's per-token agreement of advantages A (side ``a``) and B (side ``b``)."""

    step: int
    n_tokens: int  # tokens with both masks 1
    sign_agreement: float  # share of those tokens with the same sign (zero counts as a sign)
    sign_flip_fraction: float  # share with strictly opposite signs
    pearson: float
    spearman: float
    adv_mean_abs_change: float  # mean |B - A| over those tokens
    weight_mean_abs_change: float  # mean |W_B - W_A| of the effective per-token weight, either mask 1
    groups: int
    groups_signal_a: int  # groups with a nonzero advantage in A
    groups_signal_b: int
    groups_signal_only_a: int  # signal in A, none in B
    groups_signal_only_b: int
    weight_tokens: int = 0  # tokens with either mask 1 (behind weight_mean_abs_change)


def agreement_frame(tokens: Sequence[TokenAgreement]) -> pl.DataFrame:
    """One row per step's :class:`TokenAgreement`, its fields as columns."""
    return rows_frame([asdict(t) for t in tokens], [f.name for f in fields(TokenAgreement)])


def group_signal(adv: np.ndarray, mask: np.ndarray, token_group: np.ndarray, n_groups: int) -> np.ndarray:
    """Per group: does any masked token carry a nonzero advantage?"""
    live = (mask > 0) & (np.abs(adv) > ZERO_EPS)
    return np.bincount(token_group[live], minlength=n_groups)[:n_groups] > 0


def token_agreement(
    step: int,
    adv_a: np.ndarray,
    adv_b: np.ndarray,
    mask_a: np.ndarray,
    mask_b: np.ndarray,
    weight_a: np.ndarray,
    weight_b: np.ndarray,
    token_group: np.ndarray,
    n_groups: int,
) -> tuple[TokenAgreement, np.ndarray, np.ndarray]:
    """Agreement of two advantage vectors over one step's tokens, and each side's per-group
    signal (bool ``(n_groups,)``).

    ``weight_*`` are the effective per-token weights (advantage x aggregation weight x IS
    weight, 0 where masked); ``token_group`` the group index of each token's row.
    """
    both = (mask_a > 0) & (mask_b > 0)
    a, b = adv_a[both].astype(np.float64), adv_b[both].astype(np.float64)
    n = int(both.sum())
    sa, sb = signs(a), signs(b)
    either = (mask_a > 0) | (mask_b > 0)
    sig_a = group_signal(adv_a, mask_a, token_group, n_groups)
    sig_b = group_signal(adv_b, mask_b, token_group, n_groups)
    agreement = TokenAgreement(
        step=step,
        n_tokens=n,
        sign_agreement=float(np.mean(sa == sb)) if n else math.nan,
        sign_flip_fraction=float(np.mean(sa.astype(np.int16) * sb < 0)) if n else math.nan,
        pearson=pearson(a, b),
        spearman=spearman(a, b),
        adv_mean_abs_change=float(np.mean(np.abs(b - a))) if n else math.nan,
        weight_mean_abs_change=float(np.mean(np.abs(weight_b[either] - weight_a[either]))) if either.any() else math.nan,
        groups=int(n_groups),
        groups_signal_a=int(sig_a.sum()),
        groups_signal_b=int(sig_b.sum()),
        groups_signal_only_a=int((sig_a & ~sig_b).sum()),
        groups_signal_only_b=int((sig_b & ~sig_a).sum()),
        weight_tokens=int(either.sum()),
    )
    return agreement, sig_a, sig_b
