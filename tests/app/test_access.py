"""Serving the app safely (rldiag.app.access): the token, the shared mode's refused paths and its
read-only runs, in AppTest; ``rldiag app``'s address, token and roots on its command line; the
listening socket of a default ``rldiag app``, read from the socket table."""

from __future__ import annotations

import os
import shlex
import time
import urllib.request
from pathlib import Path

import pytest
from streamlit import config

from rldiag.app import access
from rldiag.cli.main import main
from rldiag.io.run_layout import READ_ONLY_VAR
from tests.app.helpers import open_app

TOKEN = "s3cret-token-for-tests"


def _shared(monkeypatch, token: str | None = TOKEN, roots: list[Path] = ()) -> None:
    config.set_option("server.address", "0.0.0.0")
    if token:
        monkeypatch.setenv(access.TOKEN_VAR, token)
    monkeypatch.setenv(access.ROOTS_VAR, os.pathsep.join(str(r) for r in roots))


def _named(monkeypatch, *runs: Path) -> None:
    """The runs named on the command line (``$RLDIAG_RUN``: AppTest's argv is pytest's)."""
    monkeypatch.setenv("RLDIAG_RUN", os.pathsep.join(str(r) for r in runs))


def _texts(at) -> str:
    return "\n".join(str(e.value) for kind in (at.error, at.info, at.markdown, at.caption, at.title) for e in kind)


def _files(run: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(run.rglob("*"))}


@pytest.mark.parametrize("address,loopback", [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LocalHost", True), ("0.0.0.0", False), ("::", False), ("", False), (None, False), ("10.1.2.3", False),
    ("myhost", False), ("localhost.example.com", False),
])
def test_loopback_addresses(address, loopback):
    assert access.is_loopback(address) is loopback


def test_token_comparison_and_url():
    assert access.token_matches(TOKEN, TOKEN)
    assert not access.token_matches(TOKEN[:-1], TOKEN) and not access.token_matches("", TOKEN)
    assert not access.token_matches(None, TOKEN)
    assert access.url_with_token("http://127.0.0.1:8501", "T") == "http://127.0.0.1:8501/?token=T"
    assert access.url_with_token("http://127.0.0.1:8501", None) == "http://127.0.0.1:8501"
    assert len({access.new_token() for _ in range(5)}) == 5


def test_shared_policy_allows_named_runs_and_roots_only(tmp_path):
    root, named, outside = tmp_path / "root", tmp_path / "named", tmp_path / "outside"
    for d in (root / "a", named, outside):
        d.mkdir(parents=True)
    (root / "escape").symlink_to(outside)
    acc = access.access_from("0.0.0.0", [str(named)], {access.ROOTS_VAR: str(root)})
    assert acc.shared
    assert acc.allows(named) and acc.allows(root / "a") and acc.allows(str(root / "a" / ".." / "a"))
    assert not acc.allows(outside) and not acc.allows("/etc") and not acc.allows(root / "escape")
    assert not acc.allows(str(root / ".." / "outside")) and not acc.allows("s3://bucket/run") and not acc.allows("")
    assert access.access_from("127.0.0.1", []).allows("/etc")  # loopback: any path, as before
    msg = acc.refusal("/etc")
    assert "/etc" in msg and str(named) not in msg and str(root) not in msg


def test_a_token_is_asked_for_and_no_run_data_drawn_without_it(app_run, monkeypatch):
    monkeypatch.setenv(access.TOKEN_VAR, TOKEN)
    at = open_app(app_run)
    assert [t.value for t in at.title] == ["rldiag"] and not at.get("echarts_chart")
    assert str(app_run) not in _texts(at) and "access token" in _texts(at)
    at.text_input(key="access_token_box").input("wrong").run()
    assert "not this app's token" in _texts(at) and not at.get("echarts_chart")
    at.text_input(key="access_token_box").input(TOKEN).run()
    assert [t.value for t in at.title] == ["Training metrics"] and at.get("echarts_chart")


def test_the_token_in_the_url_lets_the_session_in_for_good(app_run, monkeypatch):
    monkeypatch.setenv(access.TOKEN_VAR, TOKEN)
    from streamlit.testing.v1 import AppTest

    from tests.app.helpers import APP

    at = AppTest.from_file(str(APP), default_timeout=90)
    at.session_state["run_path"] = str(app_run)
    at.query_params["token"] = TOKEN
    at.run()
    assert not at.exception and [t.value for t in at.title] == ["Training metrics"]
    at.switch_page("views/step.py").run()  # a page link drops the URL's token: the session keeps it
    assert not at.exception and [t.value for t in at.title] == ["Step"]


def test_shared_without_a_token_serves_nothing_and_says_how(app_run, monkeypatch):
    _shared(monkeypatch, token=None)
    _named(monkeypatch, app_run)
    at = open_app(app_run)
    assert not at.get("echarts_chart") and str(app_run) not in _texts(at)
    assert access.TOKEN_VAR in _texts(at) and "--token" in _texts(at)


def test_shared_refuses_paths_outside_the_served_runs(app_run, monkeypatch, tmp_path, rldiag_home):
    _shared(monkeypatch)
    _named(monkeypatch, app_run)
    from rldiag.viz.runs import remember_run

    remember_run(tmp_path)  # a recent run of the server's user: never listed in shared mode
    at = open_app("/etc", **{"access_granted": True})
    text = _texts(at)
    assert "/etc: this app is shared" in text and not at.get("echarts_chart")
    assert "Recent runs" not in text and str(tmp_path) not in [b.label for b in at.button]
    assert [b.label for b in at.button if b.key.startswith("pk_served_")] == [str(app_run.resolve())]
    assert not any(b.key == "pk_sample" for b in at.button)
    # the URL's ?run= is the same path
    from streamlit.testing.v1 import AppTest

    from tests.app.helpers import APP

    at = AppTest.from_file(str(APP), default_timeout=90)
    at.query_params.update(token=TOKEN, run="/etc/../etc")
    at.run()
    assert not at.exception and "this app is shared" in _texts(at) and not at.get("echarts_chart")


def test_shared_opens_a_named_run_read_only(app_run, monkeypatch, rldiag_home):
    _shared(monkeypatch)
    _named(monkeypatch, app_run)
    before = _files(app_run)
    at = open_app(app_run, access_granted=True, other_runs="/etc")
    assert [t.value for t in at.title] == ["Training metrics"] and at.get("echarts_chart")
    assert "/etc: this app is shared" in _texts(at)  # the overlay list refuses too
    assert "Shared mode" in _texts(at) and os.environ[READ_ONLY_VAR].split(os.pathsep)[-1] == "/"
    assert _files(app_run) == before  # nothing written into the run
    assert (rldiag_home / "runs").is_dir()  # the baseline went to its mirror


def test_shared_opens_runs_under_a_root(app_run, monkeypatch, tmp_path):
    _shared(monkeypatch, roots=[app_run.parent])
    _named(monkeypatch)
    at = open_app(app_run, access_granted=True)
    assert [t.value for t in at.title] == ["Training metrics"] and at.get("echarts_chart")


def test_rldiag_app_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(access.TOKEN_VAR, raising=False)
    run = tmp_path / "run"
    run.mkdir()
    assert main(["app", str(run), "--print-command"]) == 0
    cmd = shlex.split(capsys.readouterr().out.strip())
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1"
    assert main(["app", str(run), "--address", "0.0.0.0", "--root", str(tmp_path), "--print-command"]) == 0
    cmd = shlex.split(capsys.readouterr().out.strip())
    env = dict(a.split("=", 1) for a in cmd[1:cmd.index("-m") - 1])
    assert cmd[0] == "env" and len(env[access.TOKEN_VAR]) >= 32 and env[access.ROOTS_VAR] == str(tmp_path.resolve())
    assert env[READ_ONLY_VAR].split(os.pathsep)[-1] == "/"
    assert main(["app", str(run), "--address", "0.0.0.0", "--token", "T", "--print-command"]) == 0
    assert f"{access.TOKEN_VAR}=T" in capsys.readouterr().out
    for extra in ([], ["--print-command"]):
        assert main(["app", str(run), "--address", "0.0.0.0", "--no-token", *extra]) == 1
        assert "--no-token: 0.0.0.0 is not a loopback address" in capsys.readouterr().err
    assert main(["app", str(run), "--address", "0.0.0.0", "--root", str(tmp_path / "nope"), "--print-command"]) == 1


def _listening(port: int) -> list[str]:
    """The local addresses of the sockets listening on ``port``, from the kernel's socket table
    (``/proc/net/tcp`` and ``tcp6``: state 0A is LISTEN; addresses in hex, 32-bit words in host order)."""
    import ipaddress
    import struct

    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            host, hport = local.split(":")
            if state != "0A" or int(hport, 16) != port:
                continue
            raw = bytes.fromhex(host)
            words = b"".join(struct.pack("=I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, len(raw), 4))
            out.append(str(ipaddress.ip_address(words)))
    return out


def _wait_listening(port: int, timeout: float = 90.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = _listening(port)
        if got:
            return got
        time.sleep(0.2)
    return []


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="no /proc/net/tcp (not Linux)")
def test_a_default_rldiag_app_listens_on_loopback_only(tmp_path):
    from rldiag.viz.serve import AppServer

    run = tmp_path / "run"
    run.mkdir()
    with AppServer(run, address=None, token=TOKEN, log=tmp_path / "streamlit.log") as srv:
        bound = _wait_listening(srv.port)
        assert bound and all(access.is_loopback(a) for a in bound), bound
        with urllib.request.urlopen(f"{srv.base_url}/_stcore/health", timeout=5) as r:
            assert r.status == 200
    log = (tmp_path / "streamlit.log").read_text()
    assert f"http://127.0.0.1:{srv.port}/?token={TOKEN}" in log and "Network URL" not in log
