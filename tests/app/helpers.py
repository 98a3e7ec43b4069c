"""Helpers of the app tests: open a page in Streamlit's AppTest, read its plotly figures and
ECharts panels, and write logged metrics as a trainer would."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from streamlit.testing.v1 import AppTest

APP = Path(__file__).resolve().parents[2] / "rldiag" / "app" / "main.py"


def fresh_sample(tmp_path: Path) -> Path:
    """A copy of the bundled sample without its outputs, as a new user opens it (the test is
    skipped in a checkout without the sample)."""
    import shutil

    import pytest

    from rldiag.viz.runs import default_run

    sample = default_run()
    if sample is None:
        pytest.skip("no bundled sample in this checkout")
    run = tmp_path / "run"
    shutil.copytree(sample, run, ignore=shutil.ignore_patterns("rldiag"))
    return run


def logged_from_scenario(run: Path, scenario: str = "baseline", steps=None, extra: dict | None = None) -> list[str]:
    """metrics.jsonl lines in verl's form, as a trainer would have logged them: the scenario's
    metrics nudged by 1% (so logged and recomputed lines differ), plus ``extra`` metrics."""
    t = pq.read_table(run / "rldiag" / "scenarios" / scenario / "metrics.parquet").to_pydict()
    lines = []
    for i, step in enumerate(t["step"]):
        if steps is not None and step not in steps:
            continue
        data = {k: v * 1.01 for k, v in ((k, t[k][i]) for k in t if k != "step") if v is not None and v == v}
        data.update(extra or {})
        lines.append(json.dumps({"step": step, "data": data}))
    return lines


def open_app(run: Path | str | None, page: str | None = None, **state) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=90)
    if run is not None:
        at.session_state["run_path"] = str(run)
    for k, v in state.items():
        at.session_state[k] = v
    at.run()
    if page:
        at.switch_page(page).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def request_sent_now(at: AppTest):
    """A request the browser sends now (every widget's state as the page stands), delivered when
    the returned function is called: after other runs, as a request still on its way is. Returns
    the AppTest after that run."""
    tree = at.main.root
    states = tree.get_widget_states()  # the values now: the tree's widgets read the session state later
    tree.get_widget_states = lambda: states
    return tree.run


def _decode(obj):
    """Plotly sends numpy arrays as ``{"dtype", "bdata"}`` (base64): back to lists for asserts."""
    if isinstance(obj, dict):
        if "bdata" in obj and "dtype" in obj:
            arr = np.frombuffer(base64.b64decode(obj["bdata"]), dtype=np.dtype(obj["dtype"]))
            if "shape" in obj:
                arr = arr.reshape([int(n) for n in str(obj["shape"]).split(",")])
            return arr.tolist()
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def charts(at: AppTest) -> list[dict]:
    """The page's plotly figures, as JSON with every array decoded to a list."""
    return [_decode(json.loads(el.proto.spec)) for el in at.get("plotly_chart")]


def trace_names(spec: dict) -> list[str]:
    return [t.get("name") for t in spec["data"]]


def subplot_titles(spec: dict) -> list[str]:
    return [a["text"] for a in spec["layout"].get("annotations", [])]


def panels(at: AppTest) -> dict[str, dict]:
    """The page's ECharts panels by metric (their title): each the option sent to the browser,
    with the chart's screen-reader description (the option's ``aria.label.description``) under
    ``"alt"``. No panel also passes Streamlit's ``alt=``: with both set, Streamlit logs a warning with
    a stack trace on every render."""
    out = {}
    for el in at.get("echarts_chart"):
        spec = json.loads(el.proto.spec)
        assert not el.proto.alt, f"panel {spec['title']['text']!r} sets alt= and aria.label.description"
        spec["alt"] = spec["aria"]["label"]["description"]
        out[spec["title"]["text"]] = spec
    return out


def series_names(spec: dict) -> list[str]:
    return [s["name"] for s in spec["series"]]


def series(spec: dict, name: str) -> dict:
    """The one series of the panel named ``name``."""
    (found,) = [s for s in spec["series"] if s["name"] == name]
    return found


def xs(spec: dict, name: str) -> list:
    return [p[0] for p in series(spec, name)["data"]]


def ys(spec: dict, name: str) -> list:
    return [p[1] for p in series(spec, name)["data"]]


def launch_chromium(playwright, tmp_path: Path, width: int = 1400):
    """Debian's chromium (``rldiag.viz.serve.chromium_path``) under Playwright: headless, its own
    profile under ``tmp_path``, a ``width`` x 1,000 viewport; the persistent context (close it)."""
    import tempfile

    from rldiag.viz.serve import CHROMIUM_ARGS, chromium_path

    return playwright.chromium.launch_persistent_context(
        tempfile.mkdtemp(prefix="chromium-", dir=tmp_path), executable_path=chromium_path(), headless=True,
        args=CHROMIUM_ARGS, viewport={"width": width, "height": 1000},
    )


def playwright_or_skip():
    """``playwright.sync_api``, the test skipped when chromium or playwright is not installed."""
    import pytest

    from rldiag.viz.serve import chromium_path

    if chromium_path() is None:
        pytest.skip("chromium is not installed (apt-get install chromium); CI installs it")
    return pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
