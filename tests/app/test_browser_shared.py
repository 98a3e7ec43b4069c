"""The shared mode in a real browser: ``rldiag app RUN --address 0.0.0.0 --token T`` served on a
free port, driven by Debian's chromium. Without the token the page asks for it and shows no run
data; with it, ``?run=/etc`` is refused (and nothing of /etc is shown), the named run opens, and
nothing is written into it."""

from __future__ import annotations

import tempfile

import pytest

from rldiag.synth import SynthSpec, write_synth_run
from rldiag.viz.serve import CHROMIUM_ARGS, AppServer, chromium_path
from tests.app.test_browser import PANEL, TIMEOUT_MS, assert_no_stack_trace

# one after another in one test process of a parallel run: two servers and two browsers at once on
# two cores would slow each page past its wait
pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.xdist_group("browser")]

TOKEN = "a-token-for-the-browser-test"


def _files(run):
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(run.rglob("*"))}


def test_shared_mode_in_a_browser(tmp_path):
    exe = chromium_path()
    if exe is None:
        pytest.skip("chromium is not installed (apt-get install chromium); CI installs it")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=4, seed=3))
    before = _files(run)
    home = tmp_path / "home"
    log = tmp_path / "streamlit.log"
    with AppServer(run, log=log, address="0.0.0.0", token=TOKEN, extra_env={"RLDIAG_HOME": str(home)}) as srv, \
            sync_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(tempfile.mkdtemp(prefix="chromium-", dir=tmp_path),
                                                   executable_path=exe, headless=True, args=CHROMIUM_ARGS)
        try:
            pg = ctx.new_page()
            pg.set_default_timeout(TIMEOUT_MS)
            # no token: the page asking for it, nothing of the run
            pg.goto(f"{srv.base_url}/?run={run}")
            pg.get_by_text("asks for an access token", exact=False).wait_for()
            body = pg.inner_text("body")
            assert str(run) not in body and "Training metrics" not in body
            assert not pg.locator(PANEL).count()
            # the token, and a path outside the served runs: refused, nothing of it listed
            pg.goto(f"{srv.base_url}/?token={TOKEN}&run=/etc")
            pg.get_by_text("/etc: this app is shared", exact=False).wait_for()
            pg.get_by_role("button", name=str(run)).wait_for()  # the picker lists the served run only
            body = pg.inner_text("body")
            assert "passwd" not in body and "hosts" not in body  # nothing of /etc is listed
            assert "Recent runs" not in body and "bundled sample" not in body
            assert not pg.locator(PANEL).count()
            # the named run opens, read-only
            pg.goto(f"{srv.base_url}/?token={TOKEN}&run={run}")
            pg.wait_for_selector(PANEL)
            pg.get_by_text("Shared mode", exact=False).first.wait_for()
        finally:
            ctx.close()
    assert _files(run) == before
    text = log.read_text()
    assert f"/?token={TOKEN}" in text and "warning: serving the app on every interface" in text
    assert_no_stack_trace(log)
