"""The baseline the app computes on its own: one background worker per (server process, run).

When a page opens a run, :func:`worker_for` gives the run's :class:`BaselineWorker` (made once,
in a registry guarded by a lock, whatever the sessions and reruns) and :meth:`~BaselineWorker.ensure`
starts its thread if it is not running. The thread recomputes the ``baseline`` scenario (the
run's own settings, :func:`rldiag.api.recompute` on the CPU; unchanged steps reused, so a run
opened before costs a look at its files) in a child process of its own, kept for the chunks of
one pass (the recompute's Python does not compete with the server's pages for the interpreter's
lock, a 1.5-2.5x slowdown on a 2-core machine in a thread, and its memory is not the server's:
it goes back to the system when the pass ends).
Children come from multiprocessing's fork server, which has imported the recompute's modules
(torch, the engine) once: ``rldiag app`` starts it with the server (:func:`prepare`), so the
first page's worker does not wait for those imports. The worker then keeps the baseline current: it looks at the batch files and
the config every :data:`POLL_SECONDS` and recomputes when they change (a step written by a
training job still running). A large run goes from its latest steps backwards in chunks
(:mod:`rldiag.viz.baseline`), the scenario written after each. Its progress and last result are
a :class:`Snapshot`, read by the pages (thread-safe); ``version`` counts the recomputes written,
so a page redraws when it moves (:func:`rldiag.app.session.baseline_status`). A worker whose run
no page asked about for :data:`IDLE_STOP_SECONDS` stops; the next page to ask starts it again.

Everything else that writes the baseline scenario (the Health page's doctor, the Off-policy
page's diagnosis, What-if) does so inside :meth:`BaselineWorker.exclusive`, never at the same
time as the worker.

``MODE`` (``$RLDIAG_APP_WORKER``): ``thread`` (the server), ``sync`` (:meth:`ensure` runs a
recompute inline when the files changed: the tests, deterministic), ``off`` (nothing computed on
open).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rldiag import api
from rldiag.app import memory
from rldiag.errors import RldiagError
from rldiag.store import Store
from rldiag.store.cache import file_sig
from rldiag.viz.baseline import BaselinePlan, plan_baseline

BASELINE = "baseline"
MODE_VAR = "RLDIAG_APP_WORKER"
MODES = ("thread", "sync", "off")
#: how workers run in this process (tests set ``sync``)
MODE = os.environ.get(MODE_VAR, "thread") if os.environ.get(MODE_VAR, "thread") in MODES else "thread"
#: seconds between two looks at the run's files while following it
POLL_SECONDS = 2.0
#: a worker whose run no page asked about for this long stops following it
IDLE_STOP_SECONDS = 900.0
#: what the fork server imports before it forks the children (:mod:`rldiag.app.forkinit` first: one arena)
PRELOAD = ["rldiag.app.forkinit", "rldiag.app.worker", "rldiag.app.pagework", *api.WARM_MODULES]


def mp_context() -> Any:
    """The multiprocessing context of the children: the fork server (its preloaded modules), else spawn."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return multiprocessing.get_context("spawn")


def prepare() -> None:
    """Start the fork server now (its imports run beside the server's start), for background workers."""
    if MODE != "thread":
        return
    ctx = mp_context()
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


@dataclass(frozen=True)
class Snapshot:
    """Where the worker stands (a copy: reading it takes no lock)."""

    state: str = "new"  # new | running | idle | failed | stopped | off
    version: int = 0  # recomputes written so far (each chunk of a large run counts)
    passes: int = 0  # times the run's files were brought up to date
    done: int = 0  # progress within the current recompute
    total: int = 0
    what: str = ""
    steps: int = 0  # steps with a batch file at the last look
    covered: int = 0  # steps the baseline holds (done or failed) after the last write
    chunk: int = 0  # the chunk being computed (large runs), from 1
    chunks: int = 0
    large: bool = False
    total_bytes: int = 0
    chunk_size: int = 0
    failed: dict[int, str] | None = None  # steps that failed in the last recompute
    error: str | None = None  # why the last recompute could not run at all
    seconds: float = 0.0  # of the last complete pass

    @property
    def busy(self) -> bool:
        """A recompute is under way (or about to start on a run never brought up to date)."""
        return self.state == "running" or (self.state == "new" and self.passes == 0)

    @property
    def settled(self) -> bool:
        """The run's files have been brought up to date at least once and nothing runs now."""
        return self.passes > 0 and self.state != "running"


class BaselineWorker:
    """Computes and follows the baseline scenario of one run (see the module's docstring)."""

    def __init__(self, store: Store, *, device: str = "cpu", poll_seconds: float = POLL_SECONDS,
                 idle_stop: float = IDLE_STOP_SECONDS, clock: Callable[[], float] = time.monotonic,
                 synchronous: bool = False, isolate: bool | None = None):
        self.store = store
        #: recompute in a child process (default: in the background mode), else in this one
        self.isolate = (not synchronous) if isolate is None else isolate
        self._child: Any = None  # (process, connection) while a child is up
        self.run = Path(store.run)
        self.device = device
        self.poll_seconds = poll_seconds
        self.idle_stop = idle_stop
        self.clock = clock
        self.synchronous = synchronous
        self._snap = Snapshot()
        self._cond = threading.Condition()
        self._write = threading.RLock()  # held while the baseline scenario is written
        self._tokens = threading.RLock()  # held while the token cache is written
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen_sig: tuple | None = None
        self._last_asked = clock()
        # a page's heavy work (:mod:`rldiag.app.pagework`) holds the recomputes: none starts, and
        # the child's under way pauses at its next step (``_go`` cleared) and says so (``_paused``)
        self._holds = 0
        self._computing = False  # a recompute was sent to the child and has not answered
        self._paused = False
        self._go: Any = None  # the child's event (multiprocessing), set while it may compute

    # -- what the pages call -------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        with self._cond:
            return self._snap

    def ensure(self) -> Snapshot:
        """A page looks at the run: the thread is started if it is not running (synchronous: the
        baseline is brought up to date here, when the files changed since the last time)."""
        self._last_asked = self.clock()
        if self.synchronous:
            self.poll_once()
        else:
            with self._cond:
                if self._thread is None or not self._thread.is_alive():
                    self._stop.clear()
                    self._thread = threading.Thread(target=self._loop, name=f"rldiag-baseline:{self.run.name}",
                                                    daemon=True)
                    self._thread.start()
        return self.snapshot()

    def poke(self) -> None:
        """Look at the run's files now rather than after the poll interval."""
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        """Stop following the run (a recompute under way in the child process is cut short: the
        scenario it was writing stays as it was)."""
        self._stop.set()
        self._wake.set()
        with self._cond:
            self._cond.notify_all()  # a recompute waiting for a page's heavy work gives up
        self._end_child(wait=False)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def wait(self, predicate: Callable[[Snapshot], bool], timeout: float | None = None) -> Snapshot:
        """Block until ``predicate(snapshot)`` holds (tests; never a sleep). Raises TimeoutError."""
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self._snap), timeout):
                raise TimeoutError(f"the baseline worker of {self.run} did not get there: {self._snap}")
            return self._snap

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Around anything else that writes the baseline scenario: the worker does not write it meanwhile."""
        with self._write:
            yield

    @contextlib.contextmanager
    def tokens_lock(self) -> Iterator[None]:
        """Around a write of the run's token cache (:func:`rldiag.api.step_tokens`)."""
        with self._tokens:
            yield

    def hold(self) -> None:
        """A page's heavy work starts (:func:`rldiag.app.pagework.quiet_baselines`): no recompute
        starts until :meth:`resume`, and the one under way pauses after its current step (its memory
        given back to the system first)."""
        with self._cond:
            self._holds += 1
            if self._go is not None:
                self._go.clear()

    def resume(self) -> None:
        """The page's heavy work ended: the recomputes go on."""
        with self._cond:
            self._holds = max(0, self._holds - 1)
            if not self._holds:
                if self._go is not None:
                    self._go.set()
                self._cond.notify_all()

    def wait_quiet(self, timeout: float | None = None) -> bool:
        """Block (after :meth:`hold`) until no recompute of this worker computes: none sent to the
        child, or the child paused between two steps; False when ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._computing or self._paused or self._stop.is_set(), timeout)

    @property
    def quiet(self) -> bool:
        with self._cond:
            return not self._computing or self._paused

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the work ----------------------------------------------------------------------------

    def _set(self, **changes) -> None:
        with self._cond:
            self._snap = replace(self._snap, **changes)
            self._cond.notify_all()

    def _signature(self) -> tuple:
        return self.store.inputs_sig()

    def poll_once(self) -> bool:
        """Bring the baseline up to date when the run's files changed since the last pass; True
        when a pass ran."""
        try:
            sig = self._signature()
        except (RldiagError, OSError) as exc:
            self._set(state="failed", error=f"{type(exc).__name__}: {exc}")
            return False
        if sig == self._seen_sig:
            return False
        self._pass()
        self._seen_sig = sig
        return True

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.poll_once()
                if self.clock() - self._last_asked >= self.idle_stop:
                    break
                self._wake.wait(self.poll_seconds)
                self._wake.clear()
        finally:
            self._end_child(wait=True)
            with self._cond:
                if self._snap.state != "failed":
                    self._snap = replace(self._snap, state="stopped")
                self._cond.notify_all()

    def _sizes(self) -> list[tuple[int, int]]:
        out = []
        for sf in self.store.batches.files():
            sig = file_sig(str(sf.path))
            if sig is not None:
                out.append((sf.step, sig.size))
        return out

    def _baseline_record(self) -> tuple[list[int], bool]:
        """The steps the baseline's recompute will reuse (the driver's own decision,
        :func:`rldiag.api.reusable_steps`) and whether it saved per-token outputs (kept, then)."""
        from rldiag.store.errors import StoreError

        if BASELINE not in self.store.scenario_names():
            return [], False
        try:
            meta = self.store.scenario_meta(BASELINE)
        except StoreError:
            return [], False
        tokens = bool(meta.get("save_tokens")) and bool(self.store.token_steps(BASELINE))
        return api.reusable_steps(self.run, BASELINE, save_tokens=tokens), tokens

    def _pass(self) -> None:
        t0 = time.perf_counter()
        try:
            sizes = self._sizes()
            if not sizes:  # no batch file yet: nothing to compute, the run is followed
                self._set(state="idle", passes=self._snap.passes + 1, steps=0, error=None)
                return
            done, tokens = self._baseline_record()
            plan = plan_baseline(sizes, done)
            self._set(state="running", steps=len(plan.steps), large=plan.large, total_bytes=plan.total_bytes,
                      chunk_size=plan.chunk_size, chunks=len(plan.chunks), chunk=0, done=0, total=0, what="",
                      covered=len(plan.done), error=None)
            failed, error = self._chunks(plan, tokens)
        except (RldiagError, OSError) as exc:
            failed, error = {}, f"{type(exc).__name__}: {exc}"
        finally:
            if self.isolate:
                self._end_child(wait=True)  # its memory back to the system until the next pass
            else:
                memory.release()
        if error is not None:
            self._set(state="failed", passes=self._snap.passes + 1, error=error)
        else:
            self._set(state="idle", passes=self._snap.passes + 1, failed=failed or None,
                      seconds=time.perf_counter() - t0, done=self._snap.total, what="")

    def _chunks(self, plan: BaselinePlan, tokens: bool) -> tuple[dict[int, str], str | None]:
        """Each chunk's recompute in turn: the steps that failed, and why the recomputes stopped
        (None: they did not)."""
        covered = set(plan.done)
        failed: dict[int, str] = {}
        for k, chunk in enumerate(plan.chunks, 1):
            if self._stop.is_set():
                break
            covered |= set(chunk)
            steps = sorted(covered) if plan.large and not covered >= set(plan.steps) else None
            self._set(chunk=k, done=0, total=len(covered) if plan.large else len(plan.steps), what="")

            def progress(done: int, total: int, what: str) -> None:
                self._set(done=done, total=total, what=what)

            with self._write:
                result, error = self._recompute(steps, tokens, progress)
            if error is not None or result is None:
                return failed, error or "the recompute gave no result"
            failed.update(result["steps_failed"])
            covered -= set(result["steps_failed"])  # not tried again in the next chunks
            self._set(version=self._snap.version + 1,
                      covered=len(result["steps_done"]) + len(result["steps_failed"]))
        return failed, None

    def _recompute(self, steps: list[int] | None, tokens: bool,
                   progress: Callable[[int, int, str], None]) -> tuple[dict | None, str | None]:
        """One recompute of the baseline (``steps``; None: every step): ``(summary, None)`` or
        ``(None, why it failed)``."""
        if not self.isolate:
            return _recompute_here(str(self.run), steps, self.device, tokens, progress)
        try:
            _, conn = self._child_up()
            with self._cond:  # a page's heavy work first: no recompute starts while one holds it
                self._cond.wait_for(lambda: not self._holds or self._stop.is_set())
                if self._stop.is_set():
                    return None, "the baseline's worker was stopped"
                self._computing, self._paused = True, False
            conn.send((steps, tokens))
            while True:
                msg = conn.recv()
                if msg[0] == "progress":
                    progress(*msg[1:])
                elif msg[0] in ("paused", "resumed"):
                    with self._cond:
                        self._paused = msg[0] == "paused"
                        self._cond.notify_all()
                else:
                    return msg[1], msg[2]
        except (EOFError, OSError) as exc:  # the child died (killed, out of memory) or was stopped
            self._end_child(wait=False)
            return None, f"the baseline's process ended ({type(exc).__name__})"
        finally:
            with self._cond:
                self._computing = self._paused = False
                self._cond.notify_all()

    def _child_up(self) -> tuple[Any, Any]:
        if self._child is not None and self._child[0].is_alive():
            return self._child
        ctx = mp_context()
        parent, child = ctx.Pipe()
        with self._cond:
            self._go = ctx.Event()
            if not self._holds:
                self._go.set()
        proc = ctx.Process(target=child_main, args=(child, str(self.run), self.device, self._go, dict(os.environ)),
                           name=f"rldiag-baseline:{self.run.name}", daemon=True)
        proc.start()
        child.close()
        self._child = (proc, parent)
        return self._child

    def _end_child(self, wait: bool) -> None:
        got, self._child = self._child, None
        if got is None:
            return
        proc, conn = got
        try:
            if wait:
                conn.send(None)  # done: the child returns
        except OSError:
            pass
        if not wait:
            proc.terminate()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        conn.close()


def _recompute_here(run: str, steps: list[int] | None, device: str, tokens: bool,
                    progress: Callable[[int, int, str], None]) -> tuple[dict | None, str | None]:
    try:
        res = api.recompute(run, name=BASELINE, steps=steps, device=device, save_tokens=tokens, progress=progress)
    except RldiagError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 (shown in the pages; a thread's traceback would go to the log)
        return None, f"{type(exc).__name__}: {exc}"
    return {"steps_done": list(res.steps_done), "steps_failed": dict(res.steps_failed),
            "steps_reused": list(res.steps_reused), "seconds": res.seconds}, None


def adopt_environment(env: dict[str, str] | None) -> None:
    """Make a child's environment its parent's at the time it asked (``env``, a copy of
    ``os.environ``): the fork server that forked the child was started once, with the environment
    of that moment, and ``RLDIAG_HOME``, ``RLDIAG_READ_ONLY`` and the like decide where a run's
    outputs go. None: left as it is."""
    if env is not None and env != dict(os.environ):
        os.environ.clear()
        os.environ.update(env)


def child_main(conn: Any, run: str, device: str, go: Any = None, env: dict[str, str] | None = None) -> None:
    """The baseline's child process: one recompute per ``(steps, save_tokens)`` received, its
    progress and ``("done", summary, error)`` sent back, until ``None`` or the parent goes away.
    ``go`` (an event): when it is cleared (a page's heavy work, :meth:`BaselineWorker.hold`), the
    recompute pauses after its current step, its freed memory given back to the system, between
    ``("paused",)`` and ``("resumed",)``. Ctrl-C is the server's to handle (the child ends with its pipe)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    adopt_environment(env)
    memory.name_process("rldiag-baseline")
    api.warm_up()  # preloaded by the fork server; spawned: imported here, once

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        steps, tokens = msg

        def progress(done: int, total: int, what: str) -> None:
            conn.send(("progress", done, total, what))
            if go is not None and not go.is_set():
                memory.release()
                conn.send(("paused",))
                go.wait()
                conn.send(("resumed",))

        try:
            summary, error = _recompute_here(run, steps, device, tokens, progress)
            conn.send(("done", summary, error))
        except (EOFError, OSError):  # the parent went away mid-recompute
            return
        finally:
            memory.release()


# -- one worker per (process, run) ---------------------------------------------------------------

_registry: dict[tuple[str, str], BaselineWorker] = {}
_registry_lock = threading.Lock()


def key_of(store: Store) -> tuple[str, str]:
    """A run's key in the registry: its resolved path and where its outputs go (the mirror of a
    read-only run depends on ``$RLDIAG_HOME``)."""
    return str(Path(store.run).resolve()), str(store.rd.output_dir)


def worker_for(store: Store, **options) -> BaselineWorker:
    """The run's worker, made on first use (``options``: :class:`BaselineWorker`'s)."""
    key = key_of(store)
    with _registry_lock:
        w = _registry.get(key)
        if w is None:
            options.setdefault("synchronous", MODE == "sync")
            w = _registry[key] = BaselineWorker(store, **options)
        return w


def workers() -> list[BaselineWorker]:
    """Every worker of this process."""
    with _registry_lock:
        return list(_registry.values())


def lookup(key: tuple[str, str]) -> BaselineWorker | None:
    with _registry_lock:
        return _registry.get(key)


def forget(key: tuple[str, str]) -> None:
    """Stop and drop a run's worker (tests; a run removed from disk)."""
    with _registry_lock:
        w = _registry.pop(key, None)
    if w is not None:
        w.stop()


def stop_all(timeout: float | None = None) -> None:
    """Stop and drop every worker of this process."""
    with _registry_lock:
        workers = list(_registry.values())
        _registry.clear()
    for w in workers:
        w.stop(timeout)
