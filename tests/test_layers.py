"""The package's layers, read from the source with ``ast`` (every import, at module or function
level, type-only ones included, relative ones resolved, and ``importlib.import_module("...")``
calls): the command line and the app reach the computing modules only through :mod:`rldiag.api`;
the app's data layer and charts (store, viz) never import the app or the command line, and reach
nothing behind the API, not even through the modules they import; nothing under the API imports
the layers above it; and no rldiag module imports itself round a circle, type-only imports
counted (a circle of types is a circle of concepts)."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rldiag"

#: what the command line and the app must reach through rldiag.api
BEHIND_THE_API = ("rldiag.scenario", "rldiag.analysis", "rldiag.doctor", "rldiag.importers",
                  "rldiag.executors", "rldiag.engine")
#: the layers above the API (rldiag.api may be imported by them, never the other way round)
ABOVE_THE_API = ("rldiag.viz", "rldiag.app", "rldiag.cli")
#: the modules at or below the API
UNDER_THE_API = ("api.py", "scenario", "errors.py", "registry.py", "engine", "config", "io",
                 "executors", "analysis", "doctor", "importers", "store")


def module_name(path: Path, package: Path = PACKAGE) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, package: Path = PACKAGE) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path``; ``from a import b`` gives ``a`` and
    ``a.b`` (``b`` may be a submodule)."""
    name = module_name(path, package)
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            called = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.append((node.lineno, node.args[0].value))
    return out


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(files: list[Path], banned: tuple[str, ...], package: Path = PACKAGE) -> list[str]:
    return [f"{f.relative_to(package.parent)}:{line} imports {mod}"
            for f in files for line, mod in imports(f, package) if within(mod, banned)]


def sources(*parts: str, package: Path = PACKAGE) -> list[Path]:
    out: list[Path] = []
    for part in parts:
        p = package / part
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return out


@cache
def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its ``__init__.py``)."""
    return {module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def dependencies(module: str, package: Path = PACKAGE, parents: bool = False) -> set[str]:
    """The rldiag modules ``module`` imports (a name imported from a module is that module);
    ``parents``: with the packages around each (importing ``a.b.c`` runs ``a/__init__`` and
    ``a/b/__init__`` first)."""
    files = module_files(package)
    by_line: dict[int, list[list[str]]] = {}
    for line, name in imports(files[module], package):
        parts = name.split(".")
        found = [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in files]
        if found:
            by_line.setdefault(line, []).append(found)
    out: set[str] = set()
    for names in by_line.values():
        deepest = {found[-1] for found in names}
        for found in names:
            # ``from pkg import sub`` imports the submodule (the package is its parent, not a dependency of its own)
            if parents or not any(other.startswith(found[-1] + ".") for other in deepest):
                out.update(found if parents else found[-1:])
    out.discard(module)
    return out


def reached(start: str, stop: Iterable[str], package: Path = PACKAGE) -> dict[str, list[str]]:
    """Every module ``start`` loads, directly or through others, with the chain that reaches it;
    modules in ``stop`` (and below them) are not followed."""
    stop = tuple(stop)
    chains = {start: [start]}
    todo = [start]
    while todo:
        here = todo.pop()
        for dep in sorted(dependencies(here, package, parents=True)):
            if dep not in chains and not within(dep, stop):
                chains[dep] = chains[here] + [dep]
                todo.append(dep)
    return chains


def behind_the_api_reached(part: str) -> list[str]:
    """For each module of ``rldiag.<part>``, the first module behind the API it reaches, with the
    chain; the API itself (and the package, which offers it) is the door, not followed."""
    out = []
    for module in sorted(m for m in module_files() if within(m, (f"rldiag.{part}",))):
        chains = reached(module, ("rldiag.api",))
        chains.pop("rldiag", None)
        bad = sorted(m for m in chains if within(m, BEHIND_THE_API))
        if bad:
            out.append(" -> ".join(chains[bad[0]]) + f" (and {len(bad) - 1} more)")
    return out


def cycles(package: Path = PACKAGE) -> list[list[str]]:
    """The import circles among the package's modules, type-only and function-level imports
    included: the strongly connected components of more than one module (Tarjan's algorithm,
    iterative)."""
    graph = {m: sorted(dependencies(m, package)) for m in module_files(package)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(graph.get(w, ()))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_command_line_and_the_app_call_only_the_api():
    files = sources("cli", "app")
    assert files and all(f.suffix == ".py" for f in files)
    assert violations(files, BEHIND_THE_API) == []


def test_store_and_viz_never_import_the_app_or_the_command_line():
    assert violations(sources("store", "viz"), ("rldiag.app", "rldiag.cli")) == []


def test_the_store_imports_nothing_behind_the_api():
    """rldiag.rows queries through the store: the app's data layer sits beside the API, below it."""
    assert violations(sources("store"), BEHIND_THE_API + ("rldiag.api",)) == []


def test_nothing_under_the_api_imports_the_layers_above_it():
    assert violations(sources(*UNDER_THE_API), ABOVE_THE_API) == []


def test_viz_reaches_nothing_behind_the_api_even_through_what_it_imports():
    assert behind_the_api_reached("viz") == []


def test_store_reaches_nothing_behind_the_api_even_through_what_it_imports():
    assert behind_the_api_reached("store") == []


def test_no_import_cycle_type_only_imports_included():
    assert cycles() == []


def test_a_circle_of_types_is_found(tmp_path):
    package = tmp_path / "rldiag"
    (package / "engine").mkdir(parents=True)
    (package / "engine" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from rldiag.engine.b import B\n")
    (package / "engine" / "b.py").write_text("from rldiag.engine import a\n")
    (package / "engine" / "c.py").write_text("from rldiag.engine.a import thing\n")
    assert cycles(package) == [["rldiag.engine.a", "rldiag.engine.b"]]
    chains = reached("rldiag.engine.c", (), package)
    assert chains["rldiag.engine.b"] == ["rldiag.engine.c", "rldiag.engine.a", "rldiag.engine.b"]


@pytest.mark.parametrize("source, found, banned", [
    ("from rldiag.scenario.recompute import recompute\n", ["rldiag.scenario.recompute", "rldiag.scenario.recompute.recompute"],
     True),
    ("def f():\n    import rldiag.doctor.doctor as d\n", ["rldiag.doctor.doctor"], True),
    ("from rldiag import analysis\n", ["rldiag", "rldiag.analysis"], True),
    ("from ..engine import kl\n", ["rldiag.engine", "rldiag.engine.kl"], True),
    ("import importlib\nimportlib.import_module('rldiag.analysis.check')\n", ["importlib", "rldiag.analysis.check"], True),
    ("from . import session\n", ["rldiag.app", "rldiag.app.session"], False),
    ("from rldiag import api\n", ["rldiag", "rldiag.api"], False),
    ("from rldiag.checkpoint import x\n", ["rldiag.checkpoint", "rldiag.checkpoint.x"], False),
])
def test_every_kind_of_import_is_seen(tmp_path, source, found, banned):
    package = tmp_path / "rldiag"
    (package / "app").mkdir(parents=True)
    f = package / "app" / "page.py"
    f.write_text(source)
    assert [m for _, m in imports(f, package)] == found
    assert bool(violations([f], BEHIND_THE_API, package)) is banned
