"""What `rldiag recompute` imports: every command's parser is built, but a command's heavy
dependencies are imported only when that command runs."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_recompute_command_imports_neither_the_store_nor_duckdb(tmp_path):
    """The store (duckdb, 0.1-0.2 s to import) serves `rldiag rows` and the app, not a recompute."""
    from rldiag.synth import SynthSpec, write_synth_run

    run = write_synth_run(tmp_path / "run", SynthSpec(steps=2, seed=1))
    code = (
        "import sys\n"
        "from rldiag.cli.main import main\n"
        f"code = main(['recompute', {str(run)!r}, '--no-reuse', '--name', 'a'])\n"
        "print(code, 'duckdb' in sys.modules, 'rldiag.store' in sys.modules, 'rldiag.cli.cmd_rows' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip().splitlines()[-1] == "0 False False True"  # the rows command's parser was built
