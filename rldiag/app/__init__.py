"""rldiag's app (Streamlit), shipped inside the package: ``rldiag app [RUN ...]``.

``main.py`` is the Streamlit script (``streamlit run`` runs it; the checkout's ``app/main.py``
is a thin entry point to it), ``views/`` the pages, ``session.py`` the glue they share, and
``samples/`` the bundled sample runs (read-only: the app opens a user-writable copy of them).
Importing this package does not import Streamlit (the CLI builds the command without it).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

#: the Streamlit script of the app
APP_SCRIPT = Path(__file__).resolve().parent / "main.py"


def streamlit_command(runs: Sequence[str | Path] = (), port: int | None = None, address: str | None = None,
                      headless: bool = False, extra: Sequence[str] = ()) -> list[str]:
    """The command line that serves the app on ``runs`` (``python -m streamlit run <script> ... -- RUN...``)."""
    cmd = [sys.executable, "-m", "streamlit", "run", str(APP_SCRIPT), "--browser.gatherUsageStats", "false"]
    if headless:
        cmd += ["--server.headless", "true"]
    if address:
        cmd += ["--server.address", address]
    if port:
        cmd += ["--server.port", str(int(port))]
    cmd += list(extra)
    if runs:
        cmd += ["--", *(str(r) for r in runs)]
    return cmd
