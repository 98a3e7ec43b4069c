"""Many recomputes of one packed batch, sharing what they have in common: ``rldiag sweep``.

:func:`recompute_batch_many` gives, for each of several settings, exactly what
:func:`~rldiag.engine.pipeline.recompute_batch` gives (the same operations in the same order, so
the same bits), but runs a stage once for every scenario that agrees on it. It walks
:data:`~rldiag.engine.stages.STAGES` in order over a tree of states: one state while the
scenarios agree on the settings keys the next stage declares (its ``settings`` patterns,
matched against the scenarios' keys), copied at the stage where they differ (the state's
dicts and its step failures; tensors are shared, the engine never writes into one it did not
make), one branch per distinct value. Before it branches, a state runs once what it can for
every scenario of the branch point: each later stage whose settings agree and that depends on
none of the stages still to run before it, nor they on it (the ``uses`` / ``sets`` the stages
declare: the :class:`~rldiag.engine.stages.State` fields each reads and writes). So a grid of
clip ratios runs the advantages, the data metrics, the layout, the entropy and KL losses, the
critic, the old-policy metrics, the reference KL, the group signals and the mismatch once, and
the policy loss and the total loss per clip ratio.

The tree is walked depth first (:func:`iter_recompute_many`): each leaf's result is handed out
as soon as it is complete, so memory holds one path of states, not every scenario's tensors.

The reward KL's controller state (``kl_states``, one per scenario) is read by the ``reward_kl``
stage alone. A fixed controller's state is never read; preset coefficients and adaptive
controllers' values are compared by value. An adaptive controller is advanced in place: the
stage advances the first scenario's of a branch, and the others' are given its new value. So
scenarios may also pass one object, but then must agree on every setting up to that stage (else
:class:`ValueError`: it would be advanced twice).
"""

from __future__ import annotations

import copy
import fnmatch
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rldiag.engine.batch import Batch
from rldiag.engine.kl_control import KLControllerState, PresetKLCoefficients
from rldiag.engine.pipeline import Result
from rldiag.engine.settings import EngineSettings
from rldiag.engine.stages import STAGES, Stage, State, pattern_regex
from rldiag.engine.step_failures import StepErrors

__all__ = ["SweepSettings", "SweepTree", "differing_keys", "iter_recompute_many", "recompute_batch_many", "stage_keys"]

KLState = KLControllerState | PresetKLCoefficients | None
#: ``on_stage(stage name, scenario indices)``: called after a stage ran once for those scenarios
StageHook = Callable[[str, list[int]], None]

#: keys a stage reads under another name: ``rldiag.verl_version`` unset, the release is the one
#: the run recorded (:func:`rldiag.config.verl_versions.version_of`)
ALIASES: dict[str, tuple[str, ...]] = {"rldiag.verl_version": ("verl_version", "rldiag.capture.verl_version")}
#: State fields every stage reads
_ALWAYS_USED = ("batch", "settings")

_MISSING = object()


class SweepSettings(EngineSettings, Protocol):
    """Settings whose keys can be listed (:class:`rldiag.config.settings.Settings` is one)."""

    @property
    def values(self) -> Mapping[str, Any]: ...


def differing_keys(settings_list: Sequence[SweepSettings]) -> set[str]:
    """The keys whose values are not the same in every one of ``settings_list`` (a key some lack
    counts as differing)."""
    keys: set[str] = set()
    for s in settings_list:
        keys.update(s.values)
    first = settings_list[0].values
    return {k for k in keys if any(s.values.get(k, _MISSING) != first.get(k, _MISSING) for s in settings_list[1:])
            or k not in first}


def stage_keys(stage: Stage, keys: Iterable[str], settings: EngineSettings | None = None) -> tuple[str, ...]:
    """The keys of ``keys`` that ``stage`` reads (under ``settings``, when given and the stage's
    ``settings_fn`` says): those its patterns match, and the other names of a matched key
    (:data:`ALIASES`)."""
    declared = stage.settings_fn(settings) if settings is not None and stage.settings_fn is not None else stage.settings
    patterns = list(declared)
    for key, others in ALIASES.items():
        if any(fnmatch.fnmatchcase(key, p) for p in declared):
            patterns += others
    return tuple(sorted(k for k in keys if any(fnmatch.fnmatchcase(k, p) for p in patterns)))


def _kl_key(kl: KLState, s: EngineSettings) -> object:
    """What of a scenario's KL controller state its recompute depends on (see the module doc)."""
    if kl is None or not s.get("algorithm.use_kl_in_reward"):
        return None
    if isinstance(kl, PresetKLCoefficients):
        return ("preset", tuple(kl.values))
    if isinstance(kl, KLControllerState):
        if s.get("algorithm.kl_ctrl.type") != "adaptive":
            return None  # a fixed controller's coefficient is the setting's
        return ("adaptive", kl.value)
    return ("object", id(kl))


def _mutable_kl(kl: KLState, s: EngineSettings) -> bool:
    return isinstance(kl, KLControllerState) and _kl_key(kl, s) is not None


@dataclass(frozen=True)
class _Deps:
    """A stage's dependencies as the walk compares them (None: undeclared)."""

    uses: frozenset[str] | None
    sets: frozenset[str]
    metric_reads: frozenset[str]
    outputs: frozenset[str]  # its token and row outputs, and the row outputs it reads ("rows:<name>")

    @classmethod
    def of(cls, stage: Stage) -> _Deps:
        outputs = frozenset(stage.tokens) | {f"rows:{r}" for r in stage.rows}
        if stage.uses is None or stage.sets is None:
            return cls(None, frozenset(), frozenset(), outputs)
        fields = {u for u in stage.uses if ":" not in u} | set(_ALWAYS_USED)
        reads = {u.split(":", 1)[1] for u in stage.uses if u.startswith("metrics:")}
        outputs |= {u for u in stage.uses if u.startswith("rows:")}
        return cls(frozenset(fields | set(stage.sets)), frozenset(stage.sets), frozenset(reads), outputs)


def _writes_metric(stage: Stage, names: frozenset[str]) -> bool:
    return any(pattern_regex(m.name).match(n) for m in stage.metrics for n in names)


def commute(a: Stage, b: Stage) -> bool:
    """Whether ``a`` and ``b`` give the same state run in either order: both declared, neither
    reads or writes a field the other writes, reads a metric the other writes, or writes (or
    reads) a token or row output the other writes."""
    da, db = _Deps.of(a), _Deps.of(b)
    if da.uses is None or db.uses is None:
        return False
    if da.sets & db.uses or db.sets & da.uses:
        return False
    if _writes_metric(b, da.metric_reads) or _writes_metric(a, db.metric_reads):
        return False
    return not (da.outputs & db.outputs)


@dataclass
class _Node:
    """One state of the tree: the scenarios it stands for, the stages it has still to run (their
    indices in ``stages``, ascending), and the first failure of a stage it ran out of order."""

    state: State
    members: list[int]
    pending: list[int]
    failed: tuple[int, BaseException] | None = None
    kls: list[KLState] = field(default_factory=list)


def _branch(st: State, settings: EngineSettings, kl: KLState) -> State:
    """A copy of ``st`` for a branch: its own dicts and step failures, the same tensors."""
    new = copy.copy(st)
    new.settings, new.kl_state = settings, kl
    new.metrics, new.tokens, new.rows = dict(st.metrics), dict(st.tokens), dict(st.rows)
    errors = StepErrors(st.errors.steps)
    errors.messages = dict(st.errors.messages)
    new.errors = errors
    return new


def _group(members: list[int], key: Callable[[int], object]) -> list[list[int]]:
    """``members`` split by ``key`` (compared with ==), in order of first appearance."""
    groups: list[tuple[object, list[int]]] = []
    for i in members:
        k = key(i)
        for gk, g in groups:
            if gk == k:
                g.append(i)
                break
        else:
            groups.append((k, [i]))
    return [g for _, g in groups]


class SweepTree:
    """The walk of one batch's stages for several scenarios at once (see the module doc): a stage
    runs once for the scenarios that agree on the keys it reads; where they differ, the stages
    after it that can run once for all (they agree there and commute with every stage still
    pending before them) run first, then the node branches, one child per group of scenarios
    that agree. Each method decides one thing."""

    def __init__(self, batch: Batch, settings_list: Sequence[SweepSettings], kls: list[KLState],
                 catch: tuple[type[BaseException], ...], on_stage: StageHook | None, stages: Sequence[Stage]):
        self.batch, self.settings_list, self.kls = batch, settings_list, kls
        self.catch, self.on_stage, self.stages = catch, on_stage, stages
        self.differ = differing_keys(settings_list) if len(settings_list) > 1 else set()
        self.keys = [stage_keys(stage, self.differ) for stage in stages]
        self.reads_kl = [stage.uses is None or "kl_state" in stage.uses for stage in stages]
        self._own: dict[tuple[int, int], tuple[str, ...]] = {}  # (stage, scenario) -> the keys it reads there
        self._swaps: dict[tuple[int, int], bool] = {}

    def keys_read(self, members: list[int], idx: int) -> tuple[str, ...]:
        """The differing keys stage ``idx`` reads for any of ``members`` (each under its own settings)."""
        stage = self.stages[idx]
        if stage.settings_fn is None or not self.differ:
            return self.keys[idx]
        for i in members:
            if (idx, i) not in self._own:
                self._own[idx, i] = stage_keys(stage, self.differ, self.settings_list[i])
        return tuple(sorted({k for i in members for k in self._own[idx, i]}))

    def values(self, i: int, which: tuple[str, ...]) -> tuple:
        """Scenario ``i``'s values of the keys ``which``."""
        vals = self.settings_list[i].values
        return tuple(vals.get(k, _MISSING) for k in which)

    def agree(self, node: _Node, idx: int) -> bool:
        """Whether the node's scenarios read the same values at stage ``idx`` (it may run once for all)."""
        which = self.keys_read(node.members, idx)
        if not which:
            return True
        first = self.values(node.members[0], which)
        return all(self.values(i, which) == first for i in node.members[1:])

    def movable(self, later: int, before: int) -> bool:
        """Whether stage ``later`` may run before the pending stage ``before`` (they commute)."""
        if (later, before) not in self._swaps:
            self._swaps[later, before] = commute(self.stages[later], self.stages[before])
        return self._swaps[later, before]

    @staticmethod
    def settled(node: _Node) -> bool:
        """Every stage before the node's first failure has run: that failure is the outcome."""
        return node.failed is not None and (not node.pending or node.pending[0] > node.failed[0])

    def run(self, node: _Node, idx: int) -> None:
        """Run stage ``idx`` once for the node's scenarios, unless an earlier stage failed; a caught
        failure is kept when it is the earliest so far."""
        node.pending.remove(idx)
        if node.failed is not None and node.failed[0] < idx:
            return  # the recompute stops at the failed stage
        try:
            self.stages[idx].run(node.state)
        except self.catch as exc:
            if node.failed is None or idx < node.failed[0]:
                node.failed = (idx, exc)
            return
        if self.reads_kl[idx]:
            self.share_kl(node)
        if self.on_stage is not None:
            self.on_stage(self.stages[idx].name, list(node.members))

    def share_kl(self, node: _Node) -> None:
        """The branch's KL controller advanced: the node's other scenarios' controllers take its value."""
        rep = node.state.kl_state
        for i in node.members:
            kl = node.kls[i]
            if isinstance(rep, KLControllerState) and kl is not rep and _mutable_kl(kl, self.settings_list[i]):
                assert isinstance(kl, KLControllerState)
                kl.value = rep.value

    def run_ahead(self, node: _Node) -> None:
        """Where the scenarios differ at the node's next stage: run the later stages that can run
        once for all of them first (they agree there and commute with every pending stage before)."""
        for later in list(node.pending[1:]):
            before = [b for b in node.pending if b < later]
            if self.agree(node, later) and all(self.movable(later, b) for b in before):
                self.run(node, later)

    def children(self, node: _Node, idx: int) -> Iterator[_Node]:
        """The node split at stage ``idx``: one child per group of scenarios that read the same
        values there, each branched when its turn comes."""
        groups = _group(node.members, functools.partial(self.values, which=self.keys_read(node.members, idx)))
        if any(self.reads_kl[b] for b in node.pending):
            _check_kl(node, groups, self.settings_list)
        for g in groups:
            yield _Node(_branch(node.state, self.settings_list[g[0]], node.kls[g[0]]), g, list(node.pending),
                        node.failed, node.kls)

    def outcome(self, node: _Node) -> tuple[list[int], Result | BaseException]:
        """A leaf's scenarios and their result (or the failure that is their result)."""
        if node.failed is not None:
            return list(node.members), node.failed[1]
        st = node.state
        return list(node.members), Result(steps=list(self.batch.steps), metrics=dict(st.metrics),
                                          tokens=dict(st.tokens), failed=st.errors.failed(), rows=dict(st.rows))

    def leaves(self, node: _Node) -> Iterator[tuple[list[int], Result | BaseException]]:
        """``(scenarios, result)`` of every leaf under ``node``, depth first."""
        while node.pending and not self.settled(node):
            idx = node.pending[0]
            if self.agree(node, idx):
                self.run(node, idx)
                continue
            self.run_ahead(node)
            if self.settled(node):
                break
            for child in self.children(node, idx):
                yield from self.leaves(child)
            return
        yield self.outcome(node)

    def roots(self) -> Iterator[_Node]:
        """One root per group of scenarios whose KL controller states agree (see :func:`_kl_key`)."""
        n = len(self.settings_list)
        for members in _group(list(range(n)), lambda i: _kl_key(self.kls[i], self.settings_list[i])):
            state = State(self.batch, self.settings_list[members[0]], self.kls[members[0]], StepErrors(self.batch.steps))
            yield _Node(state, members, list(range(len(self.stages))), None, self.kls)


def iter_recompute_many(
    batch: Batch,
    settings_list: Sequence[SweepSettings],
    kl_states: Sequence[KLState] | None = None,
    *,
    catch: tuple[type[BaseException], ...] = (),
    on_stage: StageHook | None = None,
    stages: Sequence[Stage] = STAGES,
) -> Iterator[tuple[list[int], Result | BaseException]]:
    """``(scenarios, result)`` for each leaf of the tree, depth first: the indices into
    ``settings_list`` whose recompute is ``result`` (see the module doc and :class:`SweepTree`).
    An exception of a type in ``catch`` raised by a stage is that leaf's result instead, for
    exactly the scenarios whose own recompute would raise it first; others propagate."""
    n = len(settings_list)
    if n == 0:
        return
    kls: list[KLState] = list(kl_states) if kl_states is not None else [None] * n
    if len(kls) != n:
        raise ValueError(f"{len(kls)} KL states for {n} settings")
    tree = SweepTree(batch, settings_list, kls, catch, on_stage, stages)
    for root in tree.roots():
        yield from tree.leaves(root)


def _check_kl(node: _Node, groups: list[list[int]], settings_list: Sequence[SweepSettings]) -> None:
    seen: dict[int, int] = {}
    for gi, g in enumerate(groups):
        for i in g:
            kl = node.kls[i]
            if _mutable_kl(kl, settings_list[i]):
                if seen.setdefault(id(kl), gi) != gi:
                    raise ValueError("scenarios that share an adaptive KL controller state must agree on every "
                                     "setting up to the reward KL: it would be advanced once for each")


def recompute_batch_many(
    batch: Batch,
    settings_list: Sequence[SweepSettings],
    kl_states: Sequence[KLState] | None = None,
    *,
    on_stage: StageHook | None = None,
) -> list[Result]:
    """One :class:`~rldiag.engine.pipeline.Result` per settings, in order, each equal to
    ``recompute_batch(batch, settings_list[i], kl_states[i])`` (see the module doc); an error
    any of them raises is raised."""
    out: list[Result | None] = [None] * len(settings_list)
    for members, result in iter_recompute_many(batch, settings_list, kl_states, on_stage=on_stage):
        assert isinstance(result, Result)  # nothing is caught
        for i in members:
            out[i] = result if i == members[0] else Result(result.steps, dict(result.metrics), dict(result.tokens),
                                                          dict(result.failed), dict(result.rows))
    assert all(r is not None for r in out)
    return [r for r in out if r is not None]
