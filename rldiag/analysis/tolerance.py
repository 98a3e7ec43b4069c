"""Tolerances of ``rldiag verify`` and the element-wise comparison they drive.

A value ``actual`` (recomputed) matches ``expected`` (logged) when
``|actual - expected| <= atol + rtol * |expected|`` (numpy's ``isclose`` rule), or both are the
same non-finite value (two NaNs, or equal infinities). Ids and masks compare exactly.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import numpy as np

from rldiag.errors import ConfigError

#: Fields compared exactly whatever the tolerances say.
EXACT_FIELDS = ("response_mask",)


@dataclass(frozen=True)
class Tol:
    rtol: float
    atol: float

    def __post_init__(self):
        for name in ("rtol", "atol"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and np.isfinite(v)):
                raise ConfigError(f"tolerance {name} must be a finite number >= 0, got {v!r}")


#: fp32 defaults. Tokens: tight enough that a wrong reduction (another estimator, a missing std
#: normalisation, whitening over the wrong set) fails by orders of magnitude. Metrics are sums
#: over a whole step, whose float32 summation order differs between verl and rldiag; 1e-4
#: relative still catches every wrong aggregation mode or clip setting.
FP32_TOKENS = Tol(rtol=1e-5, atol=1e-6)
FP32_METRICS = Tol(rtol=1e-4, atol=1e-5)
#: A preset for runs whose logged values went through bfloat16 (8 bits of mantissa).
BF16_TOKENS = Tol(rtol=1e-2, atol=1e-3)
BF16_METRICS = Tol(rtol=2e-2, atol=1e-3)

#: Metrics verl computes with a one-pass float32 variance, ``E[x^2] - E[x]^2``
#: (``verl/trainer/ppo/rollout_corr_helper.py``'s ``*_std`` of IS weights and rejection
#: statistics), where rldiag computes the spread itself in two passes. Where the true spread is
#: below about 3e-4 of the values' size (a single row under sequence-level IS; weights all near
#: 1), verl's number is rounding noise of size ``sqrt(k * eps32) * |x|`` (``eps32`` = 1.2e-7, ``k`` a
#: few roundings): about 1e-3 for IS weights clamped at 2-5. The tolerance covers that noise and
#: nothing larger: a wrong IS level or threshold moves these spreads by 1e-2 or more. A user's
#: ``--tol`` for the same name still wins.
ROUNDING_NOISE: dict[str, Tol] = {
    "*rollout_corr/*_std": Tol(rtol=1e-4, atol=5e-3),
}


@dataclass(frozen=True)
class Tolerances:
    """Per-quantity tolerances: token columns, metrics, and per-field overrides.

    ``fields`` maps a field name or a shell pattern (``actor/*``) to a :class:`Tol`; the first
    pattern that matches, in insertion order, wins over the kind's default (exact names first).
    """

    tokens: Tol = FP32_TOKENS
    metrics: Tol = FP32_METRICS
    fields: dict[str, Tol] = field(default_factory=dict)

    @classmethod
    def bf16(cls, fields: dict[str, Tol] | None = None) -> Tolerances:
        return cls(tokens=BF16_TOKENS, metrics=BF16_METRICS, fields=dict(fields or {}))

    def for_field(self, name: str, kind: str) -> Tol:
        """The tolerance of ``name``; ``kind`` is ``token`` or ``metric``."""
        if name in EXACT_FIELDS:
            return Tol(0.0, 0.0)
        if name in self.fields:
            return self.fields[name]
        for pattern, tol in self.fields.items():
            if fnmatch.fnmatchcase(name, pattern):
                return tol
        if kind == "metric":
            for pattern, tol in ROUNDING_NOISE.items():
                if fnmatch.fnmatchcase(name, pattern):
                    default = self.metrics
                    return Tol(max(tol.rtol, default.rtol), max(tol.atol, default.atol))
        return self.tokens if kind == "token" else self.metrics

    def to_dict(self) -> dict:
        return {
            "tokens": vars(self.tokens),
            "metrics": vars(self.metrics),
            "fields": {k: vars(v) for k, v in self.fields.items()},
        }


def parse_field_tolerance(text: str) -> tuple[str, Tol]:
    """``FIELD=RTOL`` or ``FIELD=RTOL,ATOL`` (FIELD may be a pattern such as ``actor/*``)."""
    if "=" not in text:
        raise ConfigError(f"--tol {text!r}: expected FIELD=RTOL or FIELD=RTOL,ATOL")
    name, spec = text.rsplit("=", 1)
    parts = [p.strip() for p in spec.split(",")]
    try:
        nums = [float(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--tol {text!r}: RTOL and ATOL must be numbers") from None
    if not name.strip() or len(nums) not in (1, 2):
        raise ConfigError(f"--tol {text!r}: expected FIELD=RTOL or FIELD=RTOL,ATOL")
    return name.strip(), Tol(rtol=nums[0], atol=nums[1] if len(nums) == 2 else 0.0)


@dataclass
class Diff:
    """The element-wise comparison of two flat arrays."""

    bad: np.ndarray  # bool, True where the values do not match
    abs_err: np.ndarray  # |actual - expected| (NaN where either is NaN)
    rel_err: np.ndarray  # abs_err / |expected| (NaN where expected is 0 or non-finite)


def diff(expected: np.ndarray, actual: np.ndarray, tol: Tol) -> Diff:
    e = np.asarray(expected, dtype=np.float64)
    a = np.asarray(actual, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        abs_err = np.abs(a - e)
        same = (a == e) | (np.isnan(a) & np.isnan(e))
        close = abs_err <= tol.atol + tol.rtol * np.abs(e)
        denom = np.abs(e)
        rel = np.where((denom > 0) & np.isfinite(denom), abs_err / np.where(denom > 0, denom, 1.0), np.nan)
    return Diff(bad=~(same | close), abs_err=abs_err, rel_err=rel)


#: how verify names a difference on a whitened exact tie (:func:`whitened_constant_noise`)
WHITENED_CONSTANT = "rounding noise of a whitened constant"


def whitened_constant_noise(expected: np.ndarray, actual: np.ndarray, on: np.ndarray, rows: np.ndarray,
                            segments: np.ndarray) -> np.ndarray:
    """Positions where ``expected`` and ``actual`` are each the whitening of an exactly tied segment.

    Whitening ``(x - mean) / (std + eps)`` (GRPO) or ``(x - mean) * rsqrt(var + eps)`` (verl's
    ``masked_whiten``) of n equal values is, in float32, ``-d / (|d| sqrt(n / (n - 1)) + eps)``
    with ``d`` the rounding error of the float32 mean (a few ulps, set by the summation order):
    one value over the whole segment, of magnitude below 1, where the exact answer is 0 (verl
    0.9.1's GRPO gives -0.0074 on 16 x 0.1, rldiag -0.0147). Such a pair is recognised by what
    it is: over the positions of a segment (the uid group or the step the estimator whitens
    over) where ``on`` holds, on 2 rows or more, the expected values are one constant, the actual
    ones another, both of magnitude below 1.

    All arguments are flat ``(k,)`` over the compared positions: the two sides, ``on`` (bool: the
    whitened positions, response_mask 1), each position's row and its segment id (int).
    Returns ``(k,)`` bool (False outside ``on``).
    """
    out = np.zeros(expected.shape, dtype=bool)
    idx = np.flatnonzero(on)
    if idx.size == 0:
        return out
    _, seg = np.unique(segments[idx], return_inverse=True)
    k = int(seg.max()) + 1
    e, a = expected[idx], actual[idx]
    same = np.ones(k, dtype=bool)
    for x in (e, a):
        lo, hi = np.full(k, np.inf), np.full(k, -np.inf)
        np.minimum.at(lo, seg, x)
        np.maximum.at(hi, seg, x)
        same &= (lo == hi) & (np.abs(hi) < 1)
    _, first_of_row = np.unique(np.stack([seg, rows[idx]]), axis=1, return_index=True)
    n_rows = np.bincount(seg[first_of_row], minlength=k)
    out[idx] = (same & (n_rows >= 2))[seg]
    return out
