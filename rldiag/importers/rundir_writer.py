"""Write an imported run into a run directory, atomically, updating one in place.

The importer streams history rows in and hands over batch files as it finds them; nothing in
the run directory changes until :meth:`RunDirWriter.commit`, which puts each part in place with
one rename (see :mod:`rldiag.io.atomic`), so a reader (a running ``rldiag recompute``, the app)
sees each file old or new, never half-written:

- ``batches/``: a new directory is staged beside it, holding the imported step files plus the
  existing files of steps the import does not bring (hard links, so nothing is copied), then
  swapped in (``renameat2(RENAME_EXCHANGE)`` where the kernel has it);
- ``metrics.jsonl``: spooled to a hidden file beside it, fsynced, renamed over it;
- ``run.yaml``: written with ``yaml.safe_dump``, renamed over it;
- ``rldiag/import/wandb.json``: what was imported from where, and what was not; written last.

An import that fails (or is interrupted) before ``commit`` leaves the run directory as it was.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, TextIO

import yaml

from rldiag.errors import OutputError
from rldiag.io.atomic import remove_stale, replace_dir, staging_dir, temp_name, write_bytes_atomic
from rldiag.io.rundir import STEP_FILE

IMPORT_RECORD = Path("rldiag") / "import" / "wandb.json"


class RunDirWriter:
    """Collects one import and commits it into ``out``."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        if self.out.exists() and not self.out.is_dir():
            raise OutputError(f"--out {self.out} exists and is not a directory")
        self._created = not self.out.exists()
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot create {self.out}: {exc}") from exc
        remove_stale(self.out)  # what an import killed before its commit left behind
        self._spool_path: Path | None = None
        self._spool: TextIO | None = None  # metrics.jsonl being written, at _spool_path
        self._row_step: int | None = None
        self._row: dict[str, Any] | None = None
        self._batch_stage: Path | None = None
        self._batches: dict[int, tuple[str, str]] = {}  # step -> (file name, source label)
        self.rows = 0
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.keys: set[str] = set()
        self.merged_rows = 0
        self.out_of_order_rows = 0
        self.batch_replaced: list[tuple[int, str, str]] = []  # (step, dropped source, kept source)
        self.committed = False

    # -- history --------------------------------------------------------------------------------

    def _spool_file(self) -> TextIO:
        """The spool of ``metrics.jsonl``, opened on first use."""
        if self._spool is None:
            self._spool_path = self.out / temp_name("metrics.jsonl")
            self._spool = self._spool_path.open("w", encoding="utf-8", newline="\n")
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

    def _stage(self) -> Path:
        if self._batch_stage is None:
            self._batch_stage = staging_dir(self.out / "batches")
        return self._batch_stage

    def batch_target(self, step: int, name: str, source: str) -> Path:
        """A path inside the staged ``batches/`` to write step ``step`` to (as file ``name``).

        A step already brought by this import is replaced (the later artifact wins); the
        replacement is reported.
        """
        if not STEP_FILE.match(name):
            raise OutputError(f"{name!r} is not a batch file name (step_<N>.parquet or .arrow)")
        stage = self._stage()
        if step in self._batches:
            old_name, old_source = self._batches[step]
            (stage / old_name).unlink(missing_ok=True)
            self.batch_replaced.append((step, old_source, source))
        self._batches[step] = (name, source)
        return stage / name

    def add_batch_file(self, step: int, name: str, src: Path, source: str, move: bool = False) -> None:
        """Stage a copy (or, with ``move``, the file itself) of ``src`` as step ``step``."""
        dst = self.batch_target(step, name, source)
        try:
            if move:
                os.replace(src, dst)
            else:
                shutil.copyfile(src, dst)
        except OSError as exc:
            raise OutputError(f"cannot stage batch file {src} -> {dst}: {exc}") from exc

    @property
    def batch_steps(self) -> list[int]:
        return sorted(self._batches)

    def _finish_batches(self) -> None:
        stage = self._batch_stage
        if stage is None:
            return
        target = self.out / "batches"
        if target.is_dir():  # keep the steps this import does not bring
            for p in target.iterdir():
                m = STEP_FILE.match(p.name)
                if m is None:
                    if p.is_file() and not p.name.startswith("."):
                        _link_or_copy(p, stage / p.name)
                    continue
                if int(m.group(1)) in self._batches or not p.is_file():
                    continue
                _link_or_copy(p, stage / p.name)
        for p in stage.iterdir():
            if p.is_file():
                with p.open("rb") as fh:
                    os.fsync(fh.fileno())
        replace_dir(stage, target)
        self._batch_stage = None

    # -- commit ---------------------------------------------------------------------------------

    def commit(self, *, config: dict[str, Any] | None, record: dict[str, Any], write_metrics: bool = True) -> None:
        """Put everything in place. ``config=None`` leaves ``run.yaml`` as it is."""
        try:
            self._finish_batches()
            if write_metrics:
                spool = self._spool_file()
                self._flush_row()
                spool.flush()
                os.fsync(spool.fileno())
                spool.close()
                self._spool = None
                assert self._spool_path is not None  # set with the spool
                os.replace(self._spool_path, self.out / "metrics.jsonl")
                self._spool_path = None
            if config is not None:
                text = yaml.safe_dump(config, sort_keys=False, allow_unicode=True, default_flow_style=False)
                write_bytes_atomic(self.out / "run.yaml", text.encode("utf-8"))
            write_bytes_atomic(self.out / IMPORT_RECORD, (json.dumps(record, indent=2, allow_nan=False) + "\n").encode("utf-8"))
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
        if self._spool_path is not None:
            self._spool_path.unlink(missing_ok=True)
            self._spool_path = None
        if self._batch_stage is not None:
            shutil.rmtree(self._batch_stage, ignore_errors=True)
            self._batch_stage = None
        if self._created and not self.committed:
            try:
                self.out.rmdir()  # only when empty
            except OSError:
                pass


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
