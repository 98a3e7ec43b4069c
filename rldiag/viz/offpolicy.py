"""The off-policy page's panels: ``rollout_corr/*`` metric names sorted by what they measure
(verl's rollout-correction names)."""

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


def panels(names: Iterable[str]) -> dict[str, list[str]]:
    """Panel title -> the ``rollout_corr/*`` names in it (panels without names left out)."""
    out: dict[str, list[str]] = {title: [] for title, _ in PANELS}
    out[OTHER] = []
    for n in sorted(set(names)):
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


def baseline_first(scenarios: list[str]) -> list[str]:
    """``baseline`` (when present) first, the others in their order."""
    return sorted(scenarios, key=lambda s: s != "baseline")
