"""The online path: a run (and its batch artifacts) through the wandb public API.

The API object comes from a factory, ``api_factory(timeout=..., base_url=...)``. The default
one builds ``wandb.Api`` with the key from ``WANDB_API_KEY`` (never from a file, never written or
shown); tests pass a factory returning plain fake objects with the few attributes used here:

- ``api.run("entity/project/run_id")`` -> run with ``id``, ``entity``, ``project``, ``name``,
  ``state``, ``config`` (a dict; W&B's ``{"value": ...}`` wrappers are removed),
  ``lastHistoryStep``, ``scan_history(page_size=N)`` (every row, paged; the down-sampled
  ``history()`` is never used) and ``logged_artifacts()``;
- ``api.artifact("entity/project/name:version")`` -> artifact;
- artifact: ``name``, ``type``, ``version``, ``digest``, ``manifest.entries`` (path -> entry, to
  list the files) and ``get_entry(path)`` (the entry, bound to its artifact so that it can be
  downloaded: entries taken from ``manifest.entries`` directly cannot be);
- entry: ``path``, ``digest`` (base64 MD5 for stored files), ``size``, ``ref``,
  ``download(root=DIR)`` -> the downloaded file's path.

Every failure of the API (no network, unknown run, bad key, timeout) becomes a
:class:`~rldiag.errors.WandbImportError` naming what was asked for; the key never
appears in a message.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rldiag.errors import WandbImportError
from rldiag.importers.rundir_writer import RunDirWriter
from rldiag.importers.wandb_artifacts import file_digest, step_of_name
from rldiag.importers.wandb_records import ArtifactEntry, ArtifactInfo
from rldiag.importers.wandb_sdk import load_wandb, scrub, start_service
from rldiag.importers.wandb_values import flatten_row, step_of, unwrap_config

ApiFactory = Callable[..., Any]
Progress = Callable[[int, int, int], None]

RUN_PATH = re.compile(r"^[^/\s]+/[^/\s]+/[^/\s:]+$")
ARTIFACT_PATH = re.compile(r"^[^/\s]+/[^/\s]+/[^/\s:]+:[^/\s:]+$")


def is_run_path(text: str) -> bool:
    return bool(RUN_PATH.match(text))


def default_api_factory(*, timeout: float, base_url: str | None = None):
    """``wandb.Api`` with the key from ``WANDB_API_KEY`` and an HTTP timeout."""
    key = os.environ.get("WANDB_API_KEY", "").strip()
    if not key:
        raise WandbImportError(
            "WANDB_API_KEY is not set: the online import reads the W&B API key from the environment only "
            "(export WANDB_API_KEY=...); for an offline run pass its wandb/offline-run-* folder instead"
        )
    wandb = load_wandb()
    url = base_url or os.environ.get("WANDB_BASE_URL") or "the W&B server"
    overrides = {"base_url": base_url} if base_url else {}
    start_service()
    try:
        return wandb.Api(timeout=int(max(1, round(timeout))), overrides=overrides, api_key=key)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - wandb raises many types (CommError, UsageError...)
        raise WandbImportError(f"cannot connect to {url} (timeout {timeout:g}s): {scrub(str(exc))}") from exc


def _call(what: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except WandbImportError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - see default_api_factory; wandb may sys.exit
        raise WandbImportError(f"{what}: {scrub(str(exc)) or type(exc).__name__}") from exc


@dataclass
class OnlineRun:
    path: str
    run_id: str | None = None
    entity: str | None = None
    project: str | None = None
    display_name: str | None = None
    state: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    history_rows: int = 0
    rows_without_step: int = 0
    artifacts: list[ArtifactInfo] = field(default_factory=list)


def fetch_run(api, path: str, writer: RunDirWriter, *, page_size: int, sep: str,
              progress: Progress | None = None) -> tuple[OnlineRun, Any]:
    """Config and every history row of ``entity/project/run_id`` into ``writer``."""
    run = _call(f"cannot open W&B run {path}", lambda: api.run(path))
    info = OnlineRun(path=path)
    info.run_id = getattr(run, "id", None)
    info.entity = getattr(run, "entity", None)
    info.project = getattr(run, "project", None)
    info.display_name = getattr(run, "name", None)
    info.state = getattr(run, "state", None)
    raw_config = _call(f"cannot read the config of {path}", lambda: run.config) or {}
    info.config = unwrap_config(raw_config)
    total = 0
    try:
        last = run.lastHistoryStep
        total = int(last) + 1 if last is not None and int(last) >= 0 else 0
    except Exception:  # noqa: BLE001 - only used to size the progress bar
        total = 0
    scan = _call(f"cannot read the history of {path}", lambda: run.scan_history(page_size=page_size))
    rows = iter(scan)
    while True:
        row = _call(f"reading the history of {path} failed after {info.history_rows} rows", lambda: next(rows, None))
        if row is None:
            break
        step = step_of(row)
        if step is None:
            info.rows_without_step += 1
            continue
        data = flatten_row({k: v for k, v in row.items() if k != "_step"}, sep)
        writer.add_row(step, data)
        info.history_rows += 1
        if progress is not None and (info.history_rows % 200 == 0):
            progress(info.history_rows, max(total, info.history_rows), step)
    if progress is not None:
        progress(info.history_rows, max(total, info.history_rows), writer.last_step or 0)
    return info, run


def _version_key(art) -> tuple[str, int]:
    name = str(getattr(art, "name", ""))
    base = name.split(":", 1)[0]
    version = str(getattr(art, "version", "") or (name.split(":", 1)[1] if ":" in name else ""))
    m = re.match(r"^v(\d+)$", version)
    return base, int(m.group(1)) if m else -1


def run_artifacts(run, artifact_type: str, path: str) -> list[Any]:
    """The artifacts of ``artifact_type`` that ``run`` logged, oldest version first per name."""
    arts = _call(f"cannot list the artifacts of {path}", lambda: [a for a in run.logged_artifacts()])
    chosen = [a for a in arts if getattr(a, "type", None) == artifact_type]
    return sorted(chosen, key=_version_key)


def get_artifact(api, spec: str) -> Any:
    if not ARTIFACT_PATH.match(spec):
        raise WandbImportError(f"--artifact {spec!r}: expected entity/project/name:version (e.g. me/rl/batches:v3)")
    return _call(f"cannot open W&B artifact {spec}", lambda: api.artifact(spec))


def _entries(art) -> dict[str, Any]:
    manifest = getattr(art, "manifest", None)
    entries = getattr(manifest, "entries", None)
    if entries is None:
        raise WandbImportError(f"artifact {getattr(art, 'name', '?')}: no manifest entries")
    return dict(entries)


def _algorithm(entry) -> str:
    """"md5" or "xxh128": how the entry's digest was computed."""
    fn = getattr(entry, "digest_algorithm", None)
    alg = ""
    if callable(fn):
        try:
            alg = str(fn())
        except Exception:  # noqa: BLE001 - an entry without the method's data: fall back to extra
            alg = ""
    if not alg:
        extra = getattr(entry, "extra", None) or {}
        alg = str(extra.get("alg", "")) if isinstance(extra, dict) else ""
    return "xxh128" if "xxh128" in alg.lower() else "md5"


def _download_entry(art: Any, name: str, p: str, tmp: str) -> Path:
    """Entry ``p`` of artifact ``art`` (named ``name``) downloaded under ``tmp``: where it is."""
    bound = _call(f"cannot get {p} of artifact {name}", lambda: art.get_entry(p))
    return Path(_call(f"downloading {p} of artifact {name} failed", lambda: bound.download(root=tmp)))


def download_batches(art, writer: RunDirWriter, *, progress: Progress | None = None) -> ArtifactInfo:
    """Download the ``step_<N>`` files of one artifact, verify their digests, stage them."""
    name = str(getattr(art, "name", "?"))
    info = ArtifactInfo(name=name, type=str(getattr(art, "type", "")), digest=getattr(art, "digest", None),
                        version=getattr(art, "version", None))
    entries = _call(f"cannot read the manifest of artifact {name}", lambda: _entries(art))
    steps = [(p, e, s) for p, e in entries.items() if (s := step_of_name(p)) is not None]
    if not steps:
        info.problems.append(f"artifact {name} holds no step_<N>.parquet/.arrow files")
        return info
    with tempfile.TemporaryDirectory(prefix="wandb-dl-", dir=writer.scratch) as tmp:
        for i, (p, entry, step) in enumerate(sorted(steps, key=lambda t: t[2])):
            digest = getattr(entry, "digest", None)
            ref = getattr(entry, "ref", None)
            info.entries.append(ArtifactEntry(path=p, digest=digest or "", size=getattr(entry, "size", None), ref=ref))
            local = _download_entry(art, name, p, tmp)
            if not local.is_file():
                raise WandbImportError(f"downloading {p} of artifact {name} gave no file at {local}")
            if digest and not ref:
                alg = _algorithm(entry)
                got = file_digest(local, alg)
                if got != digest:
                    raise WandbImportError(
                        f"artifact {name}: {p} downloaded with {alg.upper()} {got}, the manifest says {digest}; "
                        "not imported"
                    )
            writer.add_batch_file(step, p.rsplit("/", 1)[-1], local, source=name, move=True)
            if progress is not None:
                progress(i + 1, len(steps), step)
    return info
