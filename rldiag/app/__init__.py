"""rldiag's app (Streamlit), shipped inside the package: ``rldiag app [RUN ...]``.

``main.py`` is the Streamlit script (``streamlit run`` runs it; the checkout's ``app/main.py``
is a thin entry point to it), ``views/`` the pages, ``session.py`` the glue they share, and
``samples/`` the bundled sample runs (never written: what rldiag computes for them goes to their
mirrors under ``$RLDIAG_HOME``), ``worker.py`` the baseline computed in the background on open.
Importing this package does not import Streamlit (the CLI builds the command without it).

``rldiag app`` serves the app in its own process, after :func:`preload`: the runs' logged
metrics are read into DuckDB and the heavy modules imported before the server answers, so the
first page shows its chart without waiting for them. The first page draws with ECharts
(:mod:`rldiag.viz.echarts`); the browser loads Streamlit's much larger plotly component only when
a page with a plotly chart is opened.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported with the package (the CLI builds the command without them)
    from rldiag.store import Store

#: the Streamlit script of the app
APP_SCRIPT = Path(__file__).resolve().parent / "main.py"
#: options every serving of the app gets (no usage stats; no watching the installed sources)
BASE_OPTIONS = ("--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none")

_preloaded: dict[str, Store] = {}  # run path -> its Store (with its own DuckDB connection)
_lock = threading.Lock()


def streamlit_options(port: int | None = None, address: str | None = None, headless: bool = False) -> list[str]:
    opts = list(BASE_OPTIONS)
    if headless:
        opts += ["--server.headless", "true"]
    if address:
        opts += ["--server.address", address]
    if port:
        opts += ["--server.port", str(int(port))]
    return opts


def streamlit_command(runs: Sequence[str | Path] = (), port: int | None = None, address: str | None = None,
                      headless: bool = False) -> list[str]:
    """The ``streamlit run`` command line that serves the app on ``runs``."""
    cmd = [sys.executable, "-m", "streamlit", "run", str(APP_SCRIPT), *streamlit_options(port, address, headless)]
    if runs:
        cmd += ["--", *(str(r) for r in runs)]
    return cmd


def preload(runs: Sequence[str | Path]) -> None:
    """Open the runs' stores (reading their logged metrics) in this process, and import the
    modules the pages need; the app's session picks them up instead of starting cold."""
    from rldiag.store import Store

    with _lock:
        for r in runs:
            key = str(r)
            if key not in _preloaded:
                store = Store(r)
                store.status()
                store.logged_names()
                _preloaded[key] = store
    # the pages' modules (plotly; torch for What-if, Step and Health), before the server answers:
    # imported later they would hold the interpreter while the first page is drawn
    from rldiag import api

    api.warm_up()
    import rldiag.viz.charts  # noqa: F401
    import rldiag.viz.comparison  # noqa: F401
    import rldiag.viz.echarts  # noqa: F401
    import rldiag.viz.health  # noqa: F401


def start_baselines() -> None:
    """Start the background baseline (:mod:`rldiag.app.worker`) of each preloaded run that rldiag
    may write for: ``rldiag app RUN`` begins its work while the server starts, not when the first
    page asks (a page then finds it done, or under way)."""
    from rldiag.app import worker
    from rldiag.viz import runs as run_list

    if worker.MODE != "thread":
        return
    with _lock:
        stores = list(_preloaded.values())
    for store in stores:
        if run_list.writable(store.run):
            worker.worker_for(store).ensure()


def preloaded_store(path: str) -> Store | None:
    return _preloaded.get(str(path))


def serve(runs: Sequence[str | Path], port: int | None = None, address: str | None = None,
          headless: bool = False) -> int:
    """Serve the app in this process (blocks until the server stops)."""
    from streamlit.web import cli as stcli

    from rldiag.app import memory, worker

    memory.limit_arenas()  # before the server's threads: each could keep an arena of its own
    preload(runs)
    worker.prepare()  # the background baseline's fork server imports its modules while the server starts
    start_baselines()
    argv = ["streamlit", "run", str(APP_SCRIPT), *streamlit_options(port, address, headless)]
    if runs:
        argv += ["--", *(str(r) for r in runs)]
    old = sys.argv
    sys.argv = argv
    try:
        stcli.main(prog_name="streamlit")
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        sys.argv = old
    return 0
