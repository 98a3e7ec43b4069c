"""A local S3 server (moto) for a module's tests of runs in an object store."""

from __future__ import annotations

import pytest

from tests.s3server import moto_s3


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as server:
        yield server
