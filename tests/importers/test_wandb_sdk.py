"""The wandb SDK's life cycle in the importer: the wandb-core rldiag starts, and a shutdown that
cannot hang."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

from rldiag.errors import WandbMissingError
from rldiag.importers import wandb_sdk


@pytest.fixture
def no_started_service(monkeypatch):
    """No wandb-core started by rldiag before the test, and none left after it."""
    if wandb_sdk.started_service() is not None:  # one an earlier test left: ended first
        wandb_sdk.shutdown(deadline=5)
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    assert wandb_sdk.started_service() is None
    yield
    if wandb_sdk.started_service() is not None:
        monkeypatch.delitem(sys.modules, "wandb", raising=False)  # no teardown of a stand-in
        wandb_sdk.shutdown(deadline=1)


def _sleeper() -> subprocess.Popen:
    """A stand-in for wandb-core: a process in a session of its own, as wandb starts it."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _start_sleeper() -> subprocess.Popen:
    """start_service's stand-in starter: the sleeper, its token in WANDB_SERVICE as wandb saves it."""
    os.environ["WANDB_SERVICE"] = "token-of-rldiags-service"
    return _sleeper()


def test_shutdown_returns_although_wandbs_teardown_never_does(monkeypatch, no_started_service):
    release = threading.Event()
    entered = threading.Event()

    def stuck_teardown():
        entered.set()
        release.wait()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(teardown=stuck_teardown))
    wandb_sdk.start_service(_start_sleeper)
    core = wandb_sdk.started_service()
    assert core is not None and core.poll() is None
    try:
        wandb_sdk.shutdown(deadline=0.2)
        assert entered.is_set()  # teardown was called ...
        assert not release.is_set()  # ... and is still waiting: shutdown did not wait for it
        assert core.poll() is not None  # the service was ended by its PID
        assert wandb_sdk.started_service() is None
    finally:
        release.set()
        if core.poll() is None:
            core.kill()
            core.wait()


def test_shutdown_swallows_wandbs_system_exit(monkeypatch, no_started_service):
    def exits():
        sys.exit(3)  # wandb's teardown exits with wandb-core's exit code

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(teardown=exits))
    wandb_sdk.shutdown(deadline=5)  # returns normally


def test_shutdown_restores_the_service_variable(monkeypatch, no_started_service):
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(teardown=lambda: None))
    wandb_sdk.start_service(_start_sleeper)
    core = wandb_sdk.started_service()
    assert os.environ["WANDB_SERVICE"] == "token-of-rldiags-service"
    wandb_sdk.start_service(_start_sleeper)  # once per process: the started one is kept
    assert wandb_sdk.started_service() is core
    wandb_sdk.shutdown()
    assert "WANDB_SERVICE" not in os.environ
    assert core.poll() is not None


def test_a_service_that_cannot_start_leaves_wandb_to_start_its_own(no_started_service):
    def fails():
        raise RuntimeError("wandb-core could not start")

    wandb_sdk.start_service(fails)
    assert wandb_sdk.started_service() is None and "WANDB_SERVICE" not in os.environ


def test_wandb_missing_is_said_when_starting_the_service(no_started_service):
    def missing():
        raise WandbMissingError("install wandb")

    with pytest.raises(WandbMissingError, match="install wandb"):
        wandb_sdk.start_service(missing)
    assert wandb_sdk.started_service() is None


def test_shutdown_without_wandb_is_a_no_op(monkeypatch, no_started_service):
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    wandb_sdk.shutdown()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="reads /proc/PID/fd")
def test_the_real_wandb_core_is_detached_from_our_output_and_ended(tmp_path, monkeypatch, no_started_service):
    pytest.importorskip("wandb")
    from .conftest import hermetic_env

    for k, v in hermetic_env(tmp_path).items():
        if k.startswith("WANDB_") or k == "HOME":
            monkeypatch.setenv(k, v)
    wandb_sdk.start_service()
    core = wandb_sdk.started_service()
    if core is None:
        pytest.skip("this wandb has no detached service (another version's internals)")
    try:
        assert os.environ.get("WANDB_SERVICE")  # wandb.Api connects to it as an external service
        for fd in (0, 1, 2):
            assert os.readlink(f"/proc/{core.pid}/fd/{fd}") == "/dev/null"
    finally:
        wandb_sdk.shutdown()
    assert core.poll() is not None
    assert "WANDB_SERVICE" not in os.environ


def test_a_known_service_is_left_alone(monkeypatch, no_started_service):
    monkeypatch.setenv("WANDB_SERVICE", "someone-elses")
    wandb_sdk.start_service()
    assert wandb_sdk.started_service() is None
    assert os.environ["WANDB_SERVICE"] == "someone-elses"


def test_after_shutdown_a_failing_wandb_thread_prints_no_stack_trace(monkeypatch, caplog):
    """Once rldiag has ended a wandb-core that did not answer, wandb's service finalizer thread
    fails to publish to it: that is a debug line, not a traceback under the import's error (seen
    on 4 of 6 runs of `import-wandb` against an unreachable server); other threads still reach
    the hook that was there before."""
    import logging
    import threading

    from rldiag.importers import wandb_sdk

    reported = []
    monkeypatch.setattr(threading, "excepthook", lambda args: reported.append(args.thread.name))
    wandb_sdk.quiet_wandb_threads()
    wandb_sdk.quiet_wandb_threads()  # idempotent: one wrapper

    def boom():
        raise ConnectionResetError("wandb-core is gone")

    with caplog.at_level(logging.DEBUG, logger="rldiag.importers.wandb_sdk"):
        for name in ("wandb-ServiceFinalizer", "trainer-thread"):
            t = threading.Thread(target=boom, name=name)
            t.start()
            t.join()
    assert reported == ["trainer-thread"]
    assert "wandb-ServiceFinalizer ended with ConnectionResetError: wandb-core is gone" in caplog.text
