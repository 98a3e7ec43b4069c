"""The capture policy: which steps' batches a capture writes, which prompt groups of a step, and
how many bytes of batches in all (issue 38; docs/capture.md, *Capture policy*).

Three knobs, as :class:`~rldiag.capture.RunWriter` arguments or the environment of the verl
capture and the toy trainer:

- ``RLDIAG_CAPTURE_EVERY=N`` (``every``): the batches of every N-th step (``step % N == 0``),
  of the first step the writer is handed and of the last step (the trainer's
  ``total_training_steps`` where known, else the step ``fit`` ends on, kept in memory until
  then). Metrics are logged at every step, always.
- ``RLDIAG_CAPTURE_GROUPS=K`` (``groups``): an integer >= 1 keeps K whole prompt groups
  (verl's ``uid``: every row of a kept group, so whole trajectories and sessions) of each step;
  a decimal in (0, 1) keeps that share of them (rounded, at least one). ``1.0`` is refused (a
  fraction of 1 keeps everything; leave the variable unset). The groups are drawn with a
  generator seeded from ``(seed, step)``: the run's seed (its config's ``data.seed``, else
  ``trainer.seed``, else 0) and the step, so the draw is the same on a rerun of the step.
- ``RLDIAG_CAPTURE_MAX_GB=X`` (``max_gb``): once the run's batch files on disk (those of an
  earlier run in the directory included: a resumed run) reach X GB (10^9 bytes), batch capture
  stops (metrics go on), with one warning and ``rldiag/capture/stopped_at_step`` in the metrics.

The policy is recorded in ``run.yaml`` (``rldiag.capture.policy``) and in each batch file's
Parquet metadata (key ``rldiag.capture``: :func:`sample_record`), with the step's groups and rows
before and after sampling, which the recompute reads to mark a sampled step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rldiag.errors import CaptureError
from rldiag.io.capture_record import BATCH_ROWS_KEY, META_KEY, groups_kept_share, merge_records, read_record

__all__ = ["BATCH_ROWS_KEY", "META_KEY", "CapturePolicy", "groups_kept_share", "merge_records", "read_record",
           "sample_record"]

ENV_EVERY = "RLDIAG_CAPTURE_EVERY"
ENV_GROUPS = "RLDIAG_CAPTURE_GROUPS"
ENV_MAX_GB = "RLDIAG_CAPTURE_MAX_GB"
#: bytes in one GB of ``max_gb`` (decimal, as disks are sold)
GB = 10**9
#: the config keys holding a run's seed, in the order they are tried
SEED_KEYS = ("data.seed", "trainer.seed")

ROWS_KEY = "rldiag/capture/rows"
BYTES_KEY = "rldiag/capture/bytes"
STOPPED_KEY = "rldiag/capture/stopped_at_step"


def parse_groups(value: str | float | int | None, source: str = "groups") -> int | float | None:
    """``RLDIAG_CAPTURE_GROUPS``'s value: an int >= 1 (a count), a float in (0, 1) (a share), or
    None. ``1.0`` (or any other float >= 1 written as a decimal) and values <= 0 are refused."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise CaptureError(f"{source}={value!r}: expected a count of groups (an integer >= 1) or a share in (0, 1)")
    text = str(value).strip()
    try:
        number = int(text) if isinstance(value, int) or text.lstrip("+").isdigit() else float(text)
    except ValueError as exc:
        raise CaptureError(f"{source}={value!r}: expected a count of groups (an integer >= 1) or a share in "
                           "(0, 1)") from exc
    if isinstance(number, int):
        if number < 1:
            raise CaptureError(f"{source}={value!r}: a count of groups is at least 1")
        return number
    if not (0.0 < number < 1.0) or not math.isfinite(number):
        raise CaptureError(f"{source}={value!r}: a share of groups is in (0, 1) (1.0 keeps every group: leave it "
                           "unset; a count is an integer)")
    return number


def parse_every(value: str | int | None, source: str = "every") -> int:
    if value is None or value == "":
        return 1
    try:
        every = int(str(value).strip())
    except ValueError as exc:
        raise CaptureError(f"{source}={value!r}: expected a whole number of steps >= 1") from exc
    if every < 1:
        raise CaptureError(f"{source}={value!r}: expected a whole number of steps >= 1")
    return every


def parse_max_gb(value: str | float | None, source: str = "max_gb") -> float | None:
    if value is None or value == "":
        return None
    try:
        gb = float(str(value).strip())
    except ValueError as exc:
        raise CaptureError(f"{source}={value!r}: expected a number of GB > 0") from exc
    if not (gb > 0 and math.isfinite(gb)):
        raise CaptureError(f"{source}={value!r}: expected a number of GB > 0")
    return gb


#: seeds are kept modulo this (``rldiag.capture.seed`` is an int32 setting)
SEED_MODULUS = 2**31


def run_seed(config: Any) -> int:
    """The run's seed from its config tree (:data:`SEED_KEYS`), else 0; modulo 2^31."""
    for key in SEED_KEYS:
        node: Any = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if isinstance(node, (int, float)) and not isinstance(node, bool) and math.isfinite(node):
            return int(node) % SEED_MODULUS
    return 0


@dataclass(frozen=True)
class CapturePolicy:
    """Which batches a capture writes (see the module docstring).

    ``every``: steps between captured batches (1: every step); ``groups``: a count (int) or a
    share (float in (0, 1)) of prompt groups kept per step, None for all; ``max_gb``: the batch
    bytes on disk at which batch capture stops, None for no limit; ``seed``: the group draw's."""

    every: int = 1
    groups: int | float | None = None
    max_gb: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.seed < SEED_MODULUS:
            raise CaptureError(f"seed={self.seed!r}: expected 0 <= seed < 2^31 (reduce it modulo 2^31)")
        parse_every(self.every)
        parse_groups(self.groups)
        parse_max_gb(self.max_gb)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, seed: int = 0) -> CapturePolicy:
        """The policy of ``RLDIAG_CAPTURE_EVERY``, ``_GROUPS``, ``_MAX_GB`` (bad values raise
        :class:`CaptureError` naming the variable)."""
        env = os.environ if environ is None else environ
        return cls(every=parse_every(env.get(ENV_EVERY), ENV_EVERY),
                   groups=parse_groups(env.get(ENV_GROUPS), ENV_GROUPS),
                   max_gb=parse_max_gb(env.get(ENV_MAX_GB), ENV_MAX_GB), seed=seed)

    def options(self) -> dict[str, Any]:
        """``every``, ``groups`` and ``max_gb`` as :class:`~rldiag.capture.RunWriter` keywords."""
        return {"every": self.every, "groups": self.groups, "max_gb": self.max_gb}

    @property
    def active(self) -> bool:
        """Whether the policy leaves anything out (else the capture writes every batch whole)."""
        return self.every > 1 or self.groups is not None or self.max_gb is not None

    @property
    def max_bytes(self) -> int | None:
        return None if self.max_gb is None else int(self.max_gb * GB)

    def record(self) -> dict[str, Any]:
        """The policy as ``run.yaml`` and the batch files record it."""
        return {"every": self.every, "groups": self.groups, "max_gb": self.max_gb, "seed": self.seed}

    def wants(self, step: int, first: int | None, last: int | None) -> bool:
        """Whether ``step``'s batch is captured under ``every`` (the budget aside): a multiple
        of ``every``, the ``first`` step the writer was handed, or the ``last`` one."""
        return self.every == 1 or step % self.every == 0 or step == first or step == last

    def keep_groups(self, uid: np.ndarray, step: int) -> tuple[np.ndarray | None, int, int]:
        """``(kept rows (rows,) bool or None for all, groups in the step, groups kept)``.

        ``uid``: ``(rows,)`` the rows' prompt-group ids. The kept groups are drawn without
        replacement by ``numpy.random.default_rng((seed, step))`` from the groups in order of
        first appearance; every row of a kept group is kept."""
        names, first_row, inverse = np.unique(np.asarray(uid).astype(str), return_index=True, return_inverse=True)
        n = int(names.shape[0])
        if self.groups is None:
            return None, n, n
        k = self.groups if isinstance(self.groups, int) else max(1, round(self.groups * n))
        if k >= n:
            return None, n, n
        order = np.argsort(first_row, kind="stable")  # group index by first appearance -> np.unique's index
        rng = np.random.default_rng([int(self.seed), int(step)])
        chosen = order[np.sort(rng.choice(n, size=k, replace=False))]
        keep = np.zeros(n, dtype=bool)
        keep[chosen] = True
        return keep[inverse.reshape(-1)], n, k


def sample_record(policy: CapturePolicy, groups: int, groups_kept: int, rows: int, rows_kept: int) -> dict[str, Any]:
    """One batch file's capture record: the policy and the step's groups and rows before and
    after sampling (``groups_kept / groups`` is the step's ``rldiag/sample/groups_kept_share``)."""
    return {"policy": policy.record(), "groups": groups, "groups_kept": groups_kept, "rows": rows,
            "rows_kept": rows_kept}
