"""``rldiag app``: the command it runs, from any directory; ``rldiag demo --live``'s advice."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from rldiag.app import APP_SCRIPT
from rldiag.cli.main import main


def test_rldiag_app_runs_the_packaged_script(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.chdir(tmp_path)  # any directory: nothing is looked up relative to the checkout
    assert main(["app", "run", str(other), "--port", "8600", "--headless", "--print-command"]) == 0
    cmd = shlex.split(capsys.readouterr().out.strip())
    assert cmd[:5] == [sys.executable, "-m", "streamlit", "run", str(APP_SCRIPT)]
    assert APP_SCRIPT.is_file() and APP_SCRIPT.parent.name == "app" and APP_SCRIPT.parent.parent.name == "rldiag"
    assert cmd[cmd.index("--server.port") + 1] == "8600" and cmd[cmd.index("--server.headless") + 1] == "true"
    assert cmd[cmd.index("--") + 1:] == [str(run.resolve()), str(other.resolve())]


def test_rldiag_app_names_a_missing_run(tmp_path, capsys):
    assert main(["app", str(tmp_path / "nope"), "--print-command"]) == 1
    assert "nope: no such run directory" in capsys.readouterr().err


def test_the_checkout_entry_point_still_runs_the_app(app_run):
    """``streamlit run app/main.py -- RUN`` in a checkout: the thin entry point renders the packaged app."""
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "app" / "main.py"), default_timeout=90)
    at.session_state["run_path"] = str(app_run)
    at.run()
    assert not at.exception
    assert [t.value for t in at.title] == ["Training metrics"] and at.get("echarts_chart")
