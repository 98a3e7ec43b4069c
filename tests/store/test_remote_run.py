"""The app's store reads runs on local disk: a run in an object store is refused with a
:class:`StoreError` naming it (the app shows it), before any request to the store."""

from __future__ import annotations

import pytest

from rldiag.errors import StoreError
from rldiag.store import Store
from rldiag.synth import SynthSpec, write_synth_run
from tests.s3server import moto_s3


def test_a_run_in_an_object_store_is_a_store_error(tmp_path):
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=2, seed=1))
    with moto_s3() as s3:
        uri = s3.upload_dir(run, "runs/app")
        with pytest.raises(StoreError, match=f"{uri} is in an object store: the app reads runs on local disk"):
            Store(uri)
    assert Store(run).status().steps == 2  # the same run on disk opens
