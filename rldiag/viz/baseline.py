"""The app's background baseline (:mod:`rldiag.app.worker`): which steps each of its recomputes
covers, and what the pages say about it.

A run of a few hundred steps is recomputed in one go (``steps`` None: every step, the unchanged
ones reused). A larger one (more than :data:`LARGE_STEPS` steps, or more than
:data:`LARGE_BYTES` of batch files) goes from its latest steps backwards, a chunk at a time:
each recompute covers the steps done so far plus the next chunk (a ``--steps`` spec), so the
baseline scenario holds more steps after each one and the pages fill in from the end of
training. The chunks grow: the first holds at most :data:`FIRST_CHUNK_STEPS` steps and about
:data:`FIRST_CHUNK_BYTES`, each next one twice that, up to :data:`CHUNK_STEPS` steps and about
:data:`CHUNK_BYTES`; so the pages have the latest steps within seconds, and the later chunks pay
a recompute's fixed cost (its settings, the reuse check, the scenario's metrics rewritten) over
many steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: a run with more steps than this is recomputed in chunks, from its latest steps backwards
LARGE_STEPS = 200
#: ... and so is one whose batch files hold more bytes than this (about 15 s of recompute on 2 cores)
LARGE_BYTES = 512 * 2**20
#: the steps of one chunk at most
CHUNK_STEPS = 50
#: about the bytes of batch files of one chunk (a chunk has at least one step)
CHUNK_BYTES = 512 * 2**20
#: the first chunk's limits, doubled for each next chunk up to the two above
FIRST_CHUNK_STEPS = 2
FIRST_CHUNK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class BaselinePlan:
    """The chunks of steps still to compute, latest first (one empty chunk: a single recompute
    of every step)."""

    large: bool
    steps: tuple[int, ...]  # every step with a batch file, in order
    done: tuple[int, ...]  # steps the baseline already has (reused unless their file changed)
    chunks: tuple[tuple[int, ...], ...]
    total_bytes: int

    @property
    def chunk_size(self) -> int:
        return max((len(c) for c in self.chunks), default=0)


def plan_baseline(sizes: Sequence[tuple[int, int]], done: Iterable[int] = (), *, large_steps: int | None = None,
                  large_bytes: int | None = None, chunk_steps: int | None = None,
                  chunk_bytes: int | None = None, first_steps: int | None = None,
                  first_bytes: int | None = None) -> BaselinePlan:
    """The plan for the steps ``sizes`` (``(step, bytes of its batch file)``) when the baseline
    already has the steps ``done``; the thresholds default to the module's constants (read at
    each call)."""
    large_steps = LARGE_STEPS if large_steps is None else large_steps
    large_bytes = LARGE_BYTES if large_bytes is None else large_bytes
    chunk_steps = max(1, CHUNK_STEPS if chunk_steps is None else chunk_steps)
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    first_steps = max(1, FIRST_CHUNK_STEPS if first_steps is None else first_steps)
    first_bytes = FIRST_CHUNK_BYTES if first_bytes is None else first_bytes
    steps = tuple(sorted(s for s, _ in sizes))
    size_of = dict(sizes)
    total = sum(size_of.values())
    have = tuple(s for s in steps if s in set(done))
    large = len(steps) > large_steps or total > large_bytes
    if not large:
        return BaselinePlan(False, steps, have, ((),), total)
    pending = [s for s in reversed(steps) if s not in set(have)]
    chunks: list[tuple[int, ...]] = []
    chunk: list[int] = []
    used = 0
    def limits(k: int) -> tuple[int, int]:  # the k-th chunk's (steps, bytes), from 0
        grow = 2 ** min(k, 62)
        return min(chunk_steps, first_steps * grow), min(chunk_bytes, first_bytes * grow)

    max_steps, max_bytes = limits(0)
    for s in pending:
        if chunk and (len(chunk) >= max_steps or used + size_of[s] > max_bytes):
            chunks.append(tuple(chunk))
            chunk, used = [], 0
            max_steps, max_bytes = limits(len(chunks))
        chunk.append(s)
        used += size_of[s]
    if chunk:
        chunks.append(tuple(chunk))
    return BaselinePlan(True, steps, have, tuple(chunks) or ((),), total)


def span_text(steps: Sequence[int]) -> str:
    """``"1-30"``, ``"171-200, 5"``: sorted steps as ranges (consecutive numbers)."""
    out: list[str] = []
    for s in sorted(steps):
        if out and s == int(out[-1].rsplit("-", 1)[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{s}"
        else:
            out.append(str(s))
    return ", ".join(out)


def progress_text(done: int, total: int, what: str, covered: int, steps: int, large: bool, chunk: int,
                  chunks: int) -> tuple[float, str]:
    """(fraction, text) of the baseline's progress bar: within the current recompute, and for a
    large run also where the chunks stand."""
    frac = min(1.0, max(0.0, done / total)) if total else 0.0
    text = f"Computing the baseline (the run's own settings): {what} ({done}/{total})" if what else \
        "Computing the baseline (the run's own settings)"
    if large:
        text += (f" · large run: from the latest step backwards, chunk {chunk} of {chunks}; "
                 f"{covered} of {steps} steps done so far")
    return frac, text


def large_note(steps: int, total_bytes: int, chunk: int) -> str:
    return (f"This run is large ({steps} steps, {total_bytes / 2**30:.1f} GB of batches): the baseline is computed "
            f"from the latest step backwards, {chunk} steps at a time; the pages show the steps done so far.")
