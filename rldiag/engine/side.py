"""Stages run beside the others, on threads of their own: rldiag's diagnostics, computed while
verl's stages run.

On a CPU recompute the stages' thread is the critical path (docs/performance.md, "Diagnostics
beside verl's stages"): the loader's thread reads the next step on the other core and leaves
part of it idle. A diagnostic that reads only what an early stage has set can start right after
it, on a second thread, and be joined where a later stage first reads what it sets. torch's
operations and the mismatch pass's compiled read release the GIL, so both threads compute at
once. :data:`SIDES` are the groups: ``diag_is`` and ``mismatch`` once ``anchor`` has set
``mask0``, ``bypass`` and ``old_lp`` (joined before ``turns``, which reads ``diag_is_token``);
``ref_kl``, ``group_signal`` and ``health`` once ``actor_loss`` has made the policy loss (the
last field they read; joined at the end).

Nothing is computed differently, and :func:`check` refuses a group for which something could
be: a side stage must see the state it sees on one thread (no stage running meanwhile sets what
it reads), and what it sets must reach the state where the stages after it on one thread read
it (no stage before the join reads it). A side stage writes into a view of the state
(:class:`SideState`); at the join its fields reach the state and its results (metrics, token and
row outputs) are placed in the order of a run on one thread (:class:`Results`). The release plan
(:mod:`rldiag.engine.liveness`) sees each side stage at its join (:func:`effective_order`), so
nothing it reads is freed while it runs.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

import torch

from rldiag.engine.stages.base import Stage, State
from rldiag.errors import InternalError

__all__ = ["END", "SIDES", "Results", "Side", "SideRun", "SideState", "check", "effective_order"]

#: a group's ``before`` that joins it once every other stage has run
END = ""


@dataclass(frozen=True)
class Side:
    """Stages (by name, in order) started on a thread of their own once the stage ``after`` has
    run, joined before the stage ``before`` (:data:`END`: after the last)."""

    stages: tuple[str, ...]
    after: str
    before: str = END


#: the side groups of a recompute (see the module's docstring for why these, there)
SIDES: tuple[Side, ...] = (
    Side(("diag_is", "mismatch"), after="anchor", before="turns"),
    Side(("ref_kl", "group_signal", "health"), after="actor_loss"),
)

#: the results a stage writes, in the state and in a view
RESULTS = ("metrics", "tokens", "rows")


class SideState:
    """A side stage's view of the :class:`State`: reads go to the state, except the results
    (``metrics``, ``tokens``, ``rows``: its own dicts) and the fields it sets (kept here until
    the join, :meth:`apply`)."""

    def __init__(self, state: State):
        object.__setattr__(self, "_state", state)
        object.__setattr__(self, "_set", {})
        for name in RESULTS:
            object.__setattr__(self, name, {})

    def __getattr__(self, name: str):
        got = object.__getattribute__(self, "_set")
        if name in got:
            return got[name]
        return getattr(object.__getattribute__(self, "_state"), name)

    def __setattr__(self, name: str, value) -> None:
        if name in RESULTS:
            object.__setattr__(self, name, value)
        else:
            self._set[name] = value

    def apply(self) -> None:
        """What the stage set, into the state."""
        state = object.__getattribute__(self, "_state")
        for name, value in object.__getattribute__(self, "_set").items():
            setattr(state, name, value)


class SideRun:
    """One group's stages: :meth:`start` runs them in order on a thread of their own, each on a
    :class:`SideState`; :meth:`join` waits, raises what a stage raised, and returns the views."""

    def __init__(self, side: Side, stages: Sequence[Stage], state: State, keep_tokens: bool):
        self.side = side
        self.stages = [s for s in stages if s.name in side.stages]
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

    def join(self) -> dict[str, SideState]:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return dict(zip(self.names, self.views))


class Results:
    """Where each result of a recompute came from (its stage's place in ``names``), so that the
    side stages' results, merged at their join, take the place a run on one thread gives them."""

    def __init__(self, names: Sequence[str]):
        self.index = {name: i for i, name in enumerate(names)}
        self.origin: dict[str, dict[str, int]] = {attr: {} for attr in RESULTS}
        self.seen = dict.fromkeys(RESULTS, 0)  # the names of each result noted so far (the first ones)

    def note(self, state: State, stage: str) -> None:
        """After the main thread's ``stage``: the names it added to each result (new names come
        last in a dict; a result emptied meanwhile, the tokens without ``keep_tokens``, from its start)."""
        for attr in RESULTS:
            d, origin = getattr(state, attr), self.origin[attr]
            for key in islice(d, self.seen[attr] if len(d) >= self.seen[attr] else 0, None):
                origin.setdefault(key, self.index[stage])
            self.seen[attr] = len(d)

    def merge(self, state: State, views: dict[str, SideState]) -> None:
        """The side stages' results (stage name -> view) into ``state``, each result dict in the
        order of a run on one thread: by the place of the stage that first wrote each name."""
        for attr in RESULTS:
            main: dict = getattr(state, attr)
            origin = self.origin[attr]
            for key in main:
                origin.setdefault(key, len(self.index))  # written outside any stage: last
            for stage, view in views.items():
                got = getattr(view, attr)
                clash = sorted(set(got) & set(main))
                if clash:
                    raise InternalError(f"side stage {stage!r} writes {attr} {clash}, which another stage writes too")
                main.update(got)
                for key in got:
                    origin[key] = self.index[stage]
            ordered = sorted(main.items(), key=lambda kv: origin[kv[0]])  # stable: a stage's own order kept
            main.clear()
            main.update(ordered)
            self.seen[attr] = len(main)


def _declared(stage: Stage) -> tuple[set[str], set[str]]:
    if stage.uses is None or stage.sets is None:
        raise InternalError(f"stage {stage.name!r} does not declare what it reads: nothing runs beside it")
    return set(stage.uses), set(stage.sets)


def check(stages: Sequence[Stage], sides: Sequence[Side]) -> None:
    """Refuse (:class:`InternalError`) a side stage ``S`` that could compute something else than
    on one thread. ``S`` starts once its group's ``after`` has run and what it sets reaches the
    state at the join. The main thread's stages that run meanwhile, or lie between the two
    places of ``S`` (its place in ``stages`` and the join), are ``S``'s window: none of them may
    set a field ``S`` reads or sets (``S`` would see it half-made, or the wrong value would win),
    and none of them placed after ``S`` or after the join may read a field ``S`` sets (it would
    see it where it should not, or not see it where it should). The stages of two groups touch no
    field the other sets (they may run at once). Every stage involved declares its reads."""
    names = [s.name for s in stages]
    by = {s.name: s for s in stages}
    on_side = {n for g in sides for n in g.stages}
    for g in sides:
        if g.after not in names:
            raise InternalError(f"side stages start after {g.after!r}, which is not a stage")
        start = names.index(g.after)
        join = names.index(g.before) if g.before in names else len(names)
        for name in g.stages:
            if name not in by:
                raise InternalError(f"side stage {name!r} is not a stage")
            at = names.index(name)
            if at <= start:
                raise InternalError(f"side stage {name!r} comes before {g.after!r}, after which it would start")
            uses, made = _declared(by[name])
            window = [o for i, o in enumerate(stages) if start < i < max(at, join) and o.name not in on_side]
            for o in window:
                o_uses, o_sets = _declared(o)
                late = names.index(o.name) > min(at, join)
                clash = sorted(((uses | made) & o_sets) | (made & o_uses if late else set()))
                if clash:
                    raise InternalError(f"side stage {name!r} cannot run beside stage {o.name!r}: both touch {clash}")
            for other in sides:
                if other is g:
                    continue
                for other_name in other.stages:
                    o_uses, o_sets = _declared(by[other_name]) if other_name in by else (set(), set())
                    clash = sorted(((uses | made) & o_sets) | (made & o_uses))
                    if clash:
                        raise InternalError(f"side stages {name!r} and {other_name!r} may run at once: both touch {clash}")


def effective_order(stages: Sequence[Stage], sides: Sequence[Side]) -> list[Stage]:
    """``stages`` with each group's stages moved to just before its ``before`` (the end for
    :data:`END`): the order in which their effects reach the state (what the release plan must
    see). Checks the groups first (:func:`check`)."""
    check(stages, sides)
    order = [s for s in stages if not any(s.name in g.stages for g in sides)]
    for g in sides:
        moved = [s for s in stages if s.name in g.stages]
        at = next((i for i, s in enumerate(order) if s.name == g.before), len(order))
        order[at:at] = moved
    return order
