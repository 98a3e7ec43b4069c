"""What `rldiag recompute` imports: every command's parser is built, but a command's heavy
dependencies are imported only when that command runs."""

from __future__ import annotations

import pytest

from tests.cli.conftest import child_output


@pytest.mark.slow
def test_recompute_command_imports_neither_the_store_nor_duckdb(small_run):
    """The store (duckdb, 0.1-0.2 s to import) serves `rldiag rows` and the app, not a recompute."""
    run = small_run
    code = (
        "import sys\n"
        "from rldiag.cli.main import main\n"
        f"code = main(['recompute', {str(run)!r}, '--no-reuse', '--name', 'a'])\n"
        "print(code, 'duckdb' in sys.modules, 'rldiag.store' in sys.modules, 'rldiag.cli.cmd_rows' in sys.modules)\n"
    )
    out = child_output(code)
    assert out.strip().splitlines()[-1] == "0 False False True"  # the rows command's parser was built


@pytest.mark.slow
def test_recompute_command_does_not_import_polars(small_run):
    """The summary is printed from the metrics' Arrow table: polars (about 0.15 s to import) is
    imported only when the API's `RecomputeResult.metrics` frame is read, and that frame holds
    the same steps and values as the table the command printed from."""
    run = small_run
    code = (
        "import sys\n"
        "from rldiag import api\n"
        "from rldiag.cli.main import main\n"
        f"code = main(['recompute', {str(run)!r}, '--no-reuse', '--name', 'a'])\n"
        "before = 'polars' in sys.modules\n"
        f"res = api.recompute({str(run)!r}, name='b', reuse=False)\n"
        "still = 'polars' in sys.modules\n"
        "frame = res.metrics\n"
        "same = frame.to_arrow().equals(res.metrics_table) and frame['step'].to_list() == [1, 2]\n"
        "print(code, before, still, 'polars' in sys.modules, same, res.metrics is frame)\n"
    )
    out = child_output(code)
    assert out.strip().splitlines()[-1] == "0 False False True True True"
