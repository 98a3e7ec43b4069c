"""The app in a real browser: ``streamlit run`` on a free local port, driven by Debian's chromium.

The sample loads and a chart renders; lines appended to metrics.jsonl (a half-written one
included) appear without a reload; changing the estimator on the what-if page and recomputing
adds the scenario to its chart; every page renders (Off-policy with its mismatch diagnosis shown
without a click, Rollouts with its table). On a fresh copy of the sample, Step, Off-policy and
Health draw their content (from the baseline the app computes on open, in the background) without
any button pressed. Screenshots of each page go to ``$RLDIAG_SCREENSHOTS`` (else the test's tmp dir).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from rldiag.io.run_layout import mirror_dir
from rldiag.synth import SynthSpec, write_synth_run
from rldiag.viz.charts import LOGGED_COLOUR
from rldiag.viz.echarts import GRID_TOP
from rldiag.viz.runs import default_run
from rldiag.viz.serve import AppServer, chromium_path
from tests.app.helpers import launch_chromium, playwright_or_skip

# one after another in one test process of a parallel run: two servers and two browsers at once on
# two cores would slow each page past its wait
pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.xdist_group("browser")]

CHART = ".js-plotly-plot .main-svg"  # the other pages' plotly charts
#: a metrics panel (ECharts, SVG) with its logged line drawn
PANEL = f'[data-testid="stEChartsChart"] svg path[stroke="{LOGGED_COLOUR}"]'
#: each metrics panel's description: "<metric>: logged steps a-b; <scenario> steps c-d"
PANEL_LABELS = ("Array.from(document.querySelectorAll('[data-testid=\"stEChartsChart\"]'))"
                ".map(c => c.getAttribute('aria-label') || '')")
TIMEOUT_MS = 45_000


#: what Python's logging and traceback modules print for a stack: none belongs in a normal session
STACK_MARKERS = ("Traceback (most recent call last)", "Stack (most recent call last)")


def assert_no_stack_trace(log: Path) -> None:
    """The app server's log (stdout and stderr) of a normal session holds no stack trace."""
    text = log.read_text(errors="replace")
    for marker in STACK_MARKERS:
        assert marker not in text, f"{log} holds a stack trace:\n{text[text.index(marker) - 400:][:3000]}"


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
    sync_api = playwright_or_skip()
    with AppServer(browser_run, log=tmp_path / "streamlit.log") as srv, sync_api.sync_playwright() as p:
        ctx = launch_chromium(p, tmp_path)
        try:
            pg = ctx.new_page()
            pg.set_default_timeout(TIMEOUT_MS)
            pg.goto(srv.url)
            yield pg
        finally:
            ctx.close()
    assert_no_stack_trace(tmp_path / "streamlit.log")


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


def _panel_labels(pg) -> list[str]:
    return pg.evaluate(f"() => {PANEL_LABELS}")


def _logged_range(pg, i: int = 0) -> tuple[int, int]:
    """Panel ``i``'s logged steps (first, last), once its description names them (a panel being
    drawn again can carry ECharts' own description for a moment)."""
    pg.wait_for_function(f"() => /logged steps \\d+-\\d+/.test({PANEL_LABELS}[{i}] || '')")
    found = re.search(r"logged steps (\d+)-(\d+)", _panel_labels(pg)[i])
    assert found, _panel_labels(pg)
    return int(found.group(1)), int(found.group(2))


def _logged_to(step: int) -> str:
    """JS: some panel draws logged values up to ``step``."""
    return f"() => {PANEL_LABELS}.some(l => /logged steps \\d+-{step}(;|$)/.test(l))"


def _baseline_drawn(pg, steps: int) -> None:
    """Until the background baseline (started when the run opened) is drawn on the panels for
    every one of the run's ``steps`` batch steps and its progress bar is gone: the page is drawn
    again when the baseline lands, and a chart drawn again drops a click or a drag in flight."""
    pg.wait_for_function(f"() => !document.querySelector('[data-testid=\"stProgress\"]') && "
                         f"{PANEL_LABELS}.some(l => /baseline steps 1-{steps}(;|$)/.test(l))")


def _click_a_point(pg) -> int:
    """Click the middle point of the first panel's logged line (its symbols are 6 px paths);
    the step it stands for, from the panel's description (the sample logs every step)."""
    # below the legend (whose icon is such a symbol too): inside the plotting area
    boxes = pg.evaluate(f"""() => {{ const svg = document.querySelector('[data-testid="stEChartsChart"] svg');
        const top = svg.getBoundingClientRect().y + {GRID_TOP - 8};
        return Array.from(svg.querySelectorAll('path[stroke="{LOGGED_COLOUR}"]')).map(p => p.getBoundingClientRect())
        .filter(r => r.width > 3 && r.width < 12 && r.height > 3 && r.height < 12 && r.y > top)
        .map(r => [r.x, r.y, r.width, r.height]); }}""")
    assert len(boxes) > 2, boxes
    first, last = _logged_range(pg)
    assert len(boxes) == last - first + 1, (boxes, first, last)
    x, y, w, h = sorted(boxes)[len(boxes) // 2]
    pg.mouse.move(x + w / 2, y + h / 2)
    pg.mouse.click(x + w / 2, y + h / 2)
    return first + len(boxes) // 2


def _brush(pg, start: float, end: float) -> None:
    """On the first panel: pick the toolbox's x-range brush (its first icon, top right) and drag
    over ``start``-``end`` of the panel's width."""
    icons = pg.evaluate("""() => { const svg = document.querySelector('[data-testid="stEChartsChart"] svg');
        const b = svg.getBoundingClientRect();
        return Array.from(svg.querySelectorAll('path')).map(p => p.getBoundingClientRect())
            .filter(r => r.width > 4 && r.width < 30 && r.y < b.y + 40 && r.x > b.x + b.width - 120)
            .map(r => [r.x, r.y, r.width, r.height]); }""")
    assert icons, "no toolbox icon"
    x, y, w, h = sorted(icons)[0]
    pg.mouse.click(x + w / 2, y + h / 2)
    box = pg.locator('[data-testid="stEChartsChart"] svg').first.bounding_box()
    mid = box["y"] + GRID_TOP + (box["height"] - GRID_TOP) / 2
    pg.mouse.move(box["x"] + box["width"] * start, mid)
    pg.mouse.down()
    pg.mouse.move(box["x"] + box["width"] * end, mid, steps=8)
    pg.mouse.up()


def _goto(pg, title: str) -> None:
    pg.get_by_role("link", name=title).click()
    pg.get_by_role("heading", name=title, exact=True).wait_for()  # the page's title, not a section of it


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
    # 1. the sample loads and the metrics panels render
    pg.wait_for_selector(PANEL)
    latest = max(json.loads(line)["step"] for line in (browser_run / "metrics.jsonl").read_text().splitlines() if line)
    pg.get_by_text(f"Latest logged step {latest}", exact=False).wait_for()
    pg.wait_for_function(_logged_to(latest))
    _shoot(pg, shots / "metrics.png")

    # 2. lines appended while training runs appear without a reload; a half-written one waits
    m = browser_run / "metrics.jsonl"
    with m.open("a") as fh:
        fh.write(json.dumps({"step": latest + 1, "data": {"critic/score/mean": 0.5, "actor/pg_clipfrac": 0.1}}) + "\n")
        fh.write(f'{{"step": {latest + 2}, "data": {{"critic/score/mean": 0.')
    pg.get_by_text(f"Latest logged step {latest + 1}", exact=False).wait_for()
    pg.wait_for_function(_logged_to(latest + 1))
    assert not any(f"-{latest + 2}" in label for label in _panel_labels(pg))
    with m.open("a") as fh:
        fh.write('25}}\n')
    pg.get_by_text(f"Latest logged step {latest + 2}", exact=False).wait_for()

    # 3. an x range brushed on a panel zooms every panel to those steps
    pg.wait_for_function(_logged_to(latest + 2))
    _baseline_drawn(pg, len(list((browser_run / "batches").iterdir())))
    _brush(pg, 0.35, 0.65)
    pg.wait_for_function(f"() => {PANEL_LABELS}.every(l => {{ const m = /logged steps (\\d+)-(\\d+)/.exec(l);"
                         f" return m && +m[1] > 1 && +m[2] < {latest + 2}; }})")
    first, last = _logged_range(pg)
    assert 1 < first < last < latest + 2, (first, last)
    sync_api.expect(pg.get_by_text(f"Latest logged step {latest + 2}", exact=False)).to_be_visible()

    # 4. what-if: another estimator, recomputed; its scenario joins the panels, and the compare's
    # per-step agreement (plotly) is drawn after it
    _goto(pg, "What-if")
    pg.wait_for_selector(PANEL)
    target = _recompute_another_estimator(pg)
    pg.wait_for_selector(CHART, timeout=120_000)
    # when the page's run has ended (its elements of the run before are gone), every panel has both
    pg.wait_for_function(f"() => {PANEL_LABELS}.length > 0 && {PANEL_LABELS}.every("
                         f"l => l.includes('baseline steps') && l.includes('adv_estimator={target} steps'))",
                         timeout=120_000)
    _shoot(pg, shots / "whatif.png")

    # 5. the other pages render
    _goto(pg, "Step")
    pg.wait_for_selector(CHART)
    pg.get_by_text("Debugging checklist", exact=False).first.wait_for()
    _shoot(pg, shots / "step.png")
    # every row of every step, in a table shown without a click (the what-if wrote the per-row tables)
    _goto(pg, "Rollouts")
    pg.get_by_text(re.compile(r"\d+ rows match")).first.wait_for()
    pg.wait_for_selector('[data-testid="stDataFrame"]')
    _shoot(pg, shots / "rollouts.png")
    _goto(pg, "Off-policy")
    # the mismatch diagnosis is computed on open, no click: its cause and confidence in view
    diagnosis = pg.get_by_text(re.compile(r"precision, confidence \d\.\d\d")).first
    diagnosis.wait_for()
    sync_api.expect(diagnosis).to_be_visible()
    sync_api.expect(pg.get_by_role("heading", name="Rollout vs trainer log-probs")).to_be_visible()
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
        pg.get_by_role("heading", name="Step", exact=True).wait_for()
        sync_api.expect(pg.get_by_role("combobox", name="Step", exact=True)).to_have_value(step)
    else:
        _shoot(pg, shots / "health.png")
    assert not pg.locator('[data-testid="stException"]').count()


def _browser(tmp_path, sync_api, p):
    ctx = launch_chromium(p, tmp_path)
    pg = ctx.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    return ctx, pg


@pytest.fixture
def browser_env(tmp_path):
    if chromium_path() is None:
        pytest.skip("chromium is not installed (apt-get install chromium); CI installs it")
    return pytest.importorskip("playwright.sync_api", reason="playwright is not installed")


def _tree(root: Path) -> list[tuple[str, int, int]]:
    """Every file and folder under ``root``: its path, size and modification time (what a write
    would change, a folder made and removed again included)."""
    return sorted((str(p.relative_to(root)), p.stat().st_size if p.is_file() else 0, p.stat().st_mtime_ns)
                  for p in [root, *root.rglob("*")])


def test_picker_sample_click_to_step_and_cancel(browser_env, tmp_path):
    """No run: the picker opens the bundled sample as a copy; a click on a point opens its step;
    a recompute cancelled in the middle publishes nothing."""
    sync_api = browser_env
    home = tmp_path / "home"
    # the bundled sample as it is now (a `make sample` before the tests leaves its own outputs there)
    before = _tree(default_run())
    with AppServer(None, log=tmp_path / "streamlit.log", extra_env={"RLDIAG_HOME": str(home)}) as srv, \
            sync_api.sync_playwright() as p:
        ctx, pg = _browser(tmp_path, sync_api, p)
        try:
            pg.goto(srv.url)
            pg.get_by_text("No run is open", exact=False).wait_for()
            pg.get_by_role("button", name="Open the bundled sample", exact=False).click()
            pg.wait_for_selector(PANEL)
            # the sample is opened where it is (inside the install, never written): its outputs go
            # to its mirror under $RLDIAG_HOME
            copy = mirror_dir(default_run(), env={"RLDIAG_HOME": str(home)})
            assert copy.parent == home / "runs" and (copy / "source.json").is_file()
            # a click on a point of a panel's line opens that step on the Step page
            _baseline_drawn(pg, len(list((default_run() / "batches").iterdir())))
            clicked = _click_a_point(pg)
            pg.get_by_role("heading", name="Step", exact=True).wait_for()
            step = pg.get_by_role("combobox", name="Step", exact=True).input_value()
            assert step == str(clicked) and f"step={step}" in pg.url
            _goto(pg, "What-if")
            target = _recompute_another_estimator(pg)
            pg.get_by_role("button", name="Cancel the recompute").click()
            # the 30-step sample may be recomputed before the click lands: the page must then say
            # so, and otherwise that nothing was written, and the run directory must agree
            note = pg.get_by_text("Cancelled:", exact=False).or_(pg.get_by_text("had finished before Cancel", exact=False))
            note.first.wait_for()
            written = (copy / "scenarios" / f"adv_estimator={target}").exists()
            assert written == pg.get_by_text("had finished before Cancel", exact=False).is_visible()
            if written:
                assert (copy / "scenarios" / f"adv_estimator={target}" / "scenario.json").is_file()
            assert _tree(default_run()) == before  # the app wrote nothing into the bundled sample
            assert not pg.locator('[data-testid="stException"]').count()
        finally:
            ctx.close()
    assert_no_stack_trace(tmp_path / "streamlit.log")


def test_a_fresh_copy_draws_every_page_without_a_click(browser_env, browser_run, tmp_path):
    """As a new user: ``rldiag app`` on a fresh copy of the sample, straight to Step, Off-policy
    and Health (and Rollouts where the app has it): each draws its content, with the baseline's
    values, and no button is pressed; the baseline the app computed in the background is on disk."""
    sync_api = browser_env
    from rldiag.app.main import PAGES

    with AppServer(browser_run, log=tmp_path / "streamlit.log") as srv, sync_api.sync_playwright() as p:
        ctx, pg = _browser(tmp_path, sync_api, p)
        try:
            pg.goto(srv.url + "/step")
            pg.get_by_role("heading", name="Step", exact=True).wait_for()
            pg.get_by_text("advantage · baseline", exact=False).first.wait_for()  # the groups chart's legend
            pg.get_by_text("Debugging checklist", exact=False).first.wait_for()
            pg.wait_for_selector(CHART)
            _goto(pg, "Off-policy")
            pg.get_by_text(re.compile(r"precision, confidence \d\.\d\d")).first.wait_for(timeout=120_000)
            pg.wait_for_selector(CHART)
            _goto(pg, "Health")
            # the doctor with the baseline's signals: every sample step recomputed
            pg.get_by_text(re.compile(r"over \d+ logged and 30 recomputed steps")).first.wait_for(timeout=120_000)
            pg.get_by_text("Rules without a finding").wait_for()
            if any(u == "rollouts" for *_, u in PAGES):
                _goto(pg, "Rollouts")
                pg.wait_for_selector('[data-testid="stDataFrame"], ' + CHART)
            assert not pg.locator('[data-testid="stException"]').count()
            assert (browser_run / "rldiag" / "scenarios" / "baseline" / "scenario.json").is_file()
        finally:
            ctx.close()
    assert_no_stack_trace(tmp_path / "streamlit.log")
