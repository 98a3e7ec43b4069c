"""What a DuckDB connection of rldiag may touch: the directories of the runs it serves, nothing else.

Every connection the app and ``rldiag rows`` open (:class:`rldiag.store.Db`) is locked before
its first query with DuckDB's own settings (its guide "Securing DuckDB"), in this order:

1. ``temp_directory``: the connection's own scratch directory (where DuckDB spills, and where
   the store stages the new lines of ``metrics.jsonl``);
2. ``allowed_directories``: the run directories it serves (:func:`served_dirs`: the run, its
   ``batches/`` and ``rldiag/``, the directory ``metrics.jsonl`` is in, and its mirror under
   ``$RLDIAG_HOME``), and the scratch directory;
3. ``enable_external_access = false``: no file outside those directories can be read or written,
   no database attached, no extension installed or loaded;
4. ``lock_configuration = true``: no statement can change the settings back.

So whatever text reaches DuckDB (a ``--where`` filter that the filter checker of
:mod:`rldiag.store.rows` let through by mistake included), no expression can read or write a
file of another directory: DuckDB refuses it with a permission error. A file written into a
served directory after the connection opened (a live run's next step, a recompute's scenario) is
readable: the check is on the directory, when the file is opened. DuckDB resolves links before
it checks (the directories' and the files'), so a run reached through a link works, and a file
linked in from outside the served directories is refused. A run opened later gets a connection
of its own (:class:`~rldiag.store.Store` makes one per run).

Arrow tables handed to DuckDB (``register``) are not files and stay queryable.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import duckdb

from rldiag.io.run_layout import OUTPUT_DIR, RunLayout, mirror_dir


def served_dirs(run: str | os.PathLike) -> list[str]:
    """The directories the run's queries read, each resolved (links followed): the run, its
    ``batches/``, the directory of its ``metrics.jsonl`` (the file may be a link to a logger's
    directory), ``RUN/rldiag/`` and the run's mirror ``$RLDIAG_HOME/runs/<key>/`` (either may not
    exist yet)."""
    layout = RunLayout(Path(run))
    dirs = [Path(run), Path(layout.batches_dir), Path(os.path.realpath(layout.metrics_file)).parent,
            Path(run) / OUTPUT_DIR, mirror_dir(run)]
    out: list[str] = []
    for d in dirs:
        real = os.path.realpath(d)
        if real not in out:
            out.append(real)
    return out


def lock(con: duckdb.DuckDBPyConnection, dirs: Iterable[str | os.PathLike], scratch: str | os.PathLike) -> None:
    """Confine ``con`` to ``dirs`` and ``scratch`` (its temporary directory), then lock its
    settings (see the module's docstring). Afterwards no ``SET`` can undo it."""
    allowed = [os.path.realpath(d) for d in [*dirs, scratch]]
    con.execute("SET temp_directory = ?", [str(scratch)])
    con.execute("SET allowed_directories = ?", [allowed])
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
