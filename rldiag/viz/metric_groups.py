"""Metric names grouped by prefix (``actor/``, ``critic/``, ``rollout_corr/`` ...) and searched."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

NO_PREFIX = "(no prefix)"

#: shown first when a run has them, in this order
DEFAULT_METRICS = (
    "critic/score/mean",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/pg_loss",
    "critic/advantages/mean",
    "response_length/mean",
)


def prefix(name: str) -> str:
    """``actor/pg_loss`` -> ``actor/``; a name without ``/`` has no prefix."""
    head, sep, _ = name.partition("/")
    return head + "/" if sep else NO_PREFIX


def group_by_prefix(names: Iterable[str]) -> dict[str, list[str]]:
    """Prefix -> sorted names; prefixes sorted, the unprefixed group last."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(prefix(n), []).append(n)
    keys = sorted(k for k in groups if k != NO_PREFIX) + ([NO_PREFIX] if NO_PREFIX in groups else [])
    return {k: sorted(groups[k]) for k in keys}


def search(names: Iterable[str], query: str) -> list[str]:
    """Names matching every whitespace-separated term of ``query`` (case-insensitive); a term with
    ``*`` or ``?`` is a glob over the whole name, any other term a substring."""
    terms = [t.lower() for t in query.split()]
    out = []
    for n in names:
        low = n.lower()
        if all(fnmatch.fnmatchcase(low, t) if any(c in t for c in "*?[") else t in low for t in terms):
            out.append(n)
    return out


def filter_names(names: Iterable[str], query: str = "", groups: Iterable[str] = ()) -> list[str]:
    """Names in any of ``groups`` (all when empty) that match ``query``."""
    groups = set(groups)
    kept = [n for n in names if not groups or prefix(n) in groups]
    return search(kept, query) if query.strip() else kept


def default_selection(names: list[str], limit: int = 4) -> list[str]:
    """The metrics a page opens with: the usual ones the run has, else its first names."""
    have = set(names)
    chosen = [m for m in DEFAULT_METRICS if m in have][:limit]
    return chosen or names[:limit]


def follow_range(chosen: tuple[int, int], old_max: int | None, bounds: tuple[int, int]) -> tuple[int, int]:
    """A step range kept across growth of the run: one that reached the last step keeps reaching
    it; any range is clipped to the steps that exist, and one with no step left becomes all."""
    lo, hi = chosen
    if old_max is not None and hi == old_max:
        hi = bounds[1]
    if lo > bounds[1] or hi < bounds[0]:  # nothing of it is left (the file was rewritten)
        return bounds[0], bounds[1]
    return max(lo, bounds[0]), min(hi, bounds[1])
