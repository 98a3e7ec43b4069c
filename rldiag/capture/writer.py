"""``RunWriter``: a trainer writes a run directory (docs/run-directory.md) while it trains.

On the training thread, ``write_batch`` only unpads the step (one gather per column, copied to
the CPU) and puts it on a bounded queue; ``log_metrics`` only turns the values into plain
numbers. A background thread builds the Arrow table, validates it, writes the Parquet file
atomically and appends the metrics lines, in call order (both through :mod:`rldiag.io.staged`:
``replace_file``, ``LineAppender``). The run directory is on local (or shared) disk: an object
store cannot append to ``metrics.jsonl``. When the queue is full the training
thread waits (back-pressure: memory stays bounded when the disk is slower than training).

A failure on the writer thread is never lost: it is raised as :class:`CaptureError` on the
next call to the writer (``write_batch``, ``log_metrics``, ``flush``, ``sync``) or on
``close()``; the writer goes on with the items after it. A writer still open when the
interpreter exits is closed then (its queued steps written, its errors printed to stderr); but
an exit hook does not run when the process is killed, nor reliably inside a Ray actor, so a
trainer calls ``sync()`` at the end of each step: everything queued is then on disk, fsynced,
and a kill loses at most the step in flight.

Writing one step twice (verl's ``separate_async`` trainer hands over a step in
``parameter_sync_step`` parts) keeps both writes: the second is appended to the first as part 1
of the step (see :mod:`rldiag.capture.table`). A step file left by an *earlier* writer (a run
resumed from a checkpoint re-does the steps after it) is replaced by the first write of this
writer, with a warning.
"""

from __future__ import annotations

import atexit
import json
import queue
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rldiag.capture.config import write_config
from rldiag.capture.table import token_strings, write_step_file
from rldiag.capture.unpad import unpad_batch
from rldiag.errors import CaptureError
from rldiag.io.atomic import remove_stale
from rldiag.io.fs import is_uri
from rldiag.io.run_layout import METRICS_FILE, RunLayout
from rldiag.io.staged import LineAppender

_STOP = object()
_SYNC = ("sync", None)
#: Writers not closed yet; at interpreter exit they are closed (queued steps written, errors
#: printed) rather than lost with their daemon thread.
_OPEN: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_writers() -> None:
    for writer in list(_OPEN):
        try:
            writer.close()
        except CaptureError as exc:  # nowhere left to raise it
            print(f"rldiag.capture: {exc}", file=sys.stderr)


@dataclass
class CaptureStats:
    """What capture cost so far. Seconds on the training thread include waiting on a full queue."""

    steps: int = 0
    parts: int = 0
    replaced_steps: int = 0
    metric_lines: int = 0
    bytes: int = 0
    train_thread_s: float = 0.0
    writer_thread_s: float = 0.0
    max_queue: int = 0


def _number(value: Any) -> Any:
    """A metric value as a JSON number (tensors / numpy scalars unwrapped); other values as str."""
    item = getattr(value, "item", None)
    if callable(item):
        value = item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


class RunWriter:
    """Write a run directory from a trainer.

    >>> with RunWriter("runs/exp1", config=cfg) as run:          # doctest: +SKIP
    ...     for step in range(1, n + 1):
    ...         batch = train_one_step()                           # padded (rows, R) tensors
    ...         run.write_batch(step, batch)
    ...         run.log_metrics(step, metrics)

    Args:
        path: the run directory (created if missing; an existing one is appended to), on local
            (or shared) disk: ``metrics.jsonl`` is appended to line by line, which an object
            store cannot do (copy the directory to the store afterwards, or point rldiag at it
            where it is).
        config: the training config, written to ``run.yaml`` (dict, OmegaConf, dataclass, ...).
        queue_size: steps and metric lines that may wait for the writer thread.
        compression: Parquet compression codec.
        extra_columns: further per-row fields to keep in every batch file.
        tokenizer: with one (anything with ``convert_ids_to_tokens`` or ``decode``, e.g. a Hugging
            Face tokenizer), each batch file also gets ``response_tokens``, the text of every
            response token (list<string>, the row's length); the batch must then hold
            ``responses``. A batch that also holds ``prompts`` (verl's left-padded prompt ids,
            unpadded by the prompt part of ``attention_mask``) gets ``prompt_tokens`` too, one
            string per prompt token. The text is made on the writer thread.
    """

    def __init__(
        self,
        path: str | Path,
        config: Any = None,
        *,
        queue_size: int = 8,
        compression: str = "zstd",
        extra_columns: Sequence[str] = (),
        tokenizer: Any = None,
    ):
        if is_uri(str(path)):
            raise CaptureError(f"{path}: the capture writes a run directory on local (or shared) disk; an object "
                               "store cannot append to metrics.jsonl (copy the directory there afterwards)")
        self.path = Path(path)
        self.layout = RunLayout(self.path)
        self.batches_dir.mkdir(parents=True, exist_ok=True)
        # temporary files of a writer killed mid-write (never those of one still running)
        remove_stale(self.batches_dir)
        remove_stale(self.path)
        self.compression = compression
        self.extra_columns = tuple(extra_columns)
        self.tokenizer = tokenizer
        self._token_text = None if tokenizer is None else (lambda ids: token_strings(tokenizer, ids))
        self._parts: dict[int, int] = {}  # step -> writes of it by this writer
        self.stats = CaptureStats()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, int(queue_size)))
        self._errors: list[tuple[str, BaseException]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._metrics = LineAppender(self.metrics_file)  # metrics.jsonl, opened on the first line
        if config is not None:
            self.write_config(config)
        self._thread = threading.Thread(target=self._run, name="rldiag-capture-writer", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    # -- layout -----------------------------------------------------------------------------
    @property
    def batches_dir(self) -> Path:
        return self.layout.batches_dir

    @property
    def metrics_file(self) -> Path:
        return self.layout.metrics_file

    def batch_path(self, step: int) -> Path:
        return self.layout.batch_file(step)

    # -- training-thread API -------------------------------------------------------------------
    def write_config(self, config: Any) -> Path:
        """Write (or replace) ``run.yaml`` now, atomically."""
        self._check()
        return write_config(self.path, config)

    def write_batch(self, step: int, batch: Any) -> int:
        """Queue one step's batch: a mapping of padded ``(rows, R)`` tensors (plus ``uid``) or a
        DataProto-like object. Structural problems raise :class:`~rldiag.errors.BatchError` here.

        Returns the part number: 0 for the first write of ``step`` by this writer, K for the
        (K+1)-th, whose rows are appended to the step's file (nothing is replaced)."""
        self._check()
        t0 = time.perf_counter()
        step = int(step)
        path = self.batch_path(step)
        part = self._parts.get(step, 0)
        payload = unpad_batch(batch, step, path, self.extra_columns, token_ids=self._token_text is not None)
        payload.part = part
        if part == 0 and path.exists():
            self.stats.replaced_steps += 1
            warnings.warn(f"rldiag.capture: {path} was written by an earlier run; step {step} is written "
                          "again (a resumed run), so its file is replaced", stacklevel=2)
        self._parts[step] = part + 1
        self._put(("batch", payload))
        self.stats.train_thread_s += time.perf_counter() - t0
        return part

    def parts(self, step: int) -> int:
        """How many times this writer was given ``step`` (0 if never)."""
        return self._parts.get(int(step), 0)

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Queue one line ``{"step": N, "data": {...}}`` for ``metrics.jsonl`` (verl's file logger)."""
        self._check()
        t0 = time.perf_counter()
        data = {str(k): _number(v) for k, v in metrics.items()}
        line = json.dumps({"step": int(step), "data": data}, allow_nan=True)
        self._put(("metrics", line))
        self.stats.train_thread_s += time.perf_counter() - t0

    def run_on_writer(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn()`` on the writer thread once everything queued before it is written (a
        step's batch file is then on disk). Returns a :class:`~concurrent.futures.Future` with
        its result or its exception; neither is raised by the writer's own calls (``fn`` is not
        part of the run directory). Its time counts in ``stats.writer_thread_s``."""
        self._check()
        done: Future = Future()
        self._put(("call", (fn, done)))
        return done

    def flush(self) -> None:
        """Wait until everything queued so far is written; raise what failed meanwhile."""
        if not self._closed:
            self._queue.join()
        self._check(closed_ok=True)

    def sync(self) -> None:
        """The end-of-step barrier: wait until everything queued so far is written and fsynced
        (batch files are fsynced as they are written, ``metrics.jsonl`` here); raise what failed.
        After it returns, a kill of the process (or of the machine) loses nothing queued before."""
        if not self._closed:
            self._put(_SYNC)
        self.flush()

    def close(self) -> None:
        """Write what is queued, stop the writer thread, raise what failed. Idempotent."""
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
            self._thread.join()
            _OPEN.discard(self)
        self._check(closed_ok=True)

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is already on its way: finish writing, do not replace it
            self.close()
        except CaptureError:
            pass

    # -- internals ---------------------------------------------------------------------------
    def _check(self, closed_ok: bool = False) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            what = "; ".join(f"{w}: {type(e).__name__}: {e}" for w, e in errors)
            raise CaptureError(f"the capture writer failed ({len(errors)}): {what}", errors) from errors[0][1]
        if self._closed and not closed_ok:
            raise CaptureError(f"the run writer for {self.path} is closed")

    def _put(self, item) -> None:
        while True:
            try:
                self._queue.put(item, timeout=1.0)
                break
            except queue.Full:
                if not self._thread.is_alive():  # pragma: no cover - the loop catches everything
                    raise CaptureError("the capture writer thread stopped") from None
        self.stats.max_queue = max(self.stats.max_queue, self._queue.qsize())

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                t0 = time.perf_counter()
                kind, payload = item
                if kind == "batch":
                    try:
                        self.stats.bytes += write_step_file(payload, self.compression, self._token_text)
                        self.stats.steps += int(payload.part == 0)
                        self.stats.parts += 1
                    except BaseException as exc:  # noqa: BLE001 - reported on the training thread
                        self._record(f"step {payload.step}" + (f" part {payload.part}" if payload.part else ""), exc)
                elif kind == "call":
                    fn, done = payload
                    if done.set_running_or_notify_cancel():
                        try:
                            done.set_result(fn())
                        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on it
                            done.set_exception(exc)
                elif kind == "sync":
                    try:
                        self._metrics.sync()
                    except BaseException as exc:  # noqa: BLE001
                        self._record(METRICS_FILE, exc)
                else:
                    try:
                        self._metrics.append(payload)
                        self.stats.metric_lines += 1
                    except BaseException as exc:  # noqa: BLE001
                        self._record(METRICS_FILE, exc)
                self.stats.writer_thread_s += time.perf_counter() - t0
            finally:
                self._queue.task_done()
                if item is _STOP:
                    self._metrics.close()

    def _record(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self._errors.append((what, exc))

