"""The unit of work every executor runs, in one place so that all of them make the same packs
and therefore write bit-identical results.

1. :func:`fetch` one step: stat and hash its file (or keep the previous hash, see
   :func:`known_hash`), decide whether the previous result can be reused, else load it.
2. :func:`packs` groups loaded steps: consecutive steps of one *chunk* up to a budget of
   tokens; a failed or reused step ends the pack before it. Packing can change float rounding
   (the scans cut the packed tokens into fixed chunks, so where a row starts matters in the last
   bit), so pack boundaries must not depend on the executor: chunks are fixed runs of steps, the
   unit a distributed executor hands to a worker.
3. :func:`compute_pack` runs the engine on a pack and returns one :class:`StepOutcome` per step:
   a metrics row and, with ``save_tokens``, an Arrow table of per-token results. No tensor leaves.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
import pyarrow as pa
import torch

from rldiag.config.settings import Settings
from rldiag.engine.batch import pack as pack_batches
from rldiag.engine.liveness import FREEABLE_COLUMNS
from rldiag.engine.pipeline import Result, recompute_batch
from rldiag.engine.requirements import ColumnPlan, recompute_columns
from rldiag.errors import InternalError, RldiagError
from rldiag.executors.allocator import usable_cores
from rldiag.io.file_hash import PieceHash, claim_early, hash_pool
from rldiag.io.fs import as_path, is_remote
from rldiag.io.loader import StepData, load_step, row_columns
from rldiag.io.outputs import rows_table, tokens_table
from rldiag.io.rundir import StepFile

#: Steps read ahead on the loader thread (bounded: memory stays flat as the run grows). One: the
#: next step is read while this one computes. Each more step ahead holds another step's file
#: bytes, decoded table and tensors (about 3 times its data) and gained no time: two ahead
#: peaked 40-70 MB higher on 20 steps x 512 x 1,024, in the same time (docs/performance.md).
PREFETCH = 1

#: A step of this many tokens or more is computed with nothing read ahead: the next step's decoded
#: columns (36 bytes a token once loaded, more while it decodes) would sit beside the step's peak.
#: On the tail32k bench run (3 steps of 2.7-3.2 M tokens) a recompute peaked 959-982 MB without
#: the read-ahead and 1,120-1,168 MB with it, in 4.3-4.7 s against 4.7-5.5 s (docs/performance.md).
#: Smaller steps keep theirs: on tail16k (0.5-0.63 M tokens) it saves a third of the time.
READ_AHEAD_MAX_TOKENS = 1 << 21

#: Pack steps together until this many tokens; one step may exceed it alone.
DEFAULT_PACK_TOKENS = 1 << 19

#: Steps per chunk: a pack never spans two chunks; a Ray task computes one chunk.
DEFAULT_CHUNK_STEPS = 8

#: Decode a file's columns on Arrow's thread pool from this many usable cores. Below it, the
#: loader, the engine and the hash already keep every core busy, and Arrow's own threads only add
#: CPU (on 2 cores: 33 ms of CPU per 512 x 1,024 step decoded with threads, 23 ms without).
ARROW_THREADS_FROM_CORES = 4


@dataclass(frozen=True, eq=False)
class RowScores:
    """New outcome scores of one step's rows (``rldiag rescore``): ``scores`` ``(rows,)`` float32,
    placed at each row's last token (verl's reward manager's place) in place of the row's
    captured ``token_level_scores``; rows where ``keep`` ``(rows,)`` bool is set keep theirs."""

    scores: np.ndarray
    keep: np.ndarray

    def apply(self, data: StepData) -> StepData:
        """``data`` with its ``token_level_scores`` replaced (a new tensor: the loaded one may
        share Arrow's read-only buffers)."""
        batch = data.batch
        if self.scores.shape != (data.n_rows,) or self.keep.shape != (data.n_rows,):
            raise InternalError(f"step {data.step}: {self.scores.shape[0]} new scores for {data.n_rows} rows")
        lengths = batch.lengths
        last = torch.cumsum(lengths, 0) - 1
        live = lengths > 0
        new = torch.zeros_like(batch.token_level_scores)
        new[last[live]] = torch.from_numpy(self.scores.astype(np.float32))[live]
        keep = torch.from_numpy(self.keep)
        new = torch.where(keep[batch.rows.row_ids], batch.token_level_scores, new)
        data.batch = dataclasses.replace(batch, token_level_scores=new)
        return data


@dataclass(frozen=True)
class Job:
    """What every step of one recompute shares. Small and picklable: it goes to Ray workers."""

    settings: Settings
    device: str  # resolved: "cpu" or "cuda[:N]"
    save_tokens: bool
    pack_tokens: int = DEFAULT_PACK_TOKENS
    #: ``rldiag rescore``: each step's new scores (:class:`RowScores`), applied as the step loads
    rescored: dict[int, RowScores] | None = dataclasses.field(default=None, hash=False, compare=False)


@dataclass(frozen=True)
class StepTask:
    """One step to recompute: where its file is (a path or URI, never its content)."""

    step: int
    file: str
    rel: str  # the file relative to the run, as scenario.json records it
    chunk: int
    previous: dict | None = None  # the previous scenario's record of this input
    reusable: bool = False  # the previous result may be reused if the file is unchanged

    def step_file(self) -> StepFile:
        return StepFile(self.step, as_path(self.file))


@dataclass
class StepOutcome:
    """What one step produced, as the driver writes it: no tensors, Arrow at most."""

    step: int
    info: dict  # the input record for scenario.json
    status: str  # "done", "reused" or "failed"
    metrics: dict[str, float] | None = None
    tokens: pa.Table | None = None
    row_table: pa.Table | None = None  # the per-row table (rows/step_<N>.parquet)
    error: str | None = None
    rows: int = 0
    n_tokens: int = 0
    #: a failed step's traceback when its error is an internal one (:class:`~rldiag.errors.InternalError`: a bug)
    traceback: str | None = None


class Fetched:
    """One fetched step: its data (or the error that kept it from loading) and its input record.

    The record for scenario.json may still be waiting for the file's SHA-256, which a background
    thread computes into an object of its own (a future); nothing is written into a shared dict.
    :meth:`record` is the one way to read the record: it waits for the hash, once, under a lock,
    and returns a copy, so any thread may call it at any time.
    """

    def __init__(self, task: StepTask, record: dict | None = None, *, pending: Future | None = None,
                 data: StepData | None = None, error: str | None = None,
                 finish: Callable[[], dict] | None = None):
        self.task = task
        self.data = data
        self.error = error
        self._record = dict(record or {})
        self._pending = pending
        self._finish = finish  # hashes what the hash thread has not yet (PieceHash.run), on the caller's thread
        self._lock = threading.Lock()
        #: the file's per-row columns (:func:`~rldiag.io.loader.row_columns`) when the fetcher read
        #: them from the bytes it had (a sweep), or the error that kept them; None: read when needed
        self.row_columns: pa.Table | BaseException | None = None

    def record(self) -> dict:
        """The input record for scenario.json, its hash finished (a copy): what the hash thread
        has not hashed yet is hashed on the caller's thread (where the fetch gave a way to)."""
        with self._lock:
            if self._pending is not None:
                # a local file's rest hashed here, not waited for: the hash thread only has to
                # find it done, whenever it runs
                self._record = self._finish() if self._finish is not None else self._pending.result()
                self._pending = self._finish = None
            return dict(self._record)

    @property
    def loaded(self) -> StepData:
        """The step's data, for a step that was loaded (every step of a pack, see :func:`packs`)."""
        assert self.data is not None, f"step {self.task.step} was not loaded"
        return self.data

    def outcome(self) -> StepOutcome:
        """The outcome of a step that was not loaded: failed, or reused."""
        if self.error is not None:
            return StepOutcome(self.task.step, self.record(), "failed", error=self.error)
        return StepOutcome(self.task.step, self.record(), "reused")


def stat_record(sf: StepFile, rel: str) -> tuple[dict, bool]:
    """A step file's input record before its hash (step, file, size, mtime), and whether it is remote."""
    st = sf.path.stat()
    return {"step": sf.step, "file": rel, "size": st.st_size, "mtime_ns": st.st_mtime_ns}, is_remote(sf.path)


def known_hash(info: dict, remote: bool, previous: dict | None) -> bool:
    """Put the previous record's hash into ``info`` when the file's size and mtime still match.

    Object stores give modification times to the second, so there the previous hash is kept only
    if it was computed at least a second after the object's last modification (``hashed_ns``): a
    rewrite within the same second as the hash would otherwise go unnoticed.
    """
    if not previous:
        return False
    same = (
        previous.get("size") == info["size"]
        and previous.get("mtime_ns") == info["mtime_ns"]
        and previous.get("sha256")
        and (not remote or previous.get("hashed_ns", 0) >= info["mtime_ns"] + 1_000_000_000)
    )
    if same:
        info["sha256"] = previous["sha256"]
        if remote:
            info["hashed_ns"] = previous["hashed_ns"]
    return bool(same)


def hashed_record(info: dict, remote: bool, content: bytes) -> dict:
    """A new record: ``info`` with the SHA-256 (and size) of the bytes read (``info`` is left
    as it is, so that a thread may compute it while another holds ``info``)."""
    out = dict(info)
    if remote:
        out["hashed_ns"] = time.time_ns()
    out["size"] = len(content)
    out["sha256"] = hashlib.sha256(content).hexdigest()
    return out


def content_hasher(info: dict, remote: bool, content: Any) -> tuple[Callable[[], dict], Callable[[], dict] | None]:
    """How a step's ``content`` is hashed into its new record: ``(hash, finish)``. Bytes (an
    object store's file) are hashed whole (:func:`hashed_record`) and ``finish`` is None (whoever
    needs the record waits for the hash thread); an open local file in pieces from a duplicate of
    its descriptor (:class:`PieceHash`), whose ``run`` is both: any thread may finish it; a file
    hashed early (:func:`~rldiag.io.file_hash.claim_early`) by that early hash, done or not."""
    if isinstance(content, bytes):
        return functools.partial(hashed_record, dict(info), remote, content), None
    early = claim_early(content.name, content.fileno())  # hashed while the process imported the engine
    if early is not None:
        base = dict(info)

        def run() -> dict:
            return {**base, **early.run()}
        return run, run
    run = PieceHash(dict(info), os.dup(content.fileno())).run
    return run, run


def hashed_file_record(info: dict, fd: int) -> dict:
    """:func:`hashed_record` of a local file open as ``fd`` (closed here), in pieces
    (:class:`PieceHash`, on this thread alone)."""
    return PieceHash(info, fd).run()


def open_step_file(sf: StepFile):
    """A local step file, open for reading (binary): hashed (:class:`PieceHash`, on a
    duplicate of its descriptor) and parsed from the same open file, so both see the same bytes
    even when the path is replaced meanwhile."""
    path = sf.path
    if not isinstance(path, Path):
        raise InternalError(f"{path}: an object store's file is read whole, not opened")
    return open(path, "rb")  # noqa: SIM115 - closed by fetch once loaded


def fetch(task: StepTask, job: Job, pin: bool = False, hash_file: bool = True,
          columns: ColumnPlan | None = None) -> Fetched:
    """Hash the step's file, and load it unless the previous result can be reused.

    A file whose hash is not known already is hashed on a low-priority thread (hashlib releases
    the GIL): on a machine whose cores are all busy with loading and computing, the hash takes the
    gaps, and whoever needs it first (the step's record, :meth:`Fetched.record`, after the step is
    computed) hashes the rest of a local file itself (on a loaded machine the low-priority thread
    runs last) or waits for an object store's. A local file is opened once, hashed in pieces from
    that open file (:class:`PieceHash`) and parsed from it: its bytes are never held whole beside
    the decoded columns (a second read of a page the hash read comes from the page cache). An
    object store's file is read once, whole: its bytes are parsed here and hashed on that thread.
    ``pin``: page-locked tensors, so that the copy to a GPU
    overlaps. ``hash_file=False`` skips the input record (a pass that only needs the data).
    ``columns``: the columns to load (default: those a recompute reads, the column planner's
    :func:`~rldiag.engine.requirements.recompute_columns`).
    """
    sf = task.step_file()
    old = task.previous
    content: Any = None  # the file's bytes (an object store's), or the open local file
    pending = None
    finish = None  # a local file's PieceHash.run: whoever needs the record first may finish the hash
    info: dict = {}
    try:
        if hash_file:
            info, remote = stat_record(sf, task.rel)
            if not known_hash(info, remote, old):
                decides = bool(task.reusable and old)  # the hash decides whether the file is parsed at all
                content = sf.path.read_bytes() if remote else open_step_file(sf)
                hashed, finish = content_hasher(info, remote, content)
                if decides:
                    info, finish = hashed(), None
                else:
                    pending = hash_pool().submit(hashed)
                del hashed
            if task.reusable and old and old.get("sha256") == info.get("sha256") and old.get("size") == info.get("size"):
                return Fetched(task, info)
        plan = columns if columns is not None else recompute_columns(job.settings)
        data, error = try_load(sf, job.settings, plan, content)
    finally:
        if content is not None and not isinstance(content, bytes):
            content.close()
        content = None
    if data is None:
        return Fetched(task, info, error=error, pending=pending, finish=finish)
    if job.rescored is not None and task.step in job.rescored:
        data = job.rescored[task.step].apply(data)
    if pin:
        data.batch = data.batch.pin_memory()
    return Fetched(task, info, data=data, pending=pending, finish=finish)


def try_load(sf: StepFile, settings: Settings, plan: ColumnPlan, content: Any) -> tuple[StepData | None, str | None]:
    """The step loaded with ``plan`` (from ``content`` when its bytes were read or the file is
    open: :func:`~rldiag.io.loader.load_step`'s ``source``), or the error
    that fails it (``Type: message``)."""
    try:
        return load_step(sf, settings, plan, source=content, threads=usable_cores() >= ARROW_THREADS_FROM_CORES), None
    except RldiagError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - whatever a malformed file provokes fails its step alone
        return None, f"BatchError: {sf.path} (step {sf.step}): cannot load: {type(exc).__name__}: {exc}"


T = TypeVar("T")
R = TypeVar("R")


class Prefetched(Generic[T, R]):
    """``fn(task)`` for each task in order, run up to ``depth`` tasks ahead on one background
    thread (an iterator of :class:`Fetched`). The thread is shut down when iteration ends, is
    abandoned, or fails. ``hold(result)``, when given and true for a result, reads nothing ahead
    while the consumer has that result: the next task starts when the consumer asks for it
    (a step too large to decode beside its computation, :func:`large_step`)."""

    def __init__(self, tasks: Iterable[T], fn: Callable[[T], R], depth: int = PREFETCH,
                 hold: Callable[[R], bool] | None = None):
        self._tasks, self._fn, self._depth, self._hold = tasks, fn, max(1, depth), hold
        self._queue: deque = deque()
        self._exhausted = False

    @property
    def idle(self) -> bool:
        """Whether the loader has nothing left to do: every task submitted and finished."""
        return self._exhausted and self.quiet

    @property
    def quiet(self) -> bool:
        """Whether the loader thread is reading nothing now: every task submitted so far has
        finished (the last ones read, or a held result waiting for the consumer, see ``hold``)."""
        return all(f.done() for f in self._queue)

    def __iter__(self) -> Iterator[R]:
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rldiag-load")
        queue = self._queue
        it = iter(self._tasks)

        def submit() -> None:
            task = next(it, None)
            if task is None:
                self._exhausted = True
            else:
                queue.append(pool.submit(self._fn, task))

        try:
            while not self._exhausted and len(queue) < self._depth:
                submit()
            while queue:
                fut = queue.popleft()
                if self._hold is None:
                    if not self._exhausted:
                        submit()
                    yield fut.result()
                    continue
                result = fut.result()
                held = self._hold(result)
                if not self._exhausted and not held:
                    submit()
                yield result
                if held and not self._exhausted:  # the consumer is done with it: read on
                    submit()
        finally:
            self._exhausted = True
            pool.shutdown(wait=True, cancel_futures=True)


def prefetched(tasks: Iterable[T], fn: Callable[[T], R], depth: int = PREFETCH,
               hold: Callable[[R], bool] | None = None) -> Prefetched[T, R]:
    """``fn(task)`` for each task in order, run up to ``depth`` tasks ahead (see :class:`Prefetched`)."""
    return Prefetched(tasks, fn, depth, hold)


def large_step(f: Fetched) -> bool:
    """Whether ``f`` loaded at least :data:`READ_AHEAD_MAX_TOKENS` tokens: the next step is then
    read only once its pack is computed (:class:`Prefetched`'s ``hold``)."""
    return f.data is not None and f.data.n_tokens >= READ_AHEAD_MAX_TOKENS


class Packer:
    """:func:`packs` one step at a time: :meth:`push` a fetched step, get the units it completes
    (packs, lists, and the step itself when it was not loaded), in step order; :meth:`flush`
    the last pack. A sweep keeps one per scenario, since the steps each reuses differ."""

    def __init__(self, pack_tokens: int):
        self.pack_tokens = pack_tokens
        self._pending: list[Fetched] = []
        self._slots = 0

    def push(self, f: Fetched) -> list[Fetched | list[Fetched]]:
        out: list[Fetched | list[Fetched]] = []
        if f.data is None:
            out += self.flush()
            out.append(f)
            return out
        size = f.data.n_tokens
        if self._pending and (self._slots + size > self.pack_tokens or f.task.chunk != self._pending[0].task.chunk):
            out += self.flush()
        self._pending.append(f)
        self._slots += size
        if self._slots >= self.pack_tokens:  # full: compute it now rather than after the next step's load
            out += self.flush()
        return out

    def flush(self) -> list[Fetched | list[Fetched]]:
        if not self._pending:
            return []
        pack, self._pending, self._slots = self._pending, [], 0
        return [pack]


def packs(fetched: Iterable[Fetched], pack_tokens: int) -> Iterator[Fetched | list[Fetched]]:
    """Loaded steps grouped into packs (lists), in step order; a step that was not loaded (failed
    or reused) is yielded alone and ends the pack before it. A pack holds consecutive steps of one
    chunk, up to ``pack_tokens`` slots (a step larger than that is a pack of its own)."""
    packer = Packer(pack_tokens)
    for f in fetched:
        yield from packer.push(f)
    yield from packer.flush()


def _metric_rows(result: Result, steps_ok: set[int]) -> dict[int, dict[str, float]]:
    names = list(result.metrics)
    values = {k: v.detach().to("cpu", torch.float64).tolist() for k, v in result.metrics.items()}
    out = {}
    for i, step in enumerate(result.steps):
        if step in steps_ok:
            row: dict[str, Any] = {"step": step}
            row.update({k: values[k][i] for k in names})
            out[step] = row
    return out


#: what a pack's computation may raise and fail its steps with, rather than stop the recompute: an input the
#: engine refuses (an RldiagError: its message kept) or anything else it raises (a bug: an InternalError with its
#: traceback, :func:`pack_outcomes`); a KeyboardInterrupt still stops it
COMPUTE_ERRORS: tuple[type[BaseException], ...] = (Exception,)


def pack_batch(pack: list[Fetched], job: Job):
    """The pack's steps as one batch on ``job.device``."""
    return pack_batches([f.loaded.batch for f in pack]).to(torch.device(job.device))


def release_columns(pack: list[Fetched]) -> None:
    """Drop the loaded steps' optional token columns (the log-probs, entropy, values,
    ``loss_mask``; :data:`~rldiag.engine.liveness.FREEABLE_COLUMNS`) once their pack is made, so
    that the engine frees each when its last reader has run (what the outcomes read of a step
    stays: its lengths, rows and tokens)."""
    for f in pack:
        b = f.loaded.batch
        gone: dict[str, Any] = {c: None for c in FREEABLE_COLUMNS if getattr(b, c) is not None}
        f.loaded.batch = dataclasses.replace(b, **gone)


def compute_pack(pack: list[Fetched], job: Job, kl_state) -> list[StepOutcome]:
    """Recompute one pack on ``job.device``; one outcome per step, in order. The pack's steps
    are the engine's alone from here: their columns are freed as the stages finish with them
    (:func:`release_columns`), and the per-token outputs are kept only with ``job.save_tokens``."""
    try:
        # the packed batch is handed over, never bound here: the engine's reference is its only one
        result = recompute_batch(_packed(pack, job), job.settings, kl_state, release=True,
                                 keep_tokens=job.save_tokens)
    except COMPUTE_ERRORS as exc:
        return pack_outcomes(pack, job, exc)
    return pack_outcomes(pack, job, result)


def _packed(pack: list[Fetched], job: Job):
    """The pack's batch (:func:`pack_batch`), its steps' own columns released (:func:`release_columns`)."""
    batch = pack_batch(pack, job)
    release_columns(pack)
    return batch


def pack_outcomes(pack: list[Fetched], job: Job, result: Result | BaseException,
                  shared: dict | None = None) -> list[StepOutcome]:
    """One outcome per step of a computed pack: its metrics row and, with ``job.save_tokens``,
    its token table; or the error the computation raised (one of :data:`COMPUTE_ERRORS`).
    ``shared``: what outcomes of the same result for the same steps made already (metrics rows,
    token and row tables), reused and filled in (a sweep's scenarios that share a result)."""
    shared = {} if shared is None else shared
    if isinstance(result, RldiagError):
        msg = f"{type(result).__name__}: {result}"
        return [StepOutcome(f.task.step, f.record(), "failed", error=msg) for f in pack]
    if isinstance(result, BaseException):
        # the engine failed on these inputs without meaning to: a bug (an InternalError, its traceback
        # kept), or a device out of memory (not a bug); the pack's steps fail with it, and every other
        # step is still computed and written
        steps = ", ".join(str(f.task.step) for f in pack)
        if isinstance(result, (torch.cuda.OutOfMemoryError, MemoryError)):
            msg, trace = f"ComputeError: steps {steps}: {type(result).__name__}: {result}", None
        else:
            internal = InternalError.of(result, f"steps {steps}")
            msg, trace = f"InternalError: {internal}", internal.traceback
        return [StepOutcome(f.task.step, f.record(), "failed", error=msg, traceback=trace) for f in pack]
    failed = {s: f"ComputeError: {m}" for s, m in result.failed.items()}
    if "metric_rows" not in shared:
        shared["metric_rows"] = _metric_rows(result, {f.task.step for f in pack} - set(failed))
    rows = shared["metric_rows"]
    out = []
    tok0 = row0 = 0
    for f in pack:
        d = f.loaded
        sel = slice(tok0, tok0 + d.n_tokens)  # the step's tokens in the packed layout
        rsel = slice(row0, row0 + d.n_rows)  # and its rows
        tok0 += d.n_tokens
        row0 += d.n_rows
        if d.step in failed:
            out.append(StepOutcome(d.step, f.record(), "failed", error=failed[d.step]))
            continue
        tokens = None
        if job.save_tokens:
            if ("tokens", d.step) not in shared:
                shared["tokens", d.step] = tokens_table({k: v[sel] for k, v in result.tokens.items()}, d.batch.lengths)
            tokens = shared["tokens", d.step]
        if ("row_table", d.step) not in shared:
            try:
                shared["row_table", d.step] = step_rows_table({k: v[rsel] for k, v in result.rows.items()}, f)
            except (RldiagError, OSError, pa.ArrowException) as exc:
                shared["row_table", d.step] = exc
        row_table = shared["row_table", d.step]
        if isinstance(row_table, BaseException):
            out.append(StepOutcome(d.step, f.record(), "failed", error=f"{type(row_table).__name__}: {row_table}"))
            continue
        out.append(StepOutcome(d.step, f.record(), "done", metrics=rows[d.step], tokens=tokens, row_table=row_table,
                               rows=d.n_rows, n_tokens=d.n_tokens))
    return out


def step_rows_table(rows: dict[str, torch.Tensor], f: Fetched) -> pa.Table:
    """One step's per-row table: the engine's per-row values (:func:`rldiag.io.outputs.rows_table`)
    then the batch file's own per-row columns (``uid``, reward components, ids), each once (the
    engine's values win a shared name)."""
    table = rows_table(rows, f.task.step)
    own = f.row_columns
    if own is None:
        own = row_columns(f.task.step_file())  # a few scalar columns: one small projected read
    elif isinstance(own, BaseException):
        raise own
    for name in own.column_names:
        if name not in table.column_names:
            table = table.append_column(name, own[name])
    return table


def process(fetched: Iterable[Fetched], job: Job, kl_for: Callable[[list[int]], Any],
            before_compute: Callable[[], None] | None = None,
            not_loaded: Callable[[Fetched], None] | None = None) -> Iterator[StepOutcome]:
    """Outcomes of fetched steps, in step order. ``kl_for(steps)`` gives the KL controller state
    (or preset coefficients) a pack of those steps is computed with; ``before_compute()`` is
    called before each pack is computed, ``not_loaded(f)`` for each step that was not loaded
    (failed or reused), in its place in step order."""
    for unit in packs(fetched, job.pack_tokens):
        if isinstance(unit, Fetched):
            if not_loaded is not None:
                not_loaded(unit)
            yield unit.outcome()
        else:
            if before_compute is not None:
                before_compute()
            yield from compute_pack(unit, job, kl_for([f.task.step for f in unit]))
