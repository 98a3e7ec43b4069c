"""The optional ``wandb`` package, imported lazily and quietly.

Everything that touches the SDK goes through here so that

- a missing ``wandb`` gives one clear error (``pip install 'rldiag[wandb]'``);
- wandb's error reporting (Sentry) is off in the importer's process, so a failed import never
  waits at exit on a report that cannot be sent;
- the wandb-core service that the public API starts is shut down when the import ends;
- no message rldiag shows can carry the API key.
"""

from __future__ import annotations

import os
import sys

from rldiag.importers.errors import WandbMissingError

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


def shutdown() -> None:
    """Stop the wandb-core service this process may have started (no-op when there is none)."""
    mod = sys.modules.get("wandb")
    if mod is None:
        return
    teardown = getattr(mod, "teardown", None)
    if teardown is None:
        return
    try:
        teardown()
    except Exception:  # noqa: BLE001 - shutting down must never mask the import's own outcome
        pass


def scrub(text: str) -> str:
    """``text`` with the API key (if any is set) replaced, for messages shown to the user."""
    key = os.environ.get("WANDB_API_KEY")
    if key and len(key) >= 4:
        text = text.replace(key, "<WANDB_API_KEY>")
    return text
