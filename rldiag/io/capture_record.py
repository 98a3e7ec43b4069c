"""A batch file's capture record: what a capture policy (``rldiag.capture.policy``) kept of the
step, in the file's Parquet key-value metadata under :data:`META_KEY`, as JSON::

    {"policy": {"every": N, "groups": K, "max_gb": X, "seed": S},
     "groups": G, "groups_kept": k, "rows": R, "rows_kept": r}

The capture writes it; a recompute reads it (``rldiag.scenario.sampling``) to mark a sampled step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

#: the Parquet key-value metadata key of a batch file's capture record
META_KEY = b"rldiag.capture"
#: the logged metric of the rows of the step's whole batch (before sampling; also of a step left
#: out, where known): the adaptive KL controller's ``n_steps`` for a recompute that chains across
#: steps it cannot read
BATCH_ROWS_KEY = "rldiag/capture/batch_rows"


def merge_records(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The record of a step written in parts: the groups and rows of both parts summed."""
    if old is None or new is None:
        either = old if old is not None else new
        return None if either is None else dict(either)
    out = dict(new)
    for key in ("groups", "groups_kept", "rows", "rows_kept"):
        out[key] = int(old.get(key, 0)) + int(new.get(key, 0))
    return out


def read_record(metadata: Mapping[bytes, bytes] | None) -> dict[str, Any] | None:
    """A batch file's capture record from its Parquet schema metadata (None when it has none)."""
    if not metadata or META_KEY not in metadata:
        return None
    try:
        record = json.loads(metadata[META_KEY])
    except (ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def groups_kept_share(record: Mapping[str, Any] | None) -> float:
    """The share of the step's prompt groups its batch file holds (1.0 without a record)."""
    if not record:
        return 1.0
    groups, kept = int(record.get("groups", 0)), int(record.get("groups_kept", 0))
    return 1.0 if groups <= 0 else kept / groups
