"""One writer's bookkeeping of its capture policy (:mod:`rldiag.capture.policy`): which steps it
captured or left out, the rows and bytes of each, the byte budget, the step held in memory while
the run's last step is unknown. :class:`~rldiag.capture.RunWriter` asks it and tells it; it
writes nothing itself.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

from rldiag.capture.faults import CaptureWarning
from rldiag.capture.policy import BATCH_ROWS_KEY, BYTES_KEY, ROWS_KEY, STOPPED_KEY, CapturePolicy
from rldiag.capture.unpad import StepPayload


def file_bytes(path: Path) -> int:
    """A file's size, 0 when it cannot be read."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def batches_on_disk(batches_dir: Path) -> int:
    """The bytes of the batch files in ``batches_dir`` (a resumed run's)."""
    try:
        return sum(file_bytes(p) for p in batches_dir.glob("step_*") if p.suffix in (".parquet", ".arrow"))
    except OSError:
        return 0


class PolicyLedger:
    """The capture policy's state in one writer. ``last_step``: the run's last step (``every``'s;
    None while unknown). Steps are decided in the order they are handed over (the first one is
    always captured). The per-step counts are ints: a run of many steps keeps a few dicts of them."""

    def __init__(self, policy: CapturePolicy, batches_dir: Path, last_step: int | None = None):
        self.policy, self.batches_dir, self.last_step = policy, batches_dir, last_step
        self.first_step: int | None = None
        self.stopped_at: int | None = None  # the first step the byte budget left out
        self.skipped: set[int] = set()  # steps the policy left out
        self.queued: set[int] = set()  # steps handed to the writer thread
        self.step_rows: dict[int, int] = {}  # step -> rows handed to the writer thread
        self.batch_rows: dict[int, int] = {}  # step -> rows of its whole batch (before sampling), where known
        self.step_bytes: dict[int, int] = {}  # step -> its batch file's bytes, once written (writer thread)
        self.held: list[StepPayload] = []  # the parts of the last step left out while last_step is unknown
        self.disk_base = batches_on_disk(batches_dir) if policy.max_bytes is not None else 0
        self.written_bytes = 0  # the bytes of the files this writer wrote (their latest sizes)
        self._lock = threading.Lock()

    # -- the training thread ---------------------------------------------------------------------
    def captures(self, step: int) -> bool:
        """Whether ``step``'s batch is captured: ``every``'s steps (the first step handed over
        and :attr:`last_step` among them) while the batch bytes on disk are under ``max_gb``
        (reaching it stops batch capture for good, with one warning)."""
        if self.first_step is None:
            self.first_step = step
        if step in self.queued:  # a later part of a step being captured
            return True
        if self.stopped_at is not None or not self.policy.wants(step, self.first_step, self.last_step):
            return False
        limit = self.policy.max_bytes
        if limit is not None and self.batch_bytes() >= limit:
            self.stopped_at = step
            warnings.warn(f"rldiag.capture: the run's batch files in {self.batches_dir} reached "
                          f"{self.batch_bytes() / 1e9:.3g} GB (max_gb={self.policy.max_gb:g}): batch capture stops "
                          f"at step {step}; metrics go on", CaptureWarning, stacklevel=4)
            return False
        return True

    def batch_bytes(self) -> int:
        """The run's batch bytes: those on disk when the writer opened and those it wrote since."""
        with self._lock:
            return self.disk_base + self.written_bytes

    def replacing(self, path: Path) -> None:
        """A resumed run writes ``path`` again: its old bytes leave the count (the new ones join it)."""
        if self.policy.max_bytes is not None:
            with self._lock:
                self.disk_base -= file_bytes(path)

    def queue(self, payload: StepPayload) -> None:
        """``payload`` is handed to the writer thread."""
        step = payload.step
        self.step_rows[step] = self.step_rows.get(step, 0) + payload.n_rows
        whole = payload.sample["rows"] if payload.sample is not None else payload.n_rows
        self.batch_rows[step] = self.batch_rows.get(step, 0) + int(whole)
        self.queued.add(step)

    def skip(self, step: int, rows: int | None) -> bool:
        """Record ``step`` as left out (``rows``: its whole batch's, where known). Returns whether
        its batch is to be held in memory (:meth:`hold`): the last step is unknown."""
        self.skipped.add(step)
        self.step_rows.setdefault(step, 0)
        if rows is not None:
            self.batch_rows[step] = self.batch_rows.get(step, 0) + int(rows)
        hold = self.last_step is None and self.stopped_at is None and self.policy.every > 1
        if not hold:
            self.held = []
        return hold

    def hold(self, payload: StepPayload) -> None:
        """Keep a left-out step's batch (its parts) until the next step or the end of the run."""
        self.held = [p for p in self.held if p.step == payload.step] + [payload]
        payload.part = len(self.held) - 1

    def take_held(self) -> list[StepPayload]:
        """The writer is closing: the parts of the step held, the last one handed over (to be
        written: it is the run's last step); empty when none is held."""
        held, self.held = self.held, []
        if not held or held[0].step in self.queued:
            return []
        step = held[0].step
        self.skipped.discard(step)
        self.step_rows[step] = self.batch_rows[step] = 0
        return held

    def metrics(self, step: int) -> dict[str, int]:
        """``rldiag/capture/rows`` (0 for a step left out), ``rldiag/capture/batch_rows`` (where
        known), ``rldiag/capture/bytes`` (once written; 0 for a step left out) and, once the
        byte budget stopped batch capture, ``rldiag/capture/stopped_at_step``. Empty without a
        policy."""
        if not self.policy.active:
            return {}
        out = {ROWS_KEY: self.step_rows.get(step, 0)}
        if step in self.batch_rows:
            out[BATCH_ROWS_KEY] = self.batch_rows[step]
        written = self.file_of(step)
        if written is not None or step in self.skipped:
            out[BYTES_KEY] = written or 0
        if self.stopped_at is not None:
            out[STOPPED_KEY] = self.stopped_at
        return out

    def with_policy(self, tree: Any) -> Any:
        """``run.yaml``'s tree with the policy recorded under ``rldiag.capture`` (when one is set)."""
        if not self.policy.active or not isinstance(tree, dict):
            return tree
        rldiag = dict(tree.get("rldiag") or {})
        rldiag["capture"] = {**dict(rldiag.get("capture") or {}), **self.policy.record()}
        return {**tree, "rldiag": rldiag}

    # -- the writer thread -----------------------------------------------------------------------
    def written(self, step: int, size: int) -> int:
        """``step``'s file is now ``size`` bytes (every part so far); returns the bytes it added."""
        with self._lock:
            added = size - self.step_bytes.get(step, 0)
            self.step_bytes[step] = size
            self.written_bytes += added
        return added

    def file_of(self, step: int) -> int | None:
        """``step``'s batch file's bytes, once written."""
        with self._lock:
            return self.step_bytes.get(step)
