"""Free what a recompute no longer needs: after each stage, the :class:`~rldiag.engine.stages.State`
fields and the batch columns whose last reader has run.

Every stage declares what it reads: the batch columns (``needs`` / ``optional``, under the
settings) and the state fields (``uses``; ``sets`` counts too, since a stage may read what it
changes). A liveness pass over :data:`~rldiag.engine.stages.STAGES` gives, for each stage, what
no later stage reads (:func:`release_plan`); the runner drops those references after the stage
has run (:meth:`Release.apply`), so a tensor's memory goes back to the allocator as soon as nothing
else holds it, rather than at the end of the pack. Nothing is computed differently: the stages run
in the same order on the same tensors, and the results are the same bits.

A freed field or column holds :data:`FREED`-like markers (:class:`Freed`) rather than ``None``
(``None`` means *absent* to a stage, which would then compute something else): any use of one
raises :class:`~rldiag.errors.InternalError` naming it, so a read the declarations miss fails
loudly instead of changing a number. A stage whose ``uses`` or ``sets`` is undeclared (``None``)
may read anything: nothing is freed before it runs.

Only the batch's optional token columns are freed (the log-probs, entropy, values, ``loss_mask``:
4 bytes a token each); the base ones (``response_mask``, ``token_level_scores``, the row layout)
are read by every stage without a declaration and stay. The results (metrics, token and per-row
outputs, the step errors) and the inputs (settings, the KL controller) are never freed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from rldiag.engine.batch import TOKEN_FIELDS
from rldiag.engine.settings import EngineSettings
from rldiag.engine.stages.base import Stage, State
from rldiag.errors import InternalError

__all__ = ["FREEABLE_COLUMNS", "KEPT_FIELDS", "Freed", "Release", "release_plan"]

#: the batch columns a pass may free: the optional token columns (the base ones are read everywhere)
FREEABLE_COLUMNS = tuple(c for c in TOKEN_FIELDS if c not in ("response_mask", "token_level_scores"))
#: the state fields never freed: the inputs and the results
KEPT_FIELDS = frozenset(("batch", "settings", "kl_state", "errors", "metrics", "tokens", "rows"))


class Freed:
    """What a freed state field or batch column holds: any use of it raises (a later stage read it
    without declaring it), as does passing it to a torch function."""

    __slots__ = ("what",)

    def __init__(self, what: str):
        object.__setattr__(self, "what", what)

    def _error(self) -> InternalError:
        return InternalError(f"{self.what} was freed after its last declared reader, and a later stage reads it: "
                             "declare it in that stage's uses / needs (rldiag.engine.stages)")

    def __getattr__(self, name: str):
        raise self._error()

    def __bool__(self) -> bool:
        raise self._error()

    def __len__(self) -> int:
        raise self._error()

    def __getitem__(self, key):
        raise self._error()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        freed = next((a for a in (*args, *(kwargs or {}).values()) if isinstance(a, Freed)), None)
        raise (freed._error() if freed is not None else InternalError("a freed value was passed to torch"))

    def __repr__(self) -> str:
        return f"Freed({self.what!r})"


def _refuse(self: Freed, *args):
    raise self._error()


#: comparisons, arithmetic, iteration, conversions: Python looks these up on the type, never
#: through ``__getattr__``, so each refuses here
for _op in ("lt", "le", "gt", "ge", "eq", "ne", "add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv",
            "floordiv", "pow", "neg", "pos", "abs", "invert", "and", "rand", "or", "ror", "xor", "iter", "float",
            "int", "index", "matmul", "rmatmul"):
    setattr(Freed, f"__{_op}__", _refuse)
Freed.__hash__ = object.__hash__  # type: ignore[method-assign]  # kept hashable despite __eq__


@dataclass(frozen=True)
class Release:
    """What to drop after one stage: ``fields`` of the state, ``columns`` of its batch."""

    fields: tuple[str, ...] = ()
    columns: tuple[str, ...] = ()

    def apply(self, st: State, after: str) -> None:
        """Drop them from ``st`` (the batch is replaced by a copy without those columns: the
        caller's own batch object is left as it is)."""
        for name in self.fields:
            setattr(st, name, Freed(f"state field {name!r} (freed after stage {after})"))
        present = {c: Freed(f"batch column {c!r} (freed after stage {after})") for c in self.columns
                   if getattr(st.batch, c, None) is not None}
        if present:
            st.batch = dataclasses.replace(st.batch, **present)  # type: ignore[arg-type]  # a marker in place of a tensor


def _state_fields() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(State)) - KEPT_FIELDS


def release_plan(stages: Sequence[Stage], settings: EngineSettings) -> list[Release]:
    """For each of ``stages`` (in order), the state fields and batch columns no later stage
    reads, to drop once it has run. Nothing is dropped before a stage that does not declare what
    it uses (``uses`` or ``sets`` None), nor a field or column no stage declares at all."""
    fields = _state_fields()
    last: dict[tuple[str, str], int] = {}
    undeclared = -1
    for i, stage in enumerate(stages):
        if stage.uses is None or stage.sets is None:
            undeclared = i
            continue
        for name in (*stage.uses, *stage.sets):
            if name in fields:
                last["field", name] = i
        for col in stage.reads(settings):
            if col in FREEABLE_COLUMNS:
                last["column", col] = i
    out: list[list[str]] = [[] for _ in stages]
    cols: list[list[str]] = [[] for _ in stages]
    for (kind, name), i in last.items():
        if i < undeclared:
            i = undeclared
        (out if kind == "field" else cols)[i].append(name)
    return [Release(tuple(sorted(f)), tuple(sorted(c))) for f, c in zip(out, cols, strict=True)]
