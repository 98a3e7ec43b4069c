"""One error hierarchy for rldiag: every error class is defined here.

Every error rldiag raises on purpose derives from :class:`RldiagError`; the CLI catches it once,
prints ``Type: message`` and exits with the command's code (:mod:`rldiag.cli.exit_codes`). Errors
about input data carry where the problem is (file, step, row, column) so that the message can
point at it. The tree::

    RldiagError                  anything rldiag reports to a user
    +-- ConfigError              a setting is unknown or malformed; a config file cannot be read
    |   +-- UnknownKeyError      a registry key (estimator, loss mode, ...) rldiag does not know
    +-- RunDirError              the run directory is missing or has no usable batches
    +-- BatchError               a batch file is malformed (file, step, row, column)
    |   +-- MissingInputError    the settings need a column the batch does not have
    +-- ComputeError             verl would raise on this input; the step fails
    +-- InternalError            a bug in rldiag (a TypeError, IndexError, ... it did not mean to raise),
    |                            with its traceback; the command line asks for a report and exits 3
    +-- OutputError              writing results failed
    |   +-- DiskSpaceError       the outputs asked for would not fit on the disk
    |   +-- ExportError          a figure cannot be saved as PNG / SVG (kaleido or a Chromium missing)
    +-- StorageError             an object store (s3://...) cannot be reached or refused a request
    +-- ExecutorError            a distributed executor cannot start, or lost work
    +-- CaptureError             writing a run directory from a trainer failed (rldiag.capture)
    +-- StoreError               a run's file cannot be queried (rldiag.store, the app)
    +-- QueryError               a rows query's filter, sort or scenario is malformed (rldiag.rows)
    +-- WandbImportError         a W&B source cannot be imported (rldiag.importers)
    |   +-- WandbMissingError    the optional wandb package is not installed
    +-- RewardError              a reward function cannot be found, loaded or allowed to run (rldiag rescore)

``rldiag.store.errors`` and ``rldiag.importers`` re-export their classes from here.
"""

from __future__ import annotations

import traceback as tb


class RldiagError(Exception):
    """Base class of every error rldiag reports to a user."""


class ConfigError(RldiagError):
    """A setting is unknown, malformed, or a config file cannot be read."""


class UnknownKeyError(ConfigError):
    """A registry key (estimator, loss mode, ...) that rldiag does not know."""

    def __init__(self, kind: str, key: object, valid: list[str]):
        self.kind, self.key, self.valid = kind, key, sorted(valid)
        super().__init__(f"unknown {kind} {key!r}; valid: {', '.join(self.valid)}")


class RunDirError(RldiagError):
    """The run directory is missing or has no usable batches."""


class BatchError(RldiagError):
    """A batch file is malformed. The message names file, step, row and column where known."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        step: int | None = None,
        row: int | None = None,
        column: str | None = None,
    ):
        self.file, self.step, self.row, self.column = file, step, row, column
        self.detail = message
        where = []
        if file is not None:
            where.append(f"file {file}")
        if step is not None:
            where.append(f"step {step}")
        if row is not None:
            where.append(f"row {row}")
        if column is not None:
            where.append(f"column {column!r}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)


class MissingInputError(BatchError):
    """The settings need a column that the batch does not have."""


class ComputeError(RldiagError):
    """verl would raise on this input (e.g. whitening over a single token); the step fails."""


class InternalError(RldiagError):
    """A bug in rldiag: an exception it did not mean to raise (a ``TypeError``, an ``IndexError``,
    ... inside the engine), as opposed to an input it refuses (:class:`ComputeError`,
    :class:`BatchError`). ``traceback`` is the original exception's, which the command line
    prints with a request to report it (exit code 3, :mod:`rldiag.cli.exit_codes`)."""

    def __init__(self, message: str, traceback: str = ""):
        self.traceback = traceback
        super().__init__(message)

    @classmethod
    def of(cls, exc: BaseException, where: str) -> InternalError:
        """``exc`` raised ``where`` (``"steps 3, 4"``): ``where: Type: message``, its traceback kept."""
        return cls(f"{where}: {type(exc).__name__}: {exc}", "".join(tb.format_exception(exc)))


class OutputError(RldiagError):
    """Writing results failed."""


class DiskSpaceError(OutputError):
    """The outputs asked for would not fit on the disk (``rldiag sweep --save-tokens``)."""


class ExportError(OutputError):
    """A figure cannot be saved as an image: kaleido, or the Chromium it drives, is missing; the
    message says what to install."""


class StorageError(RldiagError):
    """An object store (``s3://...``) cannot be reached, or refused a request."""


class ExecutorError(RldiagError):
    """A distributed executor (``--executor ray``) cannot start, or lost work it cannot redo."""


class CaptureError(RldiagError):
    """Writing a run directory from a trainer failed (``rldiag.capture``).

    Raised on the training thread: either at once (a malformed batch, a closed writer) or, for
    a failure inside the background writer, on the next call to the writer or on ``close()``.
    ``errors`` holds ``(what, exception)`` for every failure being reported.
    """

    def __init__(self, message: str, errors: list[tuple[str, BaseException]] | None = None):
        self.errors = list(errors or [])
        super().__init__(message)


class RewardError(RldiagError):
    """A reward function (``rldiag rescore``, ``probe-reward``) cannot be found or loaded, is not
    allowed to run (code-executing data sources without ``--allow-code-exec``), or the run lacks
    what it reads. A call that raises or times out is not an error: its row is reported."""


class StoreError(RldiagError):
    """A file of the run cannot be queried (unreadable, malformed, or still being written)."""


class QueryError(RldiagError):
    """A query of the per-row tables (:func:`rldiag.rows`) is malformed: its ``where`` expression
    (a column it does not have, a function or keyword it may not use, a syntax error), its sort
    column, or a scenario it names."""


class WandbImportError(RldiagError):
    """A W&B source cannot be imported: unreadable file, unknown run, no network, no key, ..."""


class WandbMissingError(WandbImportError):
    """The optional ``wandb`` package is not installed."""
