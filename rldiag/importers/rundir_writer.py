"""Write an imported run into a run directory, atomically, updating one in place; the run
directory is local or in an object store (``s3://bucket/run``).

The importer streams history rows in and hands over batch files as it finds them; everything is
staged (:mod:`rldiag.io.staged`) and nothing in the run directory changes until
:meth:`RunDirWriter.commit`, which puts each part in place:

- ``batches/``: replaced whole by the imported step files plus the existing files of steps the
  import does not bring (on disk: a staging directory holding hard links to those, swapped in
  with ``renameat2(RENAME_EXCHANGE)`` where the kernel has it);
- ``metrics.jsonl``: spooled to a staged file, fsynced, renamed over it;
- ``run.yaml``: written with ``yaml.safe_dump``, renamed over it;
- ``rldiag/import/wandb.json``: what was imported from where, and what was not; written last.

On disk a reader (a running ``rldiag recompute``, the app) sees each file old or new, never
half-written. In an object store each part is one upload (an object appears whole), after the
previous ``wandb.json`` is deleted and before the new one is written. An import that fails (or
is interrupted) before ``commit`` leaves the run directory as it was, local or in a store.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

import yaml

from rldiag.errors import OutputError
from rldiag.io.fs import RemotePath
from rldiag.io.run_layout import BATCHES_DIR, METRICS_FILE, RUN_CONFIG, STEP_FILE, RunLayout
from rldiag.io.staged import StagedWriter, open_staged

#: The import's record, relative to the run directory.
IMPORT_RECORD = RunLayout.WANDB_IMPORT


class RunDirWriter:
    """Collects one import and commits it into ``out`` (a directory, or a URI)."""

    def __init__(self, out: str | Path | RemotePath):
        self.layout = RunLayout(out)
        self.out: Path | RemotePath = self.layout.root
        self._writer: StagedWriter = open_staged(self.out, replace=False, marker=IMPORT_RECORD, durable=True)
        self._spool: TextIO | None = None  # metrics.jsonl being written, staged
        self._row_step: int | None = None
        self._row: dict[str, Any] | None = None
        self._batch_writer: StagedWriter | None = None
        self._batches: dict[int, tuple[str, str]] = {}  # step -> (file name, source label)
        self.rows = 0
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.keys: set[str] = set()
        self.merged_rows = 0
        self.out_of_order_rows = 0
        self.batch_replaced: list[tuple[int, str, str]] = []  # (step, dropped source, kept source)
        self.committed = False

    @property
    def scratch(self) -> Path:
        """A local directory for the import's temporary files (downloads), where moving one into
        the staged run is a rename (:meth:`StagedWriter.scratch`)."""
        return self._writer.scratch()

    # -- history --------------------------------------------------------------------------------

    def _spool_file(self) -> TextIO:
        """The spool of ``metrics.jsonl``, opened on first use."""
        if self._spool is None:
            path = self._writer.local_path(METRICS_FILE)
            self._spool = path.open("w", encoding="utf-8", newline="\n")
        return self._spool

    def add_row(self, step: int, data: dict[str, Any]) -> None:
        """One history row. Consecutive rows of one step are merged (later keys win), as W&B does."""
        self._spool_file()
        if self._row is not None and step == self._row_step:
            self._row.update(data)
            self.merged_rows += 1
            return
        self._flush_row()
        if self.last_step is not None and step < self.last_step:
            self.out_of_order_rows += 1
        self._row_step, self._row = step, dict(data)

    def flush_rows(self) -> None:
        """Write out the row still open for merging; ``rows``, ``keys`` and the steps are then final."""
        self._flush_row()

    def _flush_row(self) -> None:
        if self._row is None:
            return
        step, row = self._row_step, self._row
        assert step is not None  # set with the row
        spool = self._spool_file()  # opened by the row's add_row
        spool.write(json.dumps({"step": step, "data": row}, allow_nan=True))
        spool.write("\n")
        self.rows += 1
        self.keys.update(row)
        if self.first_step is None:
            self.first_step = step
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        self._row = None
        self._row_step = None

    # -- batches --------------------------------------------------------------------------------

    def _stage(self) -> StagedWriter:
        """The writer of ``batches/`` (replaced whole at commit), opened on the first batch."""
        if self._batch_writer is None:
            self._batch_writer = self._writer.subdir(BATCHES_DIR)
        return self._batch_writer

    def _claim(self, step: int, name: str, source: str) -> StagedWriter:
        """Step ``step`` comes as file ``name``: a step already brought by this import is replaced
        (the later artifact wins), and the replacement reported."""
        if not STEP_FILE.match(name):
            raise OutputError(f"{name!r} is not a batch file name (step_<N>.parquet or .arrow)")
        stage = self._stage()
        if step in self._batches:
            old_name, old_source = self._batches[step]
            stage.discard(old_name)
            self.batch_replaced.append((step, old_source, source))
        self._batches[step] = (name, source)
        return stage

    def batch_target(self, step: int, name: str, source: str) -> Path:
        """A local path inside the staged ``batches/`` to write step ``step`` to (as file ``name``)."""
        return self._claim(step, name, source).local_path(name)

    def add_batch_file(self, step: int, name: str, src: Path, source: str, move: bool = False) -> None:
        """Stage a copy (or, with ``move``, the file itself) of ``src`` as step ``step``."""
        self._claim(step, name, source).add_file(name, src, move=move)

    @property
    def batch_steps(self) -> list[int]:
        return sorted(self._batches)

    def _keep_other_batches(self) -> None:
        """The files of ``batches/`` that the import does not replace stay (other steps, other
        files; not hidden ones)."""
        stage = self._batch_writer
        target = self.layout.batches_dir
        if stage is None or not target.is_dir():
            return
        for p in target.iterdir():
            if not p.is_file() or p.name.startswith("."):
                continue
            m = STEP_FILE.match(p.name)
            if m is None or int(m.group(1)) not in self._batches:
                stage.keep(p.name)

    # -- commit ---------------------------------------------------------------------------------

    def commit(self, *, config: dict[str, Any] | None, record: dict[str, Any], write_metrics: bool = True) -> None:
        """Put everything in place, ``rldiag/import/wandb.json`` (``record``) last. ``config=None``
        leaves ``run.yaml`` as it is, ``write_metrics=False`` ``metrics.jsonl``."""
        try:
            self._keep_other_batches()
            if self._spool is not None:
                self._flush_row()
                self._spool.close()
                self._spool = None
            if not write_metrics:
                self._writer.discard(METRICS_FILE)
            elif METRICS_FILE not in self._writer.staged():
                self._writer.write_bytes(METRICS_FILE, b"")
            if config is not None:
                text = yaml.safe_dump(config, sort_keys=False, allow_unicode=True, default_flow_style=False)
                self._writer.write_bytes(RUN_CONFIG, text.encode("utf-8"))
            self._writer.commit(record)
            self.committed = True
        except OSError as exc:
            raise OutputError(f"cannot write the run directory {self.out}: {exc}") from exc
        finally:
            self.abort()

    def abort(self) -> None:
        """Drop whatever was staged and not committed (and ``out`` itself if this import made it)."""
        if self._spool is not None:
            self._spool.close()
            self._spool = None
        self._writer.abort()
