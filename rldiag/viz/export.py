"""Figures saved as PNG or SVG: :func:`save_figure`, for plotly figures from Python and notebooks.

plotly writes images through kaleido (the ``app`` extra), which drives an installed Chromium over
the DevTools protocol; nothing is downloaded. :func:`browser_path` finds it: ``$BROWSER_PATH``
(kaleido's own variable), ``$RLDIAG_CHROMIUM``, else Debian's ``chromium`` (or Chrome) on the
machine. Without kaleido or a browser, :class:`~rldiag.errors.ExportError` says exactly what to
install. The app's panels save themselves in the browser: plotly figures with their mode bar's
camera button, the ECharts panels with ECharts' own save-as-image tool (:mod:`rldiag.viz.echarts`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from rldiag.errors import ExportError

if TYPE_CHECKING:
    import plotly.graph_objects as go

#: the image formats :func:`save_figure` writes
FORMATS = ("png", "svg")
#: the browsers looked for, in order, when no variable names one
BROWSERS = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome", "/usr/bin/google-chrome-stable")
INSTALL_BROWSER = ("no Chromium to draw the image with: install Debian's chromium (`apt-get install chromium`), "
                   "or set BROWSER_PATH to a Chrome or Chromium executable")
INSTALL_KALEIDO = "saving figures needs kaleido: `pip install 'rldiag[app]'` (or `pip install kaleido`)"


def browser_path() -> str | None:
    """The Chromium kaleido will drive: ``$BROWSER_PATH``, ``$RLDIAG_CHROMIUM``, else the first of
    :data:`BROWSERS` (or ``chromium`` on ``PATH``) that is an executable file; None without one."""
    for p in (os.environ.get("BROWSER_PATH"), os.environ.get("RLDIAG_CHROMIUM"), *BROWSERS, shutil.which("chromium")):
        if p and Path(p).is_file() and os.access(p, os.X_OK):
            return p
    return None


#: kaleido's error when its tab evaluated before the page's script ran (:func:`save_figure`)
UNLOADED_PAGE = "kaleido_scopes is not defined"


def save_figure(fig: go.Figure, path: str | Path, *, width: int | None = None, height: int | None = None,
                scale: float = 1.0) -> Path:
    """Save ``fig`` as ``path`` (``.png`` or ``.svg``, by its suffix) and return the path. Raises
    :class:`~rldiag.errors.ExportError` naming what to install when kaleido or a Chromium is
    missing, or for another suffix."""
    out = Path(path)
    fmt = out.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise ExportError(f"{out}: save a figure as .png or .svg, not {out.suffix or 'a name without a suffix'}")
    try:
        import kaleido  # noqa: F401  (plotly's image writer)
    except ImportError:
        raise ExportError(INSTALL_KALEIDO) from None
    browser = browser_path()
    if browser is None:
        raise ExportError(INSTALL_BROWSER)
    os.environ.setdefault("BROWSER_PATH", browser)  # kaleido's choreographer starts this one
    out.parent.mkdir(parents=True, exist_ok=True)
    for attempt in (1, 2):
        try:
            fig.write_image(str(out), format=fmt, width=width, height=height, scale=scale)
            break
        except (OSError, RuntimeError, ValueError) as exc:
            # kaleido 1.x evaluates its call in a fresh Chromium tab that may not have run the
            # page's own script yet (its ``kaleido_scopes`` undefined): a race inside kaleido, seen
            # once in a loaded CI run; a second tab has the script. Any other error is final.
            if attempt == 1 and UNLOADED_PAGE in str(exc):
                continue
            raise ExportError(f"{out}: kaleido could not draw the figure with {browser}: {exc}") from exc
    return out
