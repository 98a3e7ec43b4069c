"""Serve the app on a local port, and find a local chromium to look at it (tests, bench).

``AppServer`` runs ``rldiag app RUN`` as a subprocess bound to 127.0.0.1 (or ``address``) on a
free port, without an access token unless given one (``token``: :attr:`AppServer.url` carries
it), waits until Streamlit's health endpoint answers, and stops it (its whole process group) on
exit. ``chromium_path`` finds Debian's chromium; ``CHROMIUM_ARGS`` are the flags a
headless chromium needs in a container.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str | None:
    """Debian's chromium if installed (``$RLDIAG_CHROMIUM`` first)."""
    for p in (os.environ.get("RLDIAG_CHROMIUM"), *CHROMIUM_CANDIDATES, shutil.which("chromium")):
        if p and Path(p).is_file() and os.access(p, os.X_OK):
            return p
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AppServer:
    """``with AppServer(run) as srv: srv.url`` -- the app on 127.0.0.1, stopped on exit."""

    def __init__(self, run: str | Path | None, port: int | None = None, timeout: float = 60.0,
                 extra_env: dict[str, str] | None = None, log: Path | None = None, *,
                 address: str | None = "127.0.0.1", token: str | None = None, extra_args: tuple[str, ...] = ()):
        self.run = run
        self.address = address  # None: rldiag app's default
        self.token = token
        self.extra_args = tuple(extra_args)
        self.port = port or free_port()
        self.timeout = timeout
        self.extra_env = extra_env or {}
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.ready_after = 0.0  # seconds from start until the health endpoint answered

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The app's address (with ``?token=T`` when it has a token)."""
        return self.base_url + (f"/?token={self.token}" if self.token else "")

    def command(self) -> list[str]:
        runs = [] if self.run is None else ([self.run] if isinstance(self.run, (str, Path)) else list(self.run))
        address = ["--address", self.address] if self.address else []
        token = ["--token", self.token] if self.token else ["--no-token"]
        return [sys.executable, "-m", "rldiag.cli.main", "app", *map(str, runs), "--port", str(self.port), *address,
                *token, "--headless", *self.extra_args]

    def __enter__(self) -> AppServer:
        env = dict(os.environ, **self.extra_env)
        out = open(self.log, "wb") if self.log else subprocess.DEVNULL
        self.started_at = time.perf_counter()
        self.proc = proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        try:
            self._wait_ready(proc)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"streamlit exited with {proc.returncode} (log: {self.log})")
            try:
                with urllib.request.urlopen(f"{self.base_url}/_stcore/health", timeout=1) as r:
                    if r.status == 200:
                        self.ready_after = time.perf_counter() - self.started_at
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"streamlit did not answer on {self.url} within {self.timeout} s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)

    def __exit__(self, *exc) -> None:
        self.stop()
