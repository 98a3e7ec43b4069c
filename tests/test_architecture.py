"""The import graph keeps the layers of docs/architecture.md: no module imports a layer above its
own (function-level imports included), and no import cycle between modules.

Layers, from the ground up (a unit may import its own layer's other units and every layer below):

    errors, registry, version < engine < config < io < store < executors < scenario
    < analysis, doctor, capture, importers, synth < api < viz, toy < app, cli

``capture``, ``importers`` and ``synth`` sit beside analysis and doctor (they write or fake run
directories from the layers below); ``store`` (DuckDB over run directories: the app's queries and
``rldiag rows``) just above io, so the API and the app both use it; ``toy`` beside viz (a
trainer the CLI's demo runs).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "rldiag"

LAYERS: list[tuple[str, ...]] = [
    ("errors", "registry", "version"),
    ("engine",),
    ("config",),
    ("io",),
    ("store",),
    ("executors",),
    ("scenario",),
    ("analysis", "doctor", "capture", "importers", "synth"),
    ("api",),
    ("viz", "toy"),
    ("app", "cli"),
]
RANK = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, module: str) -> list[tuple[str, int, bool]]:
    """(imported rldiag module, line, at run time) for every import in the file, at any depth."""
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            typing_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from pkg import sub` imports the submodule pkg.sub where there is one
            names = [f"{stem}.{a.name}" if _exists(f"{stem}.{a.name}") else stem for a in node.names]
        else:
            continue
        out += [(n, node.lineno, id(node) not in typing_only) for n in names if n.split(".")[0] == "rldiag"]
    return out


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def _graph() -> dict[str, list[tuple[str, int, bool]]]:
    return {_module_name(p): _imports(p, _module_name(p)) for p in sorted(ROOT.rglob("*.py"))}


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in _graph()} - {"__init__"}
    assert units <= set(RANK), f"units without a layer in this test and docs/architecture.md: {units - set(RANK)}"


def test_no_import_reaches_a_layer_above():
    upward = []
    for module, imports in _graph().items():
        src = _unit(module)
        if src == "__init__":  # the package itself: its version, and the API it offers on first use
            assert {_unit(t) for t, _, _ in imports} <= {"version", "api"}, imports
            continue
        for target, line, _ in imports:
            dst = _unit(target)
            if dst != src and RANK.get(dst, 99) > RANK[src]:
                upward.append(f"{module}:{line} imports {target} ({src} is below {dst})")
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    # the one search for circles (tests/test_layers.py), which counts type-only imports too
    from tests.test_layers import cycles

    assert cycles() == []


DOC = ROOT.parent / "docs" / "architecture.md"


def _doc_tree() -> list[str]:
    """The paths the tree at the top of docs/architecture.md names (``engine/advantage/``, ``api.py``)."""
    block = DOC.read_text().split("```", 2)[1]
    import re

    paths, stack = [], []
    for line in block.splitlines():
        m = re.match(r"^( +)(\S+\.py|\S+/)(?=\s|$)", line)
        if not m:
            continue
        depth = len(m.group(1)) // 2 - 1
        name = m.group(2)
        parts = [p for p in name.split("/") if p]
        stack = stack[:depth]
        full = "/".join(stack + parts)
        paths.append(full)
        if name.endswith("/"):
            stack = stack + parts
    return paths


def test_the_docs_tree_matches_the_package():
    named = _doc_tree()
    missing = [p for p in named if not (ROOT / p).exists()]
    assert not missing, f"docs/architecture.md names what is not there: {missing}"
    top = {p.name + ("/" if p.is_dir() else "") for p in ROOT.iterdir()
           if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())}
    listed = {p.split("/")[0] + ("/" if "/" in p or (ROOT / p).is_dir() else "") for p in named}
    assert top <= listed, f"docs/architecture.md's tree lacks {sorted(top - listed)}"


def test_the_docs_draw_every_layer():
    text = DOC.read_text()
    drawing = text[text.index("## Layers"):text.index("## One place")]
    for units in LAYERS:
        for unit in units:
            assert unit in drawing, f"the layer drawing of docs/architecture.md lacks {unit}"
