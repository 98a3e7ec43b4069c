"""The package's layers, read from the source with ``ast`` (every import, at module or function
level, relative ones resolved, and ``importlib.import_module("...")`` calls): the command line
and the app reach the computing modules only through :mod:`rldiag.api`; the app's data layer and
charts (store, viz) never import the app or the command line; nothing under the API imports the
layers above it."""

from __future__ import annotations

import ast
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
