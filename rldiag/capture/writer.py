"""``RunWriter``: a trainer writes a run directory (docs/run-directory.md) while it trains.

On the training thread, ``write_batch`` only unpads the step (one gather per column, copied to
the CPU) and puts it on a bounded queue; ``log_metrics`` only turns the values into plain
numbers. A background thread builds the Arrow table, validates it, writes the Parquet file
atomically and appends the metrics lines, in call order (both through :mod:`rldiag.io.staged`:
``replace_file``, ``LineAppender``). The run directory is on local (or shared) disk: an object
store cannot append to ``metrics.jsonl``. When the queue is full the training
thread waits (back-pressure: memory stays bounded when the disk is slower than training).

What the writer does when something fails is its ``on_error`` policy:

- ``"warn"`` (the default; the verl capture's and the toy trainer's): the capture never stops
  or slows training. A failed write (a full disk, a permission denied, a run directory removed
  or replaced) is warned once per cause, with the path and what is skipped, and counted
  (:meth:`RunWriter.fault_metrics`: ``rldiag/capture/dropped_steps``, ``rldiag/capture/errors``,
  which the trainer logs with its metrics from the first fault on); the next write is tried as
  usual, so capture resumes by itself when the fault clears (a removed run directory is made
  again, ``run.yaml`` with it). The queue is bounded in bytes (``max_queue_bytes``): when the
  disk is slower than training, a step's batch waits for room at most ``max_wait_s`` and at
  most ``wait_share`` (5 %) of a training step, and is then dropped (counted); the end-of-step
  barrier waits at most as long (then the step's writes are fsynced later). A malformed batch is
  dropped (counted) rather than raised. Nothing half-written stays: a batch file appears whole
  (a hidden temporary renamed into place) and a ``metrics.jsonl`` line that failed part-way is
  cut off again.
- ``"raise"``: a failure on the writer thread is never lost: it is raised as
  :class:`CaptureError` on the next call to the writer (``write_batch``, ``log_metrics``,
  ``flush``, ``sync``) or on ``close()``; the writer goes on with the items after it. When the
  queue is full the training thread waits (back-pressure). A malformed batch raises at once.

Every file operation of the writer thread goes through one seam,
:class:`rldiag.capture.diskio.WriterDisk` (where tests inject faults). With ``handle_sigterm``
(a trainer's main thread), ``SIGTERM`` first lets the pending writes finish within
``max_wait_s`` (or drops them whole), then runs the handler that was there before.

A writer still open when the interpreter exits is closed then (its queued steps written, its
errors printed to stderr); but an exit hook does not run when the process is killed, nor
reliably inside a Ray actor, so a trainer calls ``sync()`` at the end of each step: everything
queued is then on disk, fsynced, and a kill loses at most the step in flight.

Writing one step twice (verl's ``separate_async`` trainer hands over a step in
``parameter_sync_step`` parts) keeps both writes: the second is appended to the first as part 1
of the step (see :mod:`rldiag.capture.table`). A step file left by an *earlier* writer (a run
resumed from a checkpoint re-does the steps after it) is replaced by the first write of this
writer, with a warning.
"""

from __future__ import annotations

import atexit
import json
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

import numpy as np

from rldiag.capture.backlog import Backlog
from rldiag.capture.config import config_yaml, plain
from rldiag.capture.diskio import WriterDisk
from rldiag.capture.faults import ON_ERROR, FaultLog, SigtermChain, cause
from rldiag.capture.ledger import PolicyLedger
from rldiag.capture.policy import BYTES_KEY, ROWS_KEY, SEED_MODULUS, CapturePolicy, run_seed, sample_record
from rldiag.capture.table import TokenText
from rldiag.capture.unpad import StepPayload, split_batch, unpad_batch
from rldiag.errors import CaptureError, RldiagError
from rldiag.io.atomic import remove_stale
from rldiag.io.fs import is_uri
from rldiag.io.run_layout import METRICS_FILE, RUN_CONFIG, RunLayout

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
    max_queue_bytes: int = 0
    dropped_steps: int = 0  # batches not written (failed, dropped on a full queue, malformed)
    errors: int = 0  # failed writes, appends, fsyncs
    late_syncs: int = 0  # end-of-step barriers that did not wait for the writer ("warn": it was behind)


def payload_bytes(payload: StepPayload) -> int:
    """The memory a queued step holds: its arrays' bytes."""
    arrays = [payload.lengths, *payload.tokens.values(), *payload.rows.values(), payload.token_ids,
              payload.prompt_ids, payload.prompt_lengths]
    return max(1, sum(int(getattr(a, "nbytes", 0)) for a in arrays if a is not None))


def batch_rows(batch: Any) -> int | None:
    """The rows of a padded batch (its ``response_mask``'s first dimension), None when unknown."""
    try:
        tensors, _ = split_batch(batch)
    except RldiagError:
        return None
    mask = tensors.get("response_mask")
    return int(mask.shape[0]) if mask is not None and getattr(mask, "ndim", 0) == 2 else None


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
            string per prompt token. A tokenizer that decodes (``batch_decode`` or ``decode``)
            also gives ``response_text`` and ``prompt_text``, each row decoded whole as verl's
            reward manager decodes it (``skip_special_tokens=True``). The text is made on the
            writer thread. A batch's non-tensor ``data_source``, ``reward_model`` (its
            ``ground_truth``) and ``extra_info`` become the columns a reward function reads
            (:mod:`rldiag.capture.reward_inputs`), with or without a tokenizer.
        on_error: ``"warn"`` (default: faults warned once, counted, training never stopped nor
            held up) or ``"raise"`` (faults raised on the next call; a full queue makes the
            trainer wait); see the module docstring.
        max_queue_bytes: the bytes of queued batches (their unpadded arrays) the writer may hold.
        max_wait_s: with ``"warn"``, the longest the training thread waits for room in the queue
            (then the step's batch is dropped), for the end-of-step barrier, and on ``SIGTERM``.
        wait_share: with ``"warn"``, those waits are also at most this share of a training step
            (the time between two steps' first writes; None: ``max_wait_s`` alone), so that a
            writer slower than training costs it no more than that share.
        handle_sigterm: on ``SIGTERM``, let pending writes finish first, then run the handler
            that was there before (installed only when made on the main thread).
        every, groups, max_gb: the capture policy (:mod:`rldiag.capture.policy`): the batches
            of every N-th step (and of the first and last), K whole prompt groups (or a share in
            (0, 1)) of each, batch capture stopped once the run's batch files reach X GB.
        seed: the group draw's seed, modulo 2^31 (None: the config's ``data.seed`` or
            ``trainer.seed``, else 0).
        last_step: the run's last step (``every``'s last step; the verl capture sets it from the
            trainer's ``total_training_steps``). While it is None, a step ``every`` leaves out is
            kept in memory until the next one, so that the step the writer is closed after is
            written.
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
        on_error: str = "warn",
        max_queue_bytes: int = 1 << 30,
        max_wait_s: float = 1.0,
        wait_share: float | None = 0.05,
        handle_sigterm: bool = False,
        every: int = 1,
        groups: int | float | None = None,
        max_gb: float | None = None,
        seed: int | None = None,
        last_step: int | None = None,
    ):
        if is_uri(str(path)):
            raise CaptureError(f"{path}: the capture writes a run directory on local (or shared) disk; an object "
                               "store cannot append to metrics.jsonl (copy the directory there afterwards)")
        if on_error not in ON_ERROR:
            raise CaptureError(f"on_error={on_error!r}: expected one of {', '.join(ON_ERROR)}")
        self.on_error = on_error
        self.max_wait_s = float(max_wait_s)
        self.wait_share = wait_share
        self._step_s: float | None = None  # the time between the last two steps' first writes
        self._step_t: float | None = None
        self.faults = FaultLog()
        self.stats = CaptureStats()
        self._lock = threading.Lock()
        self._dropped: set[int] = set()  # steps a part of which was not written
        self.path = Path(path)
        self.layout = RunLayout(self.path)
        self.disk = WriterDisk(self.layout)
        self._config: dict | None = None  # run.yaml's tree, written again into a run directory made again
        try:
            self.disk.make_dirs()
            # temporary files of a writer killed mid-write (never those of one still running)
            remove_stale(self.batches_dir)
            remove_stale(self.path)
        except OSError as exc:
            if on_error == "raise":
                raise
            self.fault("setup", str(self.batches_dir), exc, "nothing is written until it can be", errors=1)
        self.compression = compression
        self.extra_columns = tuple(extra_columns)
        self.tokenizer = tokenizer
        self._token_text = None if tokenizer is None else TokenText(tokenizer)
        self._parts: dict[int, int] = {}  # step -> writes of it by this writer
        self._queue = Backlog(queue_size, max_queue_bytes)
        # writer-thread failures not reported yet: (what, exception, kind of fault, warning text)
        self._errors: list[tuple[str, BaseException, str, str]] = []
        self._sync_done: threading.Event | None = None  # the last end-of-step barrier ("warn")
        self._closed = False
        policy = CapturePolicy(every=every, groups=groups, max_gb=max_gb,
                               seed=run_seed(plain(config)) if seed is None else int(seed) % SEED_MODULUS)
        self.ledger = PolicyLedger(policy, self.batches_dir, last_step)
        if config is not None:
            self.write_config(config)
        elif self.policy.active and not (self.layout.root / RUN_CONFIG).exists():
            self.write_config({})  # the policy recorded where a recompute reads it
        self._thread = threading.Thread(target=self._run, name="rldiag-capture-writer", daemon=True)
        self._thread.start()
        self._sigterm = SigtermChain(self._drain) if handle_sigterm else None
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
        """Write (or replace) ``run.yaml`` now, atomically. A config that is not a mapping raises
        (a configuration error, found before step 1); with ``"warn"``, a failed write is warned."""
        if not self._check():
            return self.layout.root / RUN_CONFIG
        config_yaml(config)  # raises on a config that is not a mapping
        self._config = self.ledger.with_policy(plain(config))
        path = self.layout.root / RUN_CONFIG
        try:
            return self.disk.write_config(self._config)
        except OSError as exc:
            if self.on_error == "raise":
                raise
            self.fault("config", str(path), exc, "run.yaml is not written", errors=1)
            return path

    def fault_metrics(self) -> dict[str, int]:
        """``rldiag/capture/dropped_steps`` and ``rldiag/capture/errors`` for the trainer's
        metrics, once a fault happened (empty before). Faults found so far are reported first."""
        self._check(closed_ok=True)
        return self.faults.metrics()

    def write_batch(self, step: int, batch: Any) -> int:
        """Queue one step's batch: a mapping of padded ``(rows, R)`` tensors (plus ``uid``) or a
        DataProto-like object. Structural problems raise :class:`~rldiag.errors.BatchError` here
        with ``on_error="raise"``; with ``"warn"`` the step is dropped (warned once, counted).

        Returns the part number: 0 for the first write of ``step`` by this writer, K for the
        (K+1)-th, whose rows are appended to the step's file (nothing is replaced)."""
        if not self._check():
            return self._parts.get(int(step), 0)
        t0 = time.perf_counter()
        step = int(step)
        path = self.batch_path(step)
        if self.policy.active and not self.ledger.captures(step):
            self.skip(step, batch)
            self.stats.train_thread_s += time.perf_counter() - t0
            return 0
        part = self._parts.get(step, 0)
        self._parts[step] = part + 1
        self._time_step(part)
        try:
            payload = self._unpad(batch, step, path)
        except RldiagError as exc:
            if self.on_error == "raise":
                self._parts[step] = part
                raise
            self.fault("batch", str(path), exc, f"step {step}'s batch is not written", dropped=1, errors=1,
                       step=step)
            return part
        payload.part = part
        if part == 0 and path.exists():
            self.stats.replaced_steps += 1
            self.ledger.replacing(path)
            warnings.warn(f"rldiag.capture: {path} was written by an earlier run; step {step} is written "
                          "again (a resumed run), so its file is replaced", stacklevel=2)
        self._queue_payload(payload)
        self.stats.train_thread_s += time.perf_counter() - t0
        return part

    def _queue_payload(self, payload: StepPayload) -> None:
        step, path = payload.step, payload.path
        self.ledger.queue(payload)
        size = payload_bytes(payload)
        if not self._put(("batch", payload), size):
            self.fault("queue", str(path), None, f"the writer is behind (its queue holds {self._queue.bytes()} "
                        f"bytes, {self._queue.waiting()} batches): step {step}'s batch is dropped", dropped=1, step=step)

    # -- the capture policy (rldiag.capture.policy; its state: rldiag.capture.ledger) -----------------
    @property
    def policy(self) -> CapturePolicy:
        return self.ledger.policy

    @property
    def last_step(self) -> int | None:
        """The run's last step (``every``'s); settable (the trainer's ``total_training_steps``)."""
        return self.ledger.last_step

    @last_step.setter
    def last_step(self, step: int | None) -> None:
        self.ledger.last_step = step

    @property
    def stopped_at(self) -> int | None:
        """The first step the byte budget left out (None while under it)."""
        return self.ledger.stopped_at

    def captures(self, step: int) -> bool:
        """Whether the policy captures ``step``'s batch: ``every``'s steps (the first step this
        writer is handed and :attr:`last_step` among them) while the batch bytes on disk are
        under ``max_gb``. Deciding the first step: call it for the steps in order."""
        return self.ledger.captures(int(step))

    def skipped(self, step: int) -> bool:
        """Whether the policy left ``step``'s batch out (not a fault)."""
        return int(step) in self.ledger.skipped

    def batch_bytes(self) -> int:
        """The bytes of the run's batch files: those on disk when the writer opened (a resumed
        run's) and those it wrote since."""
        return self.ledger.batch_bytes()

    def capture_metrics(self, step: int) -> dict[str, int]:
        """``rldiag/capture/rows``, ``batch_rows``, ``bytes`` and ``stopped_at_step`` of ``step``
        (:meth:`rldiag.capture.ledger.PolicyLedger.metrics`); empty without a policy."""
        return self.ledger.metrics(int(step))

    def _unpad(self, batch: Any, step: int, path: Path) -> StepPayload:
        """Unpad ``batch``, its rows drawn by the policy's whole groups, with the step's record."""
        drawn: list[tuple[int, int, int]] = []  # (groups, groups kept, rows) of the step

        def keep(uid: np.ndarray) -> np.ndarray | None:
            rows, total, kept = self.policy.keep_groups(uid, step)
            drawn.append((total, kept, int(uid.shape[0])))
            return rows

        payload = unpad_batch(batch, step, path, self.extra_columns, token_ids=self._token_text is not None,
                              keep_rows=keep if self.policy.active else None)
        if drawn:
            total, kept, rows = drawn[0]
            payload.sample = sample_record(self.policy, total, kept, rows, payload.n_rows)
        return payload

    def skip(self, step: int, batch: Any = None, rows: int | None = None) -> None:
        """Record ``step`` as left out by the policy (:meth:`captures` said no): its
        ``rldiag/capture/rows`` is 0, and it is no fault. ``batch``: the step's batch, kept in
        memory while :attr:`last_step` is unknown (it is written if the writer is closed with
        no later step handed to it). ``rows``: the batch's rows, logged as
        ``rldiag/capture/batch_rows`` (read from ``batch`` when not given)."""
        step = int(step)
        if rows is None and batch is not None:
            rows = batch_rows(batch)
        if not self.ledger.skip(step, rows) or batch is None:
            return
        try:
            payload = self._unpad(batch, step, self.batch_path(step))
        except RldiagError:
            return  # not captured anyway; a last step that cannot be read is warned when it is written
        self.ledger.hold(payload)

    def parts(self, step: int) -> int:
        """How many times this writer was given ``step`` (0 if never)."""
        return self._parts.get(int(step), 0)

    def dropped(self, step: int) -> bool:
        """Whether a part of ``step`` handed to this writer was not written (so far)."""
        with self._lock:
            return int(step) in self._dropped

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Queue one line ``{"step": N, "data": {...}}`` for ``metrics.jsonl`` (verl's file logger)."""
        if not self._check():
            return
        t0 = time.perf_counter()
        data = {str(k): _number(v) for k, v in metrics.items()}
        data.update(self.capture_metrics(step))
        self._put(("metrics", (int(step), data)))
        self.stats.train_thread_s += time.perf_counter() - t0

    def run_on_writer(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn()`` on the writer thread once everything queued before it is written (a
        step's batch file is then on disk). Returns a :class:`~concurrent.futures.Future` with
        its result or its exception; neither is raised by the writer's own calls (``fn`` is not
        part of the run directory). Its time counts in ``stats.writer_thread_s``. A closed writer
        (with ``"warn"``) gives a cancelled future."""
        done: Future = Future()
        if not self._check():
            done.cancel()
            return done
        self._put(("call", (fn, done)))
        return done

    def _wait(self) -> float | None:
        return None if self.on_error == "raise" else self.patience()

    def patience(self) -> float:
        """The longest the training thread waits on the writer (``"warn"``): ``max_wait_s``, and
        at most ``wait_share`` of a training step once one was timed."""
        if self.wait_share is None or self._step_s is None:
            return self.max_wait_s
        return min(self.max_wait_s, self.wait_share * self._step_s)

    def _time_step(self, part: int) -> None:
        if part:
            return
        now = time.perf_counter()
        if self._step_t is not None:
            self._step_s = now - self._step_t
        self._step_t = now

    def flush(self) -> None:
        """Wait until everything queued so far is written (with ``"warn"``, at most
        ``max_wait_s``); report what failed meanwhile."""
        if not self._closed:
            self._queue.join(self._wait())
        self._check(closed_ok=True)

    def sync(self) -> None:
        """The end-of-step barrier: wait until everything queued so far is written and fsynced
        (batch files are fsynced as they are written, ``metrics.jsonl`` here); report what failed.
        After it returns, a kill of the process (or of the machine) loses nothing queued before
        (with ``"warn"``, when the disk kept up within ``max_wait_s``)."""
        if self.on_error == "raise" or self._closed:
            if not self._closed:
                self._put(_SYNC)
            self.flush()
            return
        pending = self._sync_done
        if pending is None or pending.is_set():  # else the writer is behind: no new barrier, no wait
            done = self._sync_done = threading.Event()
            self._put(("sync", done))
            pending = done if done.wait(self.patience()) else None
        if pending is None or not pending.is_set():  # not a fault: a batch dropped later is the one warned
            self.stats.late_syncs += 1
        self._check(closed_ok=True)

    def _drain(self) -> None:
        """``SIGTERM``: the pending writes get ``max_wait_s`` to finish (a batch file still being
        written then is never put in place: dropped whole)."""
        if not self._closed:
            self._put(_SYNC)
            self._queue.join(self.max_wait_s)

    def close(self) -> None:
        """Write what is queued, stop the writer thread, report what failed. Idempotent. With
        ``"warn"``, a writer stuck on its disk is left behind after ``max_wait_s`` per queued
        batch (at least 10 s): what it had not written is dropped whole."""
        if not self._closed:
            for payload in self.ledger.take_held():  # the run's last step, left out while it was unknown
                self._queue_payload(payload)
            self._closed = True
            if self._sigterm is not None:
                self._sigterm.remove()
            self._queue.put(_STOP)
            waiting = self._queue.waiting()
            self._thread.join(None if self.on_error == "raise" else max(10.0, self.max_wait_s * (waiting + 1)))
            if self._thread.is_alive():
                self.fault("close", str(self.path), None, f"the writer did not finish in time; {waiting} queued "
                            "batch(es) are dropped", dropped=waiting)
            else:
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
    def _check(self, closed_ok: bool = False) -> bool:
        """Report the writer thread's failures: raised together (``"raise"``), else warned (once
        per cause: :meth:`_fault` warned them as they came)."""
        with self._lock:
            errors, self._errors = self._errors, []
        if errors and self.on_error == "raise":
            what = "; ".join(f"{w}: {type(e).__name__}: {e}" for w, e, _, _ in errors)
            raise CaptureError(f"the capture writer failed ({len(errors)}): {what}",
                               [(w, e) for w, e, _, _ in errors]) from errors[0][1]
        for _, exc, kind, message in errors:
            self.faults.warn(kind, exc, message)
        if self._closed and not closed_ok:
            if self.on_error == "raise":
                raise CaptureError(f"the run writer for {self.path} is closed")
            self.fault("closed", str(self.path), None, "the writer is closed: what is handed to it is not written")
            return False
        return True

    def fault(self, what: str, path: str, exc: BaseException | None, skipped: str, *, dropped: int = 0,
              errors: int = 0, step: int | None = None) -> None:
        """Count a fault (``dropped`` steps, ``errors``) and warn it once per kind (``what`` and
        the exception's type and errno): its cause, ``path`` and what is ``skipped``. For the
        capture's own callers too (the verl capture's faults around the writer). ``step``: the
        step whose batch is dropped (:meth:`dropped`)."""
        if step is not None and dropped:
            with self._lock:
                self._dropped.add(int(step))
        self.faults.count(dropped=dropped, errors=errors)
        self.stats.dropped_steps, self.stats.errors = self.faults.dropped_steps, self.faults.errors
        why = f"{cause(exc)}: " if exc is not None else ""
        self.faults.warn(what, exc, f"{why}{path}: {skipped}")

    def _put(self, item, size: int = 0) -> bool:
        """Queue ``item``; a batch (``size`` bytes) waits for room at most ``max_wait_s`` with
        ``"warn"`` (False: not queued), as long as it takes with ``"raise"``."""
        if self.on_error == "raise" or size == 0:
            while not self._queue.put(item, size, timeout=1.0):
                if not self._thread.is_alive():  # pragma: no cover - the loop catches everything
                    raise CaptureError("the capture writer thread stopped")
            ok = True
        else:
            ok = self._queue.put(item, size, timeout=self.patience())
        self.stats.max_queue = max(self.stats.max_queue, self._queue.waiting())
        self.stats.max_queue_bytes = max(self.stats.max_queue_bytes, self._queue.bytes())
        return ok

    def _run(self) -> None:
        while True:
            item, size = self._queue.get()
            try:
                if item is _STOP:
                    return
                t0 = time.perf_counter()
                kind, payload = item
                if kind == "batch":
                    self._write_batch(payload)
                elif kind == "call":
                    fn, done = payload
                    if done.set_running_or_notify_cancel():
                        try:
                            done.set_result(fn())
                        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on it
                            done.set_exception(exc)
                elif kind == "sync":
                    try:
                        self.disk.sync_lines()
                    except BaseException as exc:  # noqa: BLE001
                        self._record(METRICS_FILE, exc, "metrics", str(self.metrics_file),
                                     "the metrics lines so far may not be fsynced")
                    if payload is not None:
                        payload.set()
                else:
                    self._append(payload)
                self.stats.writer_thread_s += time.perf_counter() - t0
            finally:
                self._queue.task_done(size)
                if item is _STOP:
                    self.disk.close()

    def _again(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` in a run directory that exists: one removed (or replaced by an empty one)
        while the run trains is made again, with its ``batches/`` and ``run.yaml``."""
        if self.disk.make_dirs() and self._config is not None and not (self.layout.root / RUN_CONFIG).exists():
            self.disk.write_config(self._config)
        return fn()

    def _write_batch(self, payload: StepPayload) -> None:
        try:
            size = self._again(lambda: self.disk.write_step(payload, self.compression, self._token_text))
            self.stats.bytes += self.ledger.written(payload.step, size)  # the file holds every part so far
            self.stats.steps += int(payload.part == 0)
            self.stats.parts += 1
        except BaseException as exc:  # noqa: BLE001 - reported on the training thread
            step = f"step {payload.step}" + (f" part {payload.part}" if payload.part else "")
            with self._lock:
                self._dropped.add(payload.step)
            self._record(step, exc, "batch", str(payload.path), f"{step}'s batch is not written", dropped=1)

    def _append(self, item: tuple[int, dict[str, Any]]) -> None:
        step, data = item
        if BYTES_KEY not in data and ROWS_KEY in data:  # the step's batch file is written by now (queue order)
            data[BYTES_KEY] = self.ledger.file_of(step) or 0
        try:
            line = json.dumps({"step": step, "data": data}, allow_nan=True)
            self._again(lambda: self.disk.append_line(line))
            self.stats.metric_lines += 1
        except BaseException as exc:  # noqa: BLE001
            self._record(METRICS_FILE, exc, "metrics", str(self.metrics_file), f"step {step}'s metrics line is "
                         "not written")

    def _record(self, what: str, exc: BaseException, kind: str = "", path: str = "", skipped: str = "",
                dropped: int = 0) -> None:
        """A failure on the writer thread: counted now, reported on the training thread's next
        call (raised with ``"raise"``, warned once per cause with ``"warn"``)."""
        self.faults.count(dropped=dropped, errors=1)
        self.stats.dropped_steps, self.stats.errors = self.faults.dropped_steps, self.faults.errors
        with self._lock:
            self._errors.append((what, exc, kind or what, f"{cause(exc)}: {path}: {skipped}"))
