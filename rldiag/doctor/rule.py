"""One doctor health rule (:class:`Rule`) and when it applies to a run's settings.

The rule kinds (:mod:`.evaluators`) and the rules files (:mod:`.rules`) both build on it; it
imports neither.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Rule:
    """One health rule. ``params`` holds the kind's own parameters."""

    id: str
    kind: str
    title: str
    why: str
    severity: str = "warning"
    metric: str | None = None
    source: str = "any"
    when: dict[str, Any] = field(default_factory=dict)
    window: int | None = None
    min_steps: int = 1
    # the run's first ``warmup`` steps are never read (a critic's first updates, say): the
    # window and ``min_steps`` count the steps after them (rldiag.doctor.evaluate.after_warmup)
    warmup: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    origin: str = ""  # the file that defined (or last overrode) it
    # the settings that address it (rules.yaml's ``addresses``, checked and completed by
    # :mod:`.rules`): {"settings": [{key: value}, ...], "metrics": [...], "statistic": "mean"}; {}: none
    addresses: dict[str, Any] = field(default_factory=dict)

    def applies(self, settings: Mapping[str, Any]) -> bool:
        """Whether every ``when`` condition holds: the setting equals the value, or is one of a list."""
        for key, want in self.when.items():
            have = settings.get(key)
            options = want if isinstance(want, list) else [want]
            if not any(same_value(have, w) for w in options):
                return False
        return True


def same_value(a: Any, b: Any) -> bool:
    """A setting's value equals another as a rule compares them: a bool only a bool, numbers by value."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (isinstance(a, bool) and isinstance(b, bool) and a == b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b
