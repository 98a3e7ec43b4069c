"""The optional ``wandb`` package, imported lazily and quietly.

Everything that touches the SDK goes through here so that

- a missing ``wandb`` gives one clear error (``pip install 'rldiag[wandb]'``);
- wandb's error reporting (Sentry) is off in the importer's process, so a failed import never
  waits at exit on a report that cannot be sent;
- the wandb-core service the public API talks to is one rldiag starts itself (:func:`start_service`),
  detached from the caller's stdout and stderr, and :func:`shutdown` ends it within a deadline:
  wandb's own teardown waits without a limit for a wandb-core that may still be retrying a
  request rldiag gave up on;
- no message rldiag shows can carry the API key.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from rldiag.errors import RldiagError, WandbMissingError

log = logging.getLogger(__name__)

INSTALL_HINT = "the W&B importer needs the optional wandb package: pip install 'rldiag[wandb]'"


def quiet_environment() -> None:
    """Settings for the importer's process, set before wandb is imported."""
    os.environ["WANDB_ERROR_REPORTING"] = "false"
    os.environ.setdefault("WANDB_SILENT", "true")


def load_wandb():
    """``import wandb`` with the importer's environment; a clear error when it is missing."""
    quiet_environment()
    try:
        import wandb
    except ImportError as exc:
        raise WandbMissingError(f"{INSTALL_HINT} ({exc})") from exc
    return wandb


def record_class():
    """wandb's ``Record`` protobuf message class (``wandb.proto.wandb_internal_pb2.Record``)."""
    load_wandb()
    try:
        from wandb.proto import wandb_internal_pb2
    except ImportError as exc:  # a wandb without the protobuf classes, or a protobuf mismatch
        raise WandbMissingError(f"cannot load wandb's protobuf classes ({exc}); {INSTALL_HINT}") from exc
    return wandb_internal_pb2.Record


def wandb_version() -> str | None:
    mod = sys.modules.get("wandb")
    return getattr(mod, "__version__", None) if mod is not None else None


#: Seconds :func:`shutdown` gives wandb's teardown, then the wandb-core process, before ending it.
SHUTDOWN_DEADLINE = 5.0

#: A wandb-core that rldiag started and lost track of (rldiag killed) exits after this idle time.
SERVICE_IDLE_TIMEOUT = "60s"

_SERVICE_ENV = "WANDB_SERVICE"
_started: subprocess.Popen | None = None
_env_before: str | None = None


def started_service() -> subprocess.Popen | None:
    """The wandb-core process :func:`start_service` started and :func:`shutdown` has not ended."""
    return _started


def _start_detached() -> subprocess.Popen:
    """Start wandb-core detached through wandb's internal ``service_process`` module and put its
    token in ``WANDB_SERVICE``. :class:`WandbMissingError` without wandb; any other exception
    when that module is missing or the start fails."""
    load_wandb()
    from wandb.sdk import wandb_setup
    from wandb.sdk.lib.service import service_process

    proc = service_process.start_detached(wandb_setup.singleton().settings, idle_timeout=SERVICE_IDLE_TIMEOUT)
    popen = proc._process  # the Popen handle: the only way to end it by its PID later
    proc.token.save_to_env()
    return popen


def start_service(start: Callable[[], subprocess.Popen] = _start_detached) -> None:
    """Start the wandb-core service for this process, detached (its stdin, stdout and stderr on
    the null device, so a capturing parent never waits on it), unless one is already known through
    ``WANDB_SERVICE``. wandb's public API then connects to it as to an external service, and
    wandb's own teardown neither waits for it nor registers an exit-time hook for it.

    ``start`` starts it and sets ``WANDB_SERVICE`` (tests pass a stand-in). The default uses
    wandb's internal ``service_process`` module; where that is missing (another wandb version)
    nothing is started and wandb starts its own service as usual.
    """
    global _started, _env_before
    if _started is not None or os.environ.get(_SERVICE_ENV):
        return
    env_before = os.environ.get(_SERVICE_ENV)
    try:
        popen = start()
    except RldiagError:  # wandb is not installed: said as such
        raise
    except Exception:  # noqa: BLE001 - another wandb's internals, or wandb-core could not start: then
        return  # wandb.Api starts (or fails to start) its own service and says so the usual way
    _started, _env_before = popen, env_before


def _teardown_within(deadline: float) -> None:
    """``wandb.teardown()`` on a daemon thread, waited for at most ``deadline`` seconds. Any
    exception, ``SystemExit`` (wandb exits with wandb-core's code) included, is swallowed: shutting
    down never masks the import's own outcome."""
    mod = sys.modules.get("wandb")
    teardown = getattr(mod, "teardown", None) if mod is not None else None
    if teardown is None:
        return

    def run() -> None:
        try:
            teardown()
        except BaseException:  # noqa: BLE001 - SystemExit and KeyboardInterrupt from wandb's teardown too
            pass

    t = threading.Thread(target=run, name="rldiag-wandb-teardown", daemon=True)
    t.start()
    t.join(deadline)


def _end(popen: subprocess.Popen, deadline: float) -> None:
    """End the wandb-core process ``popen`` (and its process group): SIGTERM, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if popen.poll() is not None:
            return
        try:
            os.killpg(popen.pid, sig)  # started in a session of its own: its group is its PID
        except (ProcessLookupError, PermissionError, OSError):
            try:
                popen.send_signal(sig)
            except OSError:
                return
        try:
            popen.wait(timeout=deadline if sig == signal.SIGTERM else None)
            return
        except subprocess.TimeoutExpired:
            continue


#: The name wandb gives its own threads (``wandb-ServiceFinalizer``, ...).
WANDB_THREAD_PREFIX = "wandb"


def quiet_wandb_threads() -> None:
    """From here on, an exception that ends one of wandb's own threads (named ``wandb-...``) is
    a line in the debug log, not a stack trace on stderr: once rldiag has ended a wandb-core that
    did not answer, wandb's service finalizer thread fails to publish to it, and Python's
    ``threading.excepthook`` would print that traceback under the import's own clear error.
    Every other thread's exceptions reach the previous hook unchanged. Idempotent."""
    previous = threading.excepthook
    if getattr(previous, "__rldiag_quiet__", False):
        return

    def hook(args: Any) -> None:
        name = getattr(args.thread, "name", "") or ""
        if name.startswith(WANDB_THREAD_PREFIX):
            log.debug("wandb thread %s ended with %s: %s (after rldiag's shutdown of the SDK)", name,
                      getattr(args.exc_type, "__name__", args.exc_type), args.exc_value)
            return
        previous(args)

    hook.__rldiag_quiet__ = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def shutdown(deadline: float = SHUTDOWN_DEADLINE) -> None:
    """Stop the wandb SDK in this process within about ``deadline`` seconds: wandb's teardown
    (bounded), then the wandb-core process :func:`start_service` started, ended by its PID; wandb's
    own threads that fail after that say so in the debug log (:func:`quiet_wandb_threads`). A
    no-op when wandb was never imported."""
    global _started, _env_before
    quiet_wandb_threads()
    _teardown_within(deadline)
    popen, _started = _started, None
    if popen is not None:
        _end(popen, deadline)
        if _env_before is None:
            os.environ.pop(_SERVICE_ENV, None)
        else:
            os.environ[_SERVICE_ENV] = _env_before
        _env_before = None


def scrub(text: str) -> str:
    """``text`` with the API key (if any is set) replaced, for messages shown to the user."""
    key = os.environ.get("WANDB_API_KEY")
    if key and len(key) >= 4:
        text = text.replace(key, "<WANDB_API_KEY>")
    return text
