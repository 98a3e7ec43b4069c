"""The app's line on which steps a run captured (a capture policy's run: some steps, some prompt
groups of each; :mod:`rldiag.scenario.sampling`). Pure text from ``scenario.json``: no torch."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def _spans(steps: Iterable[int]) -> str:
    """``1-3, 5, 10-12``."""
    out: list[str] = []
    run: list[int] = []
    for s in sorted(set(steps)):
        if run and s != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(s)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def capture_note(meta: Mapping[str, Any]) -> str | None:
    """One line on which steps a scenario's run captured (``scenario.json``'s ``steps_done``,
    ``sampled_steps``, ``uncaptured_steps``), for the app; None for a run captured whole."""
    sampled = meta.get("sampled_steps") or {}
    missing = meta.get("uncaptured_steps") or []
    if not sampled and not missing:
        return None
    done = [int(s) for s in meta.get("steps_done") or []]
    text = f"Batches captured for {len(done)} of {len(done) + len(missing)} steps ({_spans(done)})"
    if sampled:
        shares = sorted({float(v) for v in sampled.values()})
        share = f"{shares[0]:.0%}" if len(shares) == 1 else f"{shares[0]:.0%}-{shares[-1]:.0%}"
        text += (f"; {len(sampled)} of them sampled ({share} of their prompt groups): their step metrics are "
                 "estimates from the kept groups")
    if missing:
        text += f". Not captured: {_spans(missing)} (logged metrics only)"
    return text + "."
