"""Find the files of an offline artifact, by recorded path and digest.

An offline run does not keep its artifact files in the run folder. ``run.log_artifact`` copies
each file into wandb's staging directory (``$WANDB_DATA_DIR/artifacts/staging``, by default
``~/.local/share/wandb/...``) under a random name, and the artifact record keeps, per file, its
name inside the artifact, that staged ``local_path``, its size and its base64 digest (MD5, or
XXH128 for artifacts made with ``digest_algorithm="XXH128"``). When the run is moved to another
machine, those staged files are usually copied to some folder by hand.

A file is looked for, in order, at

1. its recorded ``local_path``;
2. in each search folder (``--artifact-dir``, then wandb's staging folder, then the run folder):
   under the staged file's name, the file's path inside the artifact, or its base name;
3. in wandb's artifact cache (``$WANDB_CACHE_DIR/artifacts/obj/<alg>/<hex[:2]>/<hex[2:]>``);
4. anywhere below the search folders, among files of the recorded size.

A candidate is taken only when its digest matches the recorded one, so a renamed, moved or
stale copy is never imported by mistake.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from rldiag.errors import WandbImportError
from rldiag.importers.wandb_records import ArtifactEntry
from rldiag.io.run_layout import STEP_FILE

_CHUNK = 1 << 20


def step_of_name(name: str) -> int | None:
    """The step of a batch file name (``step_<N>.parquet`` / ``.arrow``), else None."""
    m = STEP_FILE.match(name.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


class _Hash(Protocol):
    """What :func:`file_digest` uses of a hash object (hashlib's and xxhash's)."""

    def update(self, data: bytes, /) -> None: ...

    def digest(self) -> bytes: ...


def file_digest(path: Path, algorithm: str = "md5") -> str:
    """The base64 digest of a file, as W&B manifests record it."""
    if algorithm == "xxh128":
        try:
            import xxhash
        except ImportError as exc:
            raise WandbImportError("this artifact uses XXH128 digests; install the xxhash package to verify them") from exc
        h: _Hash = xxhash.xxh128()
    else:
        h = hashlib.md5()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return base64.b64encode(h.digest()).decode("ascii")


def wandb_default_dirs() -> tuple[list[Path], list[Path]]:
    """(staging folders, artifact cache folders) as wandb computes them in this environment."""
    staging: list[Path] = []
    cache: list[Path] = []
    try:
        from wandb import env as wenv

        staging.append(Path(wenv.get_data_dir()).expanduser() / "artifacts" / "staging")
        cache.append(Path(wenv.get_cache_dir()).expanduser() / "artifacts")
    except Exception:  # noqa: BLE001 - wandb absent or its helpers moved: the fallbacks below
        data = os.environ.get("WANDB_DATA_DIR") or os.path.join(
            os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "wandb")
        cache_dir = os.environ.get("WANDB_CACHE_DIR") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "wandb")
        staging.append(Path(data) / "artifacts" / "staging")
        cache.append(Path(cache_dir) / "artifacts")
    return staging, cache


class FileFinder:
    """Locates artifact files by recorded path and digest (see the module docstring)."""

    def __init__(self, search_dirs: Iterable[str | Path], cache_dirs: Iterable[str | Path] = ()):
        seen: set[Path] = set()
        self.search_dirs: list[Path] = []
        for d in search_dirs:
            d = Path(d).expanduser()
            key = d.resolve() if d.exists() else d
            if key not in seen:
                seen.add(key)
                self.search_dirs.append(d)
        self.cache_dirs = [Path(c).expanduser() for c in cache_dirs]
        self._digests: dict[tuple[Path, str], str] = {}
        self._by_size: dict[int, list[Path]] | None = None

    def _digest(self, path: Path, algorithm: str) -> str | None:
        key = (path, algorithm)
        if key not in self._digests:
            try:
                self._digests[key] = file_digest(path, algorithm)
            except OSError:
                return None
        return self._digests[key]

    def _matches(self, path: Path, entry: ArtifactEntry) -> bool:
        try:
            if not path.is_file():
                return False
            if entry.size is not None and path.stat().st_size != entry.size:
                return False
        except OSError:
            return False
        if not entry.digest:
            return True
        return self._digest(path, entry.algorithm) == entry.digest

    def _size_index(self) -> dict[int, list[Path]]:
        if self._by_size is None:
            self._by_size = {}
            for d in self.search_dirs:
                if not d.is_dir():
                    continue
                for root, _dirs, files in os.walk(d):
                    for name in files:
                        p = Path(root) / name
                        try:
                            size = p.stat().st_size
                        except OSError:
                            continue
                        self._by_size.setdefault(size, []).append(p)
        return self._by_size

    def find(self, entry: ArtifactEntry) -> tuple[Path | None, str]:
        """``(path, how it was found)``; ``(None, why not)`` when no copy matches."""
        if entry.ref:
            return None, f"a reference to {entry.ref}; its bytes were never stored by wandb"
        if entry.local_path and self._matches(Path(entry.local_path), entry):
            return Path(entry.local_path), "recorded path"
        names = []
        if entry.local_path:
            names.append(Path(entry.local_path).name)
        names += [entry.path, entry.name]
        for d in self.search_dirs:
            for name in names:
                p = d / name
                if self._matches(p, entry):
                    return p, f"search folder {d}"
        if entry.digest:
            try:
                hexd = base64.b64decode(entry.digest).hex()
            except ValueError:
                hexd = ""
            if hexd:
                for c in self.cache_dirs:
                    p = c / "obj" / entry.algorithm / hexd[:2] / hexd[2:]
                    if self._matches(p, entry):
                        return p, "wandb artifact cache"
        if entry.size is not None:
            for p in self._size_index().get(entry.size, []):
                if self._matches(p, entry):
                    return p, f"digest match in {p.parent}"
        where = ", ".join(str(d) for d in self.search_dirs) or "no folder"
        return None, (f"not found (recorded at {entry.local_path or '?'}; looked in {where} and the wandb cache "
                      f"for {entry.algorithm} {entry.digest}); copy the staged files there or pass --artifact-dir")
