"""One colour convention for advantage across the app, in a real browser (Debian's chromium): on
the Step page (the heat strip's scale and the response text) and on the Rollouts page (the
transcript, also of a row the page's filter picks for its negative advantage), a positive advantage
is blue and a negative one red (rldiag.viz.colours); and the
Rollouts table fits a 1,400 px page (no horizontal scrolling inside it)."""

from __future__ import annotations

import re
import shutil

import pytest

from rldiag.scenario.recompute import recompute
from rldiag.viz.colours import NEGATIVE_RGB, POSITIVE_RGB
from rldiag.viz.runs import default_run
from rldiag.viz.serve import AppServer
from tests.app.helpers import launch_chromium, playwright_or_skip

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.xdist_group("browser")]

TIMEOUT_MS = 60_000
WIDTH = 1400
#: every coloured advantage token of the page: [value from its title, its background]
TOKENS = """(sel) => Array.from(document.querySelectorAll(sel))
    .map(s => [s.getAttribute('title') || '', getComputedStyle(s).backgroundColor])
    .filter(([t, bg]) => / · advantage -?[0-9.e+-]+$/.test(t) && bg !== 'rgba(0, 0, 0, 0)')
    .map(([t, bg]) => [parseFloat(t.split(' · advantage ')[1]), bg])"""


@pytest.fixture
def run(tmp_path):
    sample = default_run()
    if sample is None:
        pytest.skip("the bundled sample is not in this checkout")
    path = tmp_path / "run"
    shutil.copytree(sample, path, ignore=shutil.ignore_patterns("rldiag"))
    recompute(path, device="cpu", save_tokens=True)  # the per-token advantages both pages colour by
    return path


def _goto(pg, title: str) -> None:
    """Open a page from the sidebar; a click that lands while the page before is drawn again (the
    background baseline reporting in) is dropped by Streamlit, so it is made again until the page shows."""
    from playwright.sync_api import TimeoutError as Timeout

    for _ in range(4):
        pg.get_by_role("link", name=title).click()
        try:
            pg.get_by_role("heading", name=title, exact=True).wait_for(timeout=15_000)
            return
        except Timeout:
            continue
    pg.get_by_role("heading", name=title, exact=True).wait_for()


def _rgb(css: str) -> tuple[int, int, int]:
    r, g, b = (int(v) for v in re.findall(r"\d+", css)[:3])
    return r, g, b


def _signs_and_hues(pairs: list) -> set[tuple[bool, tuple[int, int, int]]]:
    """{(positive?, its rgb)} over the coloured tokens."""
    return {(v > 0, _rgb(bg)) for v, bg in pairs if v != 0}


def test_advantage_colours_agree_across_pages_and_the_rollouts_table_fits(run, tmp_path):
    sync_api = playwright_or_skip()
    with AppServer(run, log=tmp_path / "streamlit.log") as srv, sync_api.sync_playwright() as p:
        ctx = launch_chromium(p, tmp_path, WIDTH)
        try:
            pg = ctx.new_page()
            pg.set_default_timeout(TIMEOUT_MS)
            pg.goto(srv.url)
            pg.wait_for_selector('[data-testid="stEChartsChart"] svg')  # the run is open (the metrics page drawn)
            # the Step page: its response text coloured by advantage, and the heat strip's scale
            _goto(pg, "Step")
            pg.wait_for_selector(".rldiag-text span[title*='advantage']")
            step = pg.evaluate(TOKENS, ".rldiag-text span")
            legends = [pg.get_by_text(re.compile(r"^advantage: blue above 0, red below")).first.inner_text().split(";")[0]]
            # the heat strip is a Plotly figure drawn after the text: waited for, not read at once
            strip = pg.wait_for_function("""() => { for (const el of document.querySelectorAll('.js-plotly-plot'))
                for (const t of el.data || []) if (t.type === 'heatmap' && (t.y || [])[0] === 'advantage')
                    return [t.colorscale[0][1], t.colorscale[t.colorscale.length - 1][1], t.zmin, t.zmax];
                return null; }""").json_value()
            # the Rollouts page: the first row's transcript, coloured by advantage (the default)
            _goto(pg, "Rollouts")
            pg.get_by_text(re.compile(r"\d+ rows match")).first.wait_for()
            pg.wait_for_selector(".rldiag-transcript span.tok[title*='advantage']")
            rollouts = pg.evaluate(TOKENS, ".rldiag-transcript span.tok")
            legends.append(pg.get_by_text(re.compile(r"^advantage: blue above 0, red below")).first.inner_text()
                           .split(";")[0])
            # a row whose advantage is negative, picked with the page's own filter
            box = pg.get_by_role("textbox", name="Filter (SQL expression)")
            box.fill("advantage_mean < 0")
            box.press("Enter")
            pg.get_by_text("filter: (advantage_mean < 0)", exact=False).first.wait_for()
            pg.wait_for_function("""() => Array.from(document.querySelectorAll('.rldiag-transcript span.tok'))
                .some(s => / · advantage -[0-9]/.test(s.getAttribute('title') || ''))""")
            rollouts += pg.evaluate(TOKENS, ".rldiag-transcript span.tok")
            table = pg.evaluate("""() => { const d = document.querySelector('[data-testid="stDataFrame"]');
                const s = d.querySelector('.dvn-scroller') || d;
                return [d.getBoundingClientRect().right, s.scrollWidth, s.clientWidth]; }""")
            assert not pg.locator('[data-testid="stException"]').count()
        finally:
            ctx.close()
    # both pages: a positive advantage blue, a negative one red (each page's row has one sign or both;
    # together they show both, and a sign on both pages has the same hue on both)
    blue, red = tuple(POSITIVE_RGB), tuple(NEGATIVE_RGB)
    for name, pairs in (("step", step), ("rollouts", rollouts)):
        got = _signs_and_hues(pairs)
        assert got and got <= {(True, blue), (False, red)}, (name, got)
    assert _signs_and_hues(step) | _signs_and_hues(rollouts) == {(True, blue), (False, red)}
    assert legends == ["advantage: blue above 0, red below"] * 2
    # the heat strip: red at its low end, blue at its high end, centred on 0
    assert strip is not None
    low, high, zmin, zmax = strip
    lr, lg, lb = _rgb(low)
    hr, hg, hb = _rgb(high)
    assert lr > lb and hb > hr and zmin == -zmax
    # the table fits the page: within 1,400 px, nothing to scroll sideways
    right, scroll, client = table
    assert right <= WIDTH and scroll <= client + 1, table
