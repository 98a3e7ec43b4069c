"""The off-policy page's panels: ``rollout_corr/*`` metric names sorted by what they measure
(verl's rollout-correction names), and the mismatch fingerprints (``rldiag/mismatch/*``, every
recompute's) over training."""

from __future__ import annotations

from collections.abc import Iterable

PREFIX = "rollout_corr/"

#: panel title -> test on the name after the prefix; first match wins, in this order
PANELS: tuple[tuple[str, str], ...] = (
    ("Effective sample size", "eff_sample_size"),
    ("Rejection fractions", "rollout_rs"),
    ("IS weights", "rollout_is"),
    ("Chi-squared", "chi2"),
    ("Rollout vs train KL", "kl"),
    ("PPL gap", "ppl"),
)
OTHER = "Other rollout_corr metrics"
MISMATCH_PREFIX = "rldiag/mismatch/"
MISMATCH = "Mismatch fingerprints"
#: the fingerprints charted over training, in this order (rldiag.engine.mismatch; docs/mismatch.md)
MISMATCH_PANEL = tuple(MISMATCH_PREFIX + n for n in (
    "gap_mean", "gap_std", "gap_abs_p99", "gap_abs_max", "kl_k2", "top_kl_share", "positive_share", "slope",
    "gap_rollout_corr", "gap_position_corr", "lag_gap_corr", "lag_abs_gap_lagged",
))


def panels(names: Iterable[str]) -> dict[str, list[str]]:
    """Panel title -> the ``rollout_corr/*`` names in it, then :data:`MISMATCH` -> the
    :data:`MISMATCH_PANEL` names among ``names`` (panels without names left out)."""
    names = set(names)
    out: dict[str, list[str]] = {title: [] for title, _ in PANELS}
    out[OTHER] = []
    out[MISMATCH] = [n for n in MISMATCH_PANEL if n in names]
    for n in sorted(names):
        if not n.startswith(PREFIX):
            continue
        rest = n[len(PREFIX):]
        for title, key in PANELS:
            if key in rest:
                out[title].append(n)
                break
        else:
            out[OTHER].append(n)
    return {k: v for k, v in out.items() if v}


def has_rollout_corr(groups: dict[str, list[str]]) -> bool:
    """Whether :func:`panels` found any ``rollout_corr/*`` metric."""
    return any(n.startswith(PREFIX) for names in groups.values() for n in names)


def baseline_first(scenarios: list[str]) -> list[str]:
    """``baseline`` (when present) first, the others in their order."""
    return sorted(scenarios, key=lambda s: s != "baseline")
