"""The app in a real browser: ``streamlit run`` on a free local port, driven by Debian's chromium.

The sample loads and a chart renders; lines appended to metrics.jsonl (a half-written one
included) appear without a reload; changing the estimator on the what-if page and recomputing
adds the scenario to its chart; every page renders. Screenshots of each page go to
``$RLDIAG_SCREENSHOTS`` (else the test's tmp dir).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from rldiag.synth import SynthSpec, write_synth_run
from rldiag.viz.runs import default_run
from rldiag.viz.serve import CHROMIUM_ARGS, AppServer, chromium_path

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHART = ".js-plotly-plot .main-svg"
TIMEOUT_MS = 45_000


@pytest.fixture
def browser_run(tmp_path):
    """A copy of the bundled sample (never the sample itself: the test appends to it)."""
    sample = default_run()
    run = tmp_path / "run"
    if sample is not None:
        shutil.copytree(sample, run, ignore=shutil.ignore_patterns("rldiag"))
    else:
        write_synth_run(run, SynthSpec(steps=8, seed=2))
    return run


@pytest.fixture
def app_page(browser_run, tmp_path):
    exe = chromium_path()
    if exe is None:
        pytest.skip("chromium is not installed (apt-get install chromium); CI installs it")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with AppServer(browser_run, log=tmp_path / "streamlit.log") as srv, sync_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            tempfile.mkdtemp(prefix="chromium-", dir=tmp_path), executable_path=exe, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000},
        )
        try:
            pg = ctx.new_page()
            pg.set_default_timeout(TIMEOUT_MS)
            pg.goto(srv.url)
            yield pg
        finally:
            ctx.close()


def _shots(tmp_path) -> Path:
    d = Path(os.environ.get("RLDIAG_SCREENSHOTS") or tmp_path / "screenshots")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _shoot(pg, path: Path) -> None:
    """The whole page: Streamlit scrolls inside its main block, so the viewport is grown to fit it."""
    height = pg.evaluate("() => document.querySelector('[data-testid=\"stMain\"]').scrollHeight")
    pg.set_viewport_size({"width": 1400, "height": min(int(height) + 40, 8000)})
    pg.wait_for_timeout(600)  # plotly re-lays out at the new size
    pg.screenshot(path=str(path))
    pg.set_viewport_size({"width": 1400, "height": 1000})


def _trace_names(pg, i: int = 0) -> list[str]:
    return pg.evaluate(f"() => Array.from(document.querySelectorAll('.js-plotly-plot')[{i}].data).map(t => t.name)")


# plotly keeps the arrays it was sent as typed binary; _fullData holds them decoded
LOGGED_X = "Array.from(document.querySelectorAll('.js-plotly-plot')[0]._fullData.filter(t => t.name === 'logged')[0].x)"


def _logged_x(pg) -> list[int]:
    return pg.evaluate(f"() => {LOGGED_X}")


def _goto(pg, title: str) -> None:
    pg.get_by_role("link", name=title).click()
    pg.get_by_role("heading", name=title).wait_for()


def _recompute_another_estimator(pg) -> str:
    """On the What-if page: pick an estimator other than the run's and press Recompute."""
    box = pg.get_by_role("combobox", name="Advantage estimator")
    target = "rloo" if box.input_value() != "rloo" else "grpo"
    box.click()
    pg.get_by_role("option", name=target, exact=True).click()
    pg.get_by_text(f"adv_estimator={target}", exact=False).first.wait_for()
    pg.get_by_role("button", name="Recompute").click()
    return target


def test_pages_in_a_browser(app_page, browser_run, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    pg, shots = app_page, _shots(tmp_path)
    # 1. the sample loads and the metrics chart renders
    pg.wait_for_selector(CHART)
    latest = max(json.loads(line)["step"] for line in (browser_run / "metrics.jsonl").read_text().splitlines() if line)
    pg.get_by_text(f"Latest logged step {latest}", exact=False).wait_for()
    assert "logged" in _trace_names(pg)
    _shoot(pg, shots / "metrics.png")

    # 2. lines appended while training runs appear without a reload; a half-written one waits
    m = browser_run / "metrics.jsonl"
    with m.open("a") as fh:
        fh.write(json.dumps({"step": latest + 1, "data": {"critic/score/mean": 0.5, "actor/pg_clipfrac": 0.1}}) + "\n")
        fh.write(f'{{"step": {latest + 2}, "data": {{"critic/score/mean": 0.')
    pg.get_by_text(f"Latest logged step {latest + 1}", exact=False).wait_for()
    pg.wait_for_function(f"() => {LOGGED_X}.includes({latest + 1})")
    assert latest + 2 not in _logged_x(pg)
    with m.open("a") as fh:
        fh.write('25}}\n')
    pg.get_by_text(f"Latest logged step {latest + 2}", exact=False).wait_for()

    # 3. what-if: another estimator, recomputed; its scenario joins the chart
    _goto(pg, "What-if")
    pg.wait_for_selector(CHART)
    target = _recompute_another_estimator(pg)
    pg.wait_for_function(f"() => Array.from(document.querySelectorAll('.js-plotly-plot'))"
                         f".some(p => p.data.some(t => t.name === 'adv_estimator={target}'))", timeout=120_000)
    assert {"baseline", f"adv_estimator={target}"} <= set(_trace_names(pg))
    _shoot(pg, shots / "whatif.png")

    # 4. the other pages render
    _goto(pg, "Step")
    pg.wait_for_selector(CHART)
    pg.get_by_text("Debugging checklist", exact=False).first.wait_for()
    _shoot(pg, shots / "step.png")
    _goto(pg, "Off-policy")
    pg.wait_for_selector(CHART)
    _shoot(pg, shots / "offpolicy.png")
    _goto(pg, "Health")
    pg.get_by_text("Rules without a finding").wait_for()
    links = pg.locator('[data-testid="stPageLink-NavLink"]')
    if links.count():  # a finding: its steps link to the Step page
        links.first.wait_for()
        _shoot(pg, shots / "health.png")
        step = links.first.inner_text().split()[-1]  # "<icon> step N"
        links.first.click()
        pg.get_by_role("heading", name="Step").wait_for()
        sync_api.expect(pg.get_by_role("combobox", name="Step", exact=True)).to_have_value(step)
    else:
        _shoot(pg, shots / "health.png")
    assert not pg.locator('[data-testid="stException"]').count()


def _browser(tmp_path, sync_api, p):
    exe = chromium_path()
    ctx = p.chromium.launch_persistent_context(
        tempfile.mkdtemp(prefix="chromium-", dir=tmp_path), executable_path=exe, headless=True,
        args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000},
    )
    pg = ctx.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    return ctx, pg


@pytest.fixture
def browser_env(tmp_path):
    if chromium_path() is None:
        pytest.skip("chromium is not installed (apt-get install chromium); CI installs it")
    return pytest.importorskip("playwright.sync_api", reason="playwright is not installed")


def test_picker_sample_click_to_step_and_cancel(browser_env, tmp_path):
    """No run: the picker opens the bundled sample as a copy; a click on a point opens its step;
    a recompute cancelled in the middle publishes nothing."""
    sync_api = browser_env
    home = tmp_path / "home"
    with AppServer(None, log=tmp_path / "streamlit.log", extra_env={"RLDIAG_HOME": str(home)}) as srv, \
            sync_api.sync_playwright() as p:
        ctx, pg = _browser(tmp_path, sync_api, p)
        try:
            pg.goto(srv.url)
            pg.get_by_text("No run is open", exact=False).wait_for()
            pg.get_by_role("button", name="Open the bundled sample", exact=False).click()
            pg.wait_for_selector(CHART)
            copy = home / "samples" / default_run().name
            assert (copy / "batches").is_dir()
            # a click on a panel's line opens that step on the Step page
            plot = pg.locator(".js-plotly-plot").first
            box = plot.locator(".nsewdrag").first.bounding_box()
            pg.mouse.click(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)
            pg.get_by_role("heading", name="Step").wait_for()
            step = pg.get_by_role("combobox", name="Step", exact=True).input_value()
            assert step.isdigit() and f"step={step}" in pg.url
            _goto(pg, "What-if")
            target = _recompute_another_estimator(pg)
            pg.get_by_role("button", name="Cancel the recompute").click()
            # the 30-step sample may be recomputed before the click lands: the page must then say
            # so, and otherwise that nothing was written, and the run directory must agree
            note = pg.get_by_text("Cancelled:", exact=False).or_(pg.get_by_text("had finished before Cancel", exact=False))
            note.first.wait_for()
            written = (copy / "rldiag" / "scenarios" / f"adv_estimator={target}").exists()
            assert written == pg.get_by_text("had finished before Cancel", exact=False).is_visible()
            if written:
                assert (copy / "rldiag" / "scenarios" / f"adv_estimator={target}" / "scenario.json").is_file()
            assert not pg.locator('[data-testid="stException"]').count()
        finally:
            ctx.close()
