"""YAML read with bounds, so that a hostile or broken file gives an error instead of eating the
machine.

Every YAML rldiag reads (run configs, doctor rules, ``--set`` values) goes through
:func:`load_yaml`. Before the document is built, one pass over the parser's events (libyaml's
parser is iterative: no recursion, whatever the nesting) measures it:

- its **expanded size**: every scalar and collection counted, an alias counted as the whole
  subtree it stands for. Eight levels of aliases in 656 bytes ("billion laughs") expand to
  10^8 nodes; :data:`MAX_NODES` stops that after the first few hundred thousand, before anything
  is expanded;
- its **nesting depth** (:data:`MAX_DEPTH`): the document is then built by PyYAML's composer,
  which recurses once per level.

Files are read up to :data:`MAX_BYTES` (verl's full config is about 50 KB) and must be UTF-8.
Only then is the document built, with the safe loader (no Python objects from tags).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, TypeVar

import yaml

from rldiag.errors import ConfigError


class ReadablePath(Protocol):
    """What the configuration layer reads a file through: a local ``Path`` or the I/O layer's
    object-store path (``rldiag.io.fs.RemotePath``) alike, so that config imports nothing above it."""

    def open(self, mode: Literal["rb"]) -> Any: ...

    def is_file(self) -> bool: ...

    def __truediv__(self: P, other: str) -> P: ...


P = TypeVar("P", bound=ReadablePath)

#: Largest YAML file read (bytes). A 2 MiB file loads in about a second, within 100 MB.
MAX_BYTES = 2 << 20
#: Largest document, in nodes after alias expansion (a verl config has a few thousand).
MAX_NODES = 200_000
#: Deepest nesting of mappings and sequences (a verl config nests about 6 levels).
MAX_DEPTH = 100

_RAISE = object()
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _measure(text: str, where: str, error: type[Exception]) -> None:
    """Raise ``error`` when the document expands beyond :data:`MAX_NODES` or nests deeper than
    :data:`MAX_DEPTH`. One pass over the events; an alias adds the size its anchor was given."""
    sizes: dict[str, int] = {}  # anchor -> expanded size of its node
    stack: list[list] = []  # open collections: [anchor, expanded size so far]
    total = 0
    for ev in yaml.parse(text, Loader=_LOADER):
        if isinstance(ev, (yaml.ScalarEvent, yaml.AliasEvent)):
            n = sizes.get(ev.anchor, 1) if isinstance(ev, yaml.AliasEvent) else 1
            if isinstance(ev, yaml.ScalarEvent) and ev.anchor is not None:
                sizes[ev.anchor] = 1
        elif isinstance(ev, yaml.CollectionStartEvent):
            stack.append([ev.anchor, 1])
            if len(stack) > MAX_DEPTH:
                line = ev.start_mark.line + 1 if ev.start_mark else "?"
                raise error(f"{where} nests deeper than {MAX_DEPTH} levels (line {line}); "
                            "rldiag reads configs up to that depth")
            total += 1
            continue
        elif isinstance(ev, yaml.CollectionEndEvent):
            anchor, n = stack.pop()
            if anchor is not None:
                sizes[anchor] = n
            if stack:
                stack[-1][1] += n
            continue
        else:
            continue
        total += n
        if stack:
            stack[-1][1] += n
        if total > MAX_NODES:
            how = " once its aliases are expanded" if sizes else ""
            raise error(f"{where} holds more than {MAX_NODES:,} values{how}; "
                        f"rldiag reads configs up to that size")


def load_yaml(text: str, where: str, error: type[Exception] = ConfigError, invalid: Any = _RAISE) -> Any:
    """``text`` parsed with the safe loader after :func:`_measure`; ``where`` names it in errors
    (``config file run.yaml``). Text that is not valid YAML raises ``error`` too, or gives
    ``invalid`` when that is passed; a document beyond the bounds always raises."""
    try:
        _measure(text, where, error)
        return yaml.load(text, Loader=_LOADER)  # noqa: S506 - the safe loader (C or Python)
    except yaml.YAMLError as exc:
        if invalid is not _RAISE:
            return invalid
        raise error(f"{where} is not valid YAML: {_one_line(exc)}") from None


def _one_line(exc: yaml.YAMLError) -> str:
    """PyYAML's message (several lines, naming ``<unicode string>``) as one line with the place."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return " ".join(str(exc).split())
    text = " ".join(" ".join(str(p).split()) for p in (exc.context, exc.problem) if p)
    mark = exc.problem_mark or exc.context_mark
    if mark is not None:
        text += f" (line {mark.line + 1}, column {mark.column + 1})"
    return text


def read_text_bounded(path: ReadablePath, where: str, error: type[Exception] = ConfigError, limit: int = MAX_BYTES) -> str:
    """The UTF-8 text of ``path`` (a Path or an object-store path), at most ``limit`` bytes;
    an unreadable, larger or non-UTF-8 file raises ``error`` naming ``where``."""
    try:
        with path.open("rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise error(f"cannot read {where}: {exc}") from None
    if len(data) > limit:
        raise error(f"{where} is larger than {limit / (1 << 20):g} MiB; rldiag reads config files up to that size")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(f"{where} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
