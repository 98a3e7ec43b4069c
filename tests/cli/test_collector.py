"""The garbage collector around the process's own command (``main()`` without ``argv``): off
while the command's declared modules are imported, those objects frozen and the collector on for
the command's work, everything frozen at its end; ``main(argv)`` (tests, other programs) leaves
the collector alone. Each case runs in a process of its own: a freeze is for the process."""

from __future__ import annotations

import gc
import importlib

import pytest

from rldiag.cli.main import COMMAND_MODULES
from tests.cli.conftest import child_output


@pytest.mark.slow
def test_the_process_command_runs_with_the_collector_on_after_its_imports_frozen(small_run):
    run = small_run
    code = (
        "import gc, sys\n"
        "import rldiag.cli.cmd_recompute as cmd\n"
        "from rldiag.cli import main as m\n"
        "seen = {}\n"
        "real = cmd.run\n"
        "def run(args):\n"
        "    seen.update(enabled=gc.isenabled(), frozen=gc.get_freeze_count(), torch='torch' in sys.modules,\n"
        "                engine='rldiag.scenario.recompute' in sys.modules)\n"
        "    return real(args)\n"
        "run.__module__ = cmd.__name__\n"
        "cmd.run = run\n"
        f"sys.argv = ['rldiag', 'recompute', {str(run)!r}, '--no-reuse', '--name', 'a']\n"
        "code = m.main()\n"
        "print(code, seen['enabled'], seen['frozen'] > 100_000, seen['torch'], seen['engine'], gc.isenabled(),\n"
        "      gc.get_freeze_count() >= seen['frozen'])\n"
    )
    # the command's modules imported before it ran (torch among them), more than 100,000 objects
    # frozen out of the collector's passes, the collector on while it ran and after
    assert child_output(code).split()[-7:] == ["0", "True", "True", "True", "True", "True", "True"]


def test_main_with_argv_leaves_the_collector_alone():
    code = (
        "import gc\n"
        "from rldiag.cli.main import main\n"
        "before = gc.get_freeze_count()\n"
        "gc.disable()\n"
        "try:\n"
        "    main(['rows', '/nonexistent-run', '--step', '1'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(gc.isenabled(), gc.get_freeze_count() == before)\n"
    )
    assert child_output(code).split()[-2:] == ["False", "True"]


def test_declared_imports_are_modules_of_the_package():
    declared = {name for mod in COMMAND_MODULES for name in getattr(importlib.import_module(mod), "IMPORTS", ())}
    assert "rldiag.scenario.recompute" in declared
    for name in declared:
        assert importlib.util.find_spec(name) is not None, name
    assert gc.isenabled()  # importing the command modules here turned nothing off
