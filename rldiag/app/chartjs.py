"""Have the browser load Streamlit's plotly component with the page, not after the first chart.

Streamlit loads its plotly component (``static/js/PlotlyChart.<hash>.js``, about 4.5 MB of
JavaScript) only when the first chart arrives over the websocket; then the browser fetches,
compiles and runs it before it draws: most of the time from page load to the first chart.
``rldiag app`` serves Streamlit's static files from a directory of links to them
(:func:`install`) whose ``index.html`` also names the component: a ``modulepreload`` (fetched
and compiled with the page's own scripts) and an ``import()`` run after Streamlit's main script,
so the component is running while the server computes the page. Streamlit's own import of it
later finds the module loaded (the browser runs a module once per URL). Where the component
cannot be found (another Streamlit) nothing changes.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from pathlib import Path

_MAIN = re.compile(r'<script type="module" crossorigin src="\./static/js/index\.[^"]+\.js"></script>')


def component_file(static: Path) -> str | None:
    """The file name of the plotly component in a Streamlit static directory (None: not one)."""
    found = sorted((static / "static" / "js").glob("PlotlyChart.*.js"))
    return found[0].name if len(found) == 1 else None


def with_preload(index_html: str, component: str) -> str | None:
    """``index.html`` with the component preloaded and imported after Streamlit's main script;
    None when the main script's tag is not where it is expected."""
    m = _MAIN.search(index_html)
    if m is None:
        return None
    url = f"./static/js/{component}"
    extra = (f'\n    <link rel="modulepreload" crossorigin href="{url}">'
             f'\n    <script type="module">import("{url}").catch(() => {{}});</script>')
    return index_html[: m.end()] + extra + index_html[m.end():]


def preload_dir(static: Path, dest: Path) -> Path | None:
    """Build in ``dest`` a static directory of links to ``static``'s entries with the preloading
    ``index.html``; None (and ``dest`` left empty) when the component or the tag is not found."""
    component = component_file(static)
    html = with_preload((static / "index.html").read_text(encoding="utf-8"), component) if component else None
    if html is None:
        return None
    dest.mkdir(parents=True, exist_ok=True)
    for entry in static.iterdir():
        if entry.name != "index.html":
            os.symlink(entry, dest / entry.name)
    (dest / "index.html").write_text(html, encoding="utf-8")
    return dest


def install() -> Path | None:
    """Serve this process's Streamlit from a preloading static directory (a temporary one,
    removed at exit); the directory, or None where Streamlit's files are not as expected."""
    from streamlit import file_util

    static = Path(file_util.get_static_dir())
    tmp = Path(tempfile.mkdtemp(prefix="rldiag-static-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    try:
        built = preload_dir(static, tmp / "static")
    except OSError:
        built = None
    if built is not None:
        file_util.get_static_dir = lambda: str(built)
    return built
