"""Stages run beside the others, on a second thread: rldiag's diagnostics that read only what the
first stages set, computed while verl's stages run.

On a CPU recompute the stages' thread is the critical path (docs/performance.md, "Diagnostics
beside verl's stages"): the loader's thread reads the next step on the other core and leaves part
of it idle. ``diag_is`` and ``mismatch`` read the batch's log-probs and what ``anchor`` sets
(``mask0``, ``bypass``, ``old_lp``), which no later stage changes, so they can start right after
it; ``turns`` is the first stage that reads what they set (``diag_is_token``), so they are joined
before it. torch's operations and the mismatch pass's compiled read release the GIL, so both
threads compute at once.

Nothing is computed differently: each stage runs the same operations on the same tensors. A side
stage writes into a view of the state (:class:`SideState`) whose results are merged at the join
in the place the stage has in :data:`~rldiag.engine.stages.STAGES` (metric, token and row names
in the same order as a run on one thread), and whose declared ``sets`` reach the state only then.
The release plan (:mod:`rldiag.engine.liveness`) sees the side stages at their join, so nothing
they read is freed while they run.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rldiag.engine.stages.base import Stage, State
from rldiag.errors import InternalError

__all__ = ["SIDE", "Side", "SideRun", "SideState", "append_results", "apply_sets", "effective_order", "insert_results"]


@dataclass(frozen=True)
class Side:
    """Stages (by name, in order) started after ``after`` on a second thread, joined before ``before``."""

    stages: tuple[str, ...]
    after: str
    before: str


#: the side stages of a recompute (see the module's docstring for why these, there)
SIDE = Side(stages=("diag_is", "mismatch"), after="anchor", before="turns")


class SideState:
    """A side stage's view of the :class:`State`: reads go to the state, except the results
    (``metrics``, ``tokens``, ``rows``: its own dicts) and the fields it sets (kept here until
    the join, :meth:`apply`)."""

    _OWN = ("metrics", "tokens", "rows")

    def __init__(self, state: State):
        object.__setattr__(self, "_state", state)
        object.__setattr__(self, "_set", {})
        for name in self._OWN:
            object.__setattr__(self, name, {})

    def __getattr__(self, name: str):
        got = object.__getattribute__(self, "_set")
        if name in got:
            return got[name]
        return getattr(object.__getattribute__(self, "_state"), name)

    def __setattr__(self, name: str, value) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            self._set[name] = value


class SideRun:
    """The side stages of one recompute: :meth:`start` runs them in order on a thread of their
    own, each on a :class:`SideState`; :meth:`join` waits, raises what a stage raised, and
    returns their views in order."""

    def __init__(self, stages: Sequence[Stage], state: State, keep_tokens: bool):
        self.stages = list(stages)
        self.names = [s.name for s in self.stages]
        self.views = [SideState(state) for _ in self.stages]
        self.keep_tokens = keep_tokens
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="rldiag-side-stages", daemon=True)
        self.threads = torch.get_num_threads()

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        # the engine's intra-op thread count for this thread's operations too (a new thread
        # would otherwise take torch's default, every core)
        torch.set_num_threads(self.threads)
        try:
            for stage, view in zip(self.stages, self.views):
                stage.run(view)  # type: ignore[arg-type]  # a view of the state
                if not self.keep_tokens:
                    view.tokens.clear()
        except BaseException as exc:  # noqa: BLE001 - raised on the engine's thread at the join
            self.error = exc

    def join(self) -> list[SideState]:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.views


def effective_order(stages: Sequence[Stage], side: Side) -> list[Stage]:
    """``stages`` with the side stages moved to just before ``side.before`` (the end where it is
    absent): the order in which their effects reach the state (what the release plan must see).
    Raises :class:`InternalError` for a side whose stages could compute something else than on
    one thread (:func:`check`)."""
    check(stages, side)
    moved = [s for s in stages if s.name in side.stages]
    rest = [s for s in stages if s.name not in side.stages]
    at = next((i for i, s in enumerate(rest) if s.name == side.before), len(rest))  # absent: at the end
    return rest[:at] + moved + rest[at:]


def check(stages: Sequence[Stage], side: Side) -> None:
    """Refuse (:class:`InternalError`) a side stage ``S`` that would not see the state it sees on
    one thread. ``S`` starts once ``side.after`` has run and its fields reach the state at the
    join; the stages the main thread runs meanwhile, or between the two places of ``S`` (its
    place in ``stages`` and the join), are ``S``'s window. No stage of the window may set a field
    ``S`` reads or sets (``S`` would see it half-made, or the wrong one would win), and none of the
    window placed after ``S`` or after the join may read a field ``S`` sets (it would see it
    where it should not, or not see it where it should). Every stage involved declares its reads."""
    names = [s.name for s in stages]
    if side.after not in names:
        raise InternalError(f"side stages start after {side.after!r}, which is not a stage")
    start = names.index(side.after)
    join = names.index(side.before) if side.before in names else len(names)
    for s in stages:
        if s.name not in side.stages:
            continue
        at = names.index(s.name)
        if at <= start:
            raise InternalError(f"side stage {s.name!r} comes before {side.after!r}, after which it would start")
        window = [o for i, o in enumerate(stages) if start < i < max(at, join) and o.name not in side.stages]
        declared = {o.name: (set(o.uses), set(o.sets)) for o in (s, *window) if o.uses is not None and o.sets is not None}
        for o in (s, *window):
            if o.name not in declared:
                raise InternalError(f"stage {o.name!r} does not declare what it reads: nothing runs beside it")
        uses, made = declared[s.name]
        touched = uses | made
        for o in window:
            o_uses, o_sets = declared[o.name]
            late = names.index(o.name) > min(at, join)
            clash = sorted((touched & o_sets) | (made & o_uses if late else set()))
            if clash:
                raise InternalError(f"side stage {s.name!r} cannot run beside stage {o.name!r}: both touch {clash}")


def insert_results(state: State, side: dict[str, SideState], order: Sequence[str],
                   marks: dict[str, tuple[int, int, int]]) -> None:
    """The results of the side stages ``side`` (name -> view), each of which comes before the
    stage now running on the main thread, into ``state``'s ``metrics``, ``tokens`` and ``rows``,
    each dict rebuilt so that its names come in the order of a run on one thread (``order``:
    every stage's name in :data:`~rldiag.engine.stages.STAGES` order; ``marks[stage]``: the
    sizes of the three dicts when the main thread's stage ``stage`` had run)."""
    for k, attr in enumerate(SideState._OWN):
        main: dict = getattr(state, attr)
        items = list(main.items())
        out: dict = {}
        taken = 0
        for name in order:
            if name in side:
                out.update(getattr(side[name], attr))
            elif name in marks:
                upto = marks[name][k]
                out.update(items[taken:upto])
                taken = max(taken, upto)
        out.update(items[taken:])
        main.clear()
        main.update(out)


def append_results(state: State, view: SideState) -> None:
    """A side stage's results after those in ``state`` (every stage before it has run)."""
    for attr in SideState._OWN:
        getattr(state, attr).update(getattr(view, attr))


def apply_sets(state: State, view: SideState) -> None:
    """What a side stage set, into ``state``."""
    for name, value in object.__getattribute__(view, "_set").items():
        setattr(state, name, value)
