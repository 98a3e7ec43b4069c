"""Where a run lives: a local directory, or a prefix in an object store (``s3://bucket/run``).

A local path stays a :class:`pathlib.Path`, so everything local behaves exactly as before. A URI
becomes a :class:`RemotePath`: the part of pathlib's interface rldiag uses (``/``, ``name``,
``suffix``, ``parent``, ``relative_to``, ``exists``, ``is_file``, ``is_dir``, ``iterdir``,
``stat``, ``open``, ``read_bytes``, ``read_text``, ``write_bytes``, ``unlink``; ``write_from``
uploads a local file) on a pyarrow filesystem. Code that reads or writes Arrow data calls
:func:`arrow_source` to get the ``(path, filesystem)`` pair pyarrow's readers take.

``s3://`` URIs use :class:`pyarrow.fs.S3FileSystem` configured from the environment:
credentials from the AWS chain (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, profiles, ...),
the endpoint from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (``http://host:port`` for a
local server), the region from ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, connection timeout
``RLDIAG_S3_CONNECT_TIMEOUT`` (seconds, default 5) and ``RLDIAG_S3_RETRIES`` attempts (default 3),
so an unreachable endpoint is a :class:`~rldiag.errors.StorageError` within seconds, never a hang.
Other schemes (``gs://``, ``hdfs://``) go through :meth:`pyarrow.fs.FileSystem.from_uri`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePath, PurePosixPath
from typing import TypeGuard
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from rldiag.errors import StorageError

_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")


def is_uri(p: object) -> bool:
    """True for ``scheme://...`` strings other than ``file://``."""
    if not isinstance(p, str):
        return False
    m = _URI.match(p)
    return m is not None and m.group(1).lower() != "file"


def is_remote(p: object) -> TypeGuard[RemotePath]:
    return isinstance(p, RemotePath)


def as_path(p: str | os.PathLike | RemotePath) -> Path | RemotePath:
    """A :class:`Path` for a local path (``file://`` included), a :class:`RemotePath` for a URI."""
    if isinstance(p, (Path, RemotePath)):
        return p
    if isinstance(p, str):
        m = _URI.match(p)
        if m and m.group(1).lower() == "file":
            return Path(urlsplit(p).path)
        if m:
            scheme, rest = m.group(1).lower(), m.group(2).strip("/")
            if not rest:
                raise StorageError(f"{p}: a URI needs a bucket (e.g. s3://bucket/run)")
            return RemotePath(filesystem_for(scheme, rest.split("/", 1)[0]), scheme, rest)
    return Path(p)


def relative_to(p: Path | RemotePath, root: Path | RemotePath) -> PurePath:
    """``p`` relative to ``root``, both local or both in one object store (a file found under a
    run directory, relative to it)."""
    if isinstance(p, RemotePath):
        assert isinstance(root, RemotePath), f"{p} is remote, {root} is local"
        return p.relative_to(root)
    assert isinstance(root, Path), f"{p} is local, {root} is remote"
    return p.relative_to(root)


def arrow_source(p: Path | RemotePath) -> tuple[str, pafs.FileSystem | None]:
    """``(path, filesystem)`` as pyarrow's readers and writers take them."""
    if isinstance(p, RemotePath):
        return p.key, p.fs
    return str(p), None


def open_input_file(p: Path | RemotePath):
    """A random-access Arrow file: memory-mapped locally, ranged reads on an object store.
    Raises what pyarrow raises (``OSError``, ``ArrowException``), as for a local file."""
    if isinstance(p, RemotePath):
        return p.fs.open_input_file(p.key)
    return pa.memory_map(str(p))


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    try:
        return float(raw) if raw else default
    except ValueError:
        raise StorageError(f"{name}={raw!r} is not a number") from None


def _s3_settings() -> tuple:
    """The environment that shapes an S3 client (the cache key of :func:`_s3`)."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    timeout = _env_float("RLDIAG_S3_CONNECT_TIMEOUT", 5.0)
    retries = int(_env_float("RLDIAG_S3_RETRIES", 3))
    creds = tuple(os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"))
    return endpoint, region, timeout, retries, creds


@functools.lru_cache(maxsize=8)
def _s3(endpoint: str | None, region: str | None, timeout: float, retries: int, _creds: tuple) -> pafs.FileSystem:
    kwargs: dict = {
        "connect_timeout": timeout,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=max(1, retries)),
    }
    if region:
        kwargs["region"] = region
    if endpoint:
        parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        kwargs["scheme"] = parts.scheme or "https"
        kwargs["endpoint_override"] = parts.netloc + parts.path.rstrip("/")
    try:
        return pafs.S3FileSystem(**kwargs)
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise StorageError(f"cannot set up the S3 client ({exc})") from exc


def filesystem_for(scheme: str, bucket: str) -> pafs.FileSystem:
    """The filesystem of ``scheme://bucket/...`` (S3 from the environment, see the module doc)."""
    if scheme in ("s3", "s3a"):
        return _s3(*_s3_settings())
    try:
        fs, _ = pafs.FileSystem.from_uri(f"{scheme}://{bucket}")
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise StorageError(f"{scheme}://{bucket}: no filesystem for this URI ({exc})") from exc
    return fs


@dataclass(frozen=True)
class RemoteStat:
    st_size: int
    st_mtime_ns: int


class RemotePath:
    """A file or prefix in an object store, with the pathlib methods rldiag uses.

    ``key`` is ``bucket/prefix/...`` (what pyarrow's filesystem takes); ``str()`` is the URI.
    Paths from :meth:`iterdir` carry the listing's metadata, so ``is_file``/``stat`` on them cost
    no extra request. Errors from the store (unreachable endpoint, refused credentials) raise
    :class:`~rldiag.errors.StorageError`.
    """

    __slots__ = ("fs", "scheme", "key", "_info")

    def __init__(self, fs: pafs.FileSystem, scheme: str, key: str, info: pafs.FileInfo | None = None):
        self.fs, self.scheme, self.key, self._info = fs, scheme, key.strip("/"), info

    # --- names -------------------------------------------------------------------------------
    def __str__(self) -> str:
        return f"{self.scheme}://{self.key}"

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and (self.scheme, self.key) == (other.scheme, other.key)

    def __lt__(self, other: RemotePath) -> bool:
        return self.key < other.key

    def __hash__(self) -> int:
        return hash((self.scheme, self.key))

    def __copy__(self) -> RemotePath:
        return self

    def __deepcopy__(self, memo: dict) -> RemotePath:
        """A value, like a :class:`Path` (``dataclasses.asdict`` deep-copies the fields holding
        one): the filesystem client is shared, never copied."""
        return self

    def __truediv__(self, other: str | PurePosixPath) -> RemotePath:
        return RemotePath(self.fs, self.scheme, f"{self.key}/{str(other).strip('/')}")

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.name).suffix

    @property
    def stem(self) -> str:
        return PurePosixPath(self.name).stem

    @property
    def parent(self) -> RemotePath:
        head = self.key.rsplit("/", 1)[0] if "/" in self.key else self.key
        return RemotePath(self.fs, self.scheme, head)

    def relative_to(self, other: RemotePath) -> PurePosixPath:
        return PurePosixPath(self.key).relative_to(other.key)

    # --- metadata ----------------------------------------------------------------------------
    def _call(self, what: str, fn):
        try:
            return fn()
        except (OSError, pa.ArrowException) as exc:
            raise StorageError(f"{what} {self}: {exc}") from exc

    def info(self) -> pafs.FileInfo:
        if self._info is None:
            return self._call("cannot reach", lambda: self.fs.get_file_info(self.key))
        return self._info

    def exists(self) -> bool:
        return self.info().type != pafs.FileType.NotFound

    def is_file(self) -> bool:
        return self.info().type == pafs.FileType.File

    def is_dir(self) -> bool:
        return self.info().type == pafs.FileType.Directory

    def stat(self) -> RemoteStat:
        info = self.info()
        if info.type != pafs.FileType.File:
            raise StorageError(f"{self} is not a file")
        return RemoteStat(st_size=int(info.size), st_mtime_ns=int(info.mtime_ns or 0))

    def iterdir(self) -> list[RemotePath]:
        sel = pafs.FileSelector(self.key, allow_not_found=True, recursive=False)
        infos = self._call("cannot list", lambda: self.fs.get_file_info(sel))
        return [RemotePath(self.fs, self.scheme, i.path, i) for i in infos]

    def files(self) -> list[RemotePath]:
        """Every object under this prefix, at any depth."""
        sel = pafs.FileSelector(self.key, allow_not_found=True, recursive=True)
        infos = self._call("cannot list", lambda: self.fs.get_file_info(sel))
        return [RemotePath(self.fs, self.scheme, i.path, i) for i in infos if i.type == pafs.FileType.File]

    # --- content -----------------------------------------------------------------------------
    def open(self, mode: str = "rb"):
        if mode != "rb":
            raise ValueError(f"RemotePath.open: only 'rb' is supported, not {mode!r}")
        return self._call("cannot read", lambda: self.fs.open_input_stream(self.key))

    def read_bytes(self) -> bytes:
        with self.open() as fh:
            return self._call("cannot read", fh.read)

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def write_bytes(self, data: bytes) -> None:
        """One PUT: the object appears whole or not at all."""

        def put():
            with self.fs.open_output_stream(self.key) as out:
                out.write(data)

        self._call("cannot write", put)
        self._info = None

    def write_from(self, src: Path, chunk: int = 1 << 20) -> tuple[int, str]:
        """Upload the local file ``src`` as this object, streamed (the object appears whole or
        not at all); returns its ``(size, SHA-256)``."""
        h = hashlib.sha256()
        size = 0

        def put():
            nonlocal size
            with open(src, "rb") as fh, self.fs.open_output_stream(self.key) as out:
                while block := fh.read(chunk):
                    h.update(block)
                    out.write(block)
                    size += len(block)

        self._call("cannot write", put)
        self._info = None
        return size, h.hexdigest()

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self._call("cannot delete", lambda: self.fs.delete_file(self.key))
        except StorageError:
            if not (missing_ok and not self.exists()):
                raise
        self._info = None
