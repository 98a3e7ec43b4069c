"""A local S3 server for tests: moto's ThreadedMotoServer on 127.0.0.1 (a free port), with the
environment rldiag's S3 client reads (endpoint, credentials, region) set while it runs."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs
import pytest


@dataclass
class S3Server:
    endpoint: str
    env: dict[str, str]
    bucket: str

    def fs(self) -> pafs.S3FileSystem:
        host = self.endpoint.split("://", 1)[1]
        return pafs.S3FileSystem(access_key=self.env["AWS_ACCESS_KEY_ID"], secret_key=self.env["AWS_SECRET_ACCESS_KEY"],
                                 endpoint_override=host, scheme="http", region="us-east-1")

    def upload_dir(self, local: Path, prefix: str) -> str:
        """Copy a local directory to ``s3://bucket/prefix``; returns that URI."""
        pafs.copy_files(str(local), f"{self.bucket}/{prefix}", source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=self.fs())
        return f"s3://{self.bucket}/{prefix}"

    def keys(self, prefix: str) -> list[str]:
        sel = pafs.FileSelector(f"{self.bucket}/{prefix}", recursive=True, allow_not_found=True)
        return sorted(i.path.split("/", 1)[1] for i in self.fs().get_file_info(sel) if i.type == pafs.FileType.File)


@contextmanager
def moto_s3(bucket: str = "rldiag-test") -> Iterator[S3Server]:
    server_mod = pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install 'rldiag[dev]')")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "rldiag-test-key",
        "AWS_SECRET_ACCESS_KEY": "rldiag-test-secret",
        "AWS_REGION": "us-east-1",
        "RLDIAG_S3_CONNECT_TIMEOUT": "2",
    }
    saved = {k: os.environ.get(k) for k in (*env, "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE")}
    os.environ.update(env)
    for k in ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        os.environ.pop(k, None)
    try:
        s3 = S3Server(endpoint=env["AWS_ENDPOINT_URL"], env=env, bucket=bucket)
        pafs.S3FileSystem(access_key=env["AWS_ACCESS_KEY_ID"], secret_key=env["AWS_SECRET_ACCESS_KEY"],
                          endpoint_override=f"{host}:{port}", scheme="http", region="us-east-1",
                          allow_bucket_creation=True).create_dir(bucket)
        yield s3
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def fail_uploads(monkeypatch, name: str) -> list[str]:
    """Make the upload of every object named ``name`` fail, as a store that goes away in the middle
    of a commit (``monkeypatch.undo()`` ends it). Returns the names of the uploads tried, in order."""
    from rldiag.errors import StorageError
    from rldiag.io.fs import RemotePath

    real = RemotePath.write_from
    tried: list[str] = []

    def upload(self, src, *args, **kwargs):
        tried.append(self.name)
        if self.name == name:
            raise StorageError(f"cannot write {self}: the store went away")
        return real(self, src, *args, **kwargs)

    monkeypatch.setattr(RemotePath, "write_from", upload)
    return tried
