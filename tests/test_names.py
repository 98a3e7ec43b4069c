"""The package's names, read from the source with ``ast``: no module imports another's private
name (one starting with ``_``); no top-level module or package of ``rldiag/`` is named like a
function of the API (``rldiag.recompute`` is the function, never a module); the API's public
names are declared once (``rldiag.api.__all__``), the others derived from it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rldiag
from rldiag import api
from tests.test_layers import PACKAGE, module_name, sources

#: names kept free for API functions to come (the reward what-if's ``rldiag.rescore``)
RESERVED = ("rescore",)


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(path: Path, package: Path = PACKAGE) -> list[str]:
    """``file:line imports what`` for each ``from module import _name`` (at any level of the
    file) and each import of a private module (``_mod``), ``__future__`` and dunders aside."""
    out = []
    here = module_name(path, package)
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        found: list[str] = []
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + (path.name == "__init__.py")]
                module = ".".join(base + ([module] if module else []))
            if any(private(p) for p in module.split(".")):
                found.append(module)
            found += [f"{module}.{a.name}" for a in node.names if private(a.name)]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if any(private(p) for p in a.name.split("."))]
        out += [f"{path.relative_to(package.parent)}:{node.lineno} imports {what}" for what in found]
    return out


def test_no_module_imports_another_modules_private_name():
    files = sources(".")
    assert len(files) > 100
    assert [v for f in files for v in private_imports(f)] == []


@pytest.mark.parametrize("source, found", [
    ("from rldiag.scenario.plan import _plan\n", ["rldiag.scenario.plan._plan"]),
    ("def f():\n    from rldiag.doctor.rule import Rule, _same\n", ["rldiag.doctor.rule._same"]),
    ("from ._helpers import x\n", ["rldiag.app._helpers"]),
    ("import rldiag._private\n", ["rldiag._private"]),
    ("from __future__ import annotations\nfrom rldiag.version import __version__\n", []),
    ("from rldiag.scenario.plan import check_settings\n", []),
])
def test_every_private_import_is_seen(tmp_path, source, found):
    package = tmp_path / "rldiag"
    (package / "app").mkdir(parents=True)
    f = package / "app" / "page.py"
    f.write_text(source)
    assert [v.split(" imports ")[1] for v in private_imports(f, package)] == found


def test_no_top_level_module_is_named_like_an_api_function():
    top = {p.stem for p in PACKAGE.glob("*.py")} | {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert {"api", "scenario", "analysis"} <= top
    clash = sorted(top & (set(api.__all__) | set(RESERVED)))
    assert clash == []


def test_the_public_names_are_declared_once():
    lazy = set(api._LAZY)  # noqa: SLF001 - the module's own table, read by its test
    # each public name is defined in rldiag.api or one of those it resolves on first use
    assert lazy <= set(api.__all__)
    assert [n for n in api.__all__ if n not in lazy and n not in vars(api)] == []
    assert len(api.__all__) == len(set(api.__all__))
    assert rldiag.__all__ == ["__version__", *api.__all__]


def test_python_api_doc_lists_every_public_name():
    doc = (PACKAGE.parent / "docs" / "python-api.md").read_text()
    assert [n for n in api.__all__ if f"`{n}" not in doc] == []
