"""A small registry keyed by verl's own config strings.

There is one registry per concept (advantage estimators, policy losses, KL estimators,
aggregation modes, ...). Each registry holds functions of one signature and, for each entry, a
record of one metadata type (a frozen dataclass the registry names: :class:`Entry` or a subclass
with the fields that concept needs). A keyword that is not a field of that type fails at
registration, so a misspelt ``neds=`` cannot pass silently. Looking up an unknown key raises
:class:`~rldiag.errors.UnknownKeyError` listing the valid keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from rldiag.errors import UnknownKeyError

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class Entry:
    """What every registered entry records: ``source``, where its formula comes from (verl's
    file and function, the paper)."""

    source: str = ""


class Registry(Generic[F]):
    """Name -> function, with the kind of thing named for error messages and one metadata type."""

    def __init__(self, kind: str, meta: type[Entry] = Entry):
        self.kind = kind
        self.meta_type = meta
        self._entries: dict[str, F] = {}
        self._meta: dict[str, Any] = {}

    def register(self, *names: str, **meta: Any) -> Callable[[F], F]:
        """Decorator registering a function under one or more names (aliases), with the fields
        of this registry's metadata type as keywords."""
        try:
            record = self.meta_type(**meta)
        except TypeError:
            valid = ", ".join(f.name for f in dataclasses.fields(self.meta_type))
            unknown = ", ".join(repr(k) for k in sorted(set(meta) - {f.name for f in dataclasses.fields(self.meta_type)}))
            raise TypeError(f"{self.kind} {names[0]!r}: unknown metadata {unknown or repr(meta)}; "
                            f"{self.meta_type.__name__} has {valid}") from None

        def deco(fn: F) -> F:
            for name in names:
                if name in self._entries and self._entries[name] is not fn:
                    raise ValueError(f"{self.kind} {name!r} registered twice")
                self._entries[name] = fn
                self._meta[name] = record
            return fn

        return deco

    def get(self, name: str) -> F:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise UnknownKeyError(self.kind, name, list(self._entries)) from None

    def meta(self, name: str) -> Any:
        """The entry's metadata record (an instance of this registry's metadata type)."""
        self.get(name)
        return self._meta[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def names(self) -> list[str]:
        return sorted(self._entries)
