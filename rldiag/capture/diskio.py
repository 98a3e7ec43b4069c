"""The capture writer's one I/O seam: every file the writer thread writes goes through a
:class:`WriterDisk` (the step's batch file, ``metrics.jsonl``'s lines and their fsync,
``run.yaml``, the directories). Tests inject disk faults here (a patched method raising
``ENOSPC`` or ``EACCES``, a slow write), never by mounting a file system or changing modes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rldiag.capture.config import write_config
from rldiag.capture.table import write_step_file
from rldiag.capture.unpad import StepPayload
from rldiag.io.run_layout import RunLayout
from rldiag.io.staged import LineAppender


class WriterDisk:
    """The files of one run directory, as the capture writer writes them.

    ``open``/``write`` are the system calls of ``metrics.jsonl``'s appends (a line whole or not
    at all: :class:`~rldiag.io.staged.LineAppender`); ``write_step`` writes a batch file (a hidden
    temporary renamed into place: :func:`~rldiag.capture.table.write_step_file`)."""

    def __init__(self, layout: RunLayout):
        self.layout = layout
        # metrics.jsonl, opened on the first line; through this object's open and write
        self.lines = LineAppender(layout.metrics_file, opener=self.open, write=self.write)

    # -- system calls -------------------------------------------------------------------------
    def open(self, path: Path, flags: int, mode: int) -> int:
        return os.open(path, flags, mode)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        return os.write(fd, data)

    # -- files --------------------------------------------------------------------------------
    def make_dirs(self) -> bool:
        """The run directory and its ``batches/`` exist (made again after a removal); True when
        something had to be made."""
        made = not self.layout.batches_dir.is_dir()
        if made:
            self.layout.batches_dir.mkdir(parents=True, exist_ok=True)
        return made

    def write_step(self, payload: StepPayload, compression: str,
                   token_text: Callable[[Sequence[int]], list[str]] | None) -> int:
        """Write one step's batch file; its size in bytes."""
        return write_step_file(payload, compression, token_text)

    def write_config(self, config: Any) -> Path:
        return write_config(self.layout.root, config)

    def append_line(self, line: str) -> None:
        self.lines.append(line)

    def sync_lines(self) -> None:
        self.lines.sync()

    def close(self) -> None:
        self.lines.close()
