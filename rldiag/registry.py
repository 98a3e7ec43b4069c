"""A small registry keyed by verl's own config strings.

There is one registry per concept (advantage estimators, policy losses, KL estimators,
aggregation modes, ...). Each registry holds functions of one signature; looking up an
unknown key raises :class:`~rldiag.errors.UnknownKeyError` listing the valid keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from rldiag.errors import UnknownKeyError

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Name -> function, with the kind of thing named for error messages."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, F] = {}
        self._meta: dict[str, dict] = {}

    def register(self, *names: str, **meta) -> Callable[[F], F]:
        """Decorator registering a function under one or more names (aliases)."""

        def deco(fn: F) -> F:
            for name in names:
                if name in self._entries and self._entries[name] is not fn:
                    raise ValueError(f"{self.kind} {name!r} registered twice")
                self._entries[name] = fn
                self._meta[name] = dict(meta)
            return fn

        return deco

    def get(self, name: str) -> F:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise UnknownKeyError(self.kind, name, list(self._entries)) from None

    def meta(self, name: str) -> dict:
        self.get(name)
        return self._meta[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def names(self) -> list[str]:
        return sorted(self._entries)
