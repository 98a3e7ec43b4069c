"""The run the app shows, its :class:`~rldiag.store.Store`, the picker, the background baseline's
status, and errors shown in the page."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import streamlit as st

from rldiag.app import access, gate, memory, preloaded_store, worker
from rldiag.errors import RldiagError
from rldiag.store import Store
from rldiag.store.sandbox import served_dirs
from rldiag.viz import runs
from rldiag.viz.baseline import large_note, progress_text
from rldiag.viz.progress import progress_state

#: seconds between two looks at the background baseline (while a page is open): while it computes,
#: and while it waits for the run's next step (each look reruns a fragment, which costs the server
#: a few tenths of a second of CPU whatever the fragment does)
BASELINE_REFRESH_S = 1.0
BASELINE_IDLE_REFRESH_S = 5.0

RUN_KEY = "run_path"
#: the other runs given on the command line (or in the sidebar), overlaid on the metrics page
OTHER_RUNS_KEY = "other_runs"
#: widget keys that belong to one run and are dropped when the run changes
RUN_SCOPED_PREFIXES = ("m_", "wi_", "st_", "op_", "he_", "ro_")


def _store(path: str) -> Store:
    """The run's store (``rldiag app``'s, opened before the server started), each run with a
    DuckDB connection of its own that reads only the run's directories (and its mirror: another
    ``$RLDIAG_HOME`` is another store)."""
    return _open_store(path, tuple(served_dirs(path)))


@st.cache_resource(show_spinner=False, max_entries=8)
def _open_store(path: str, dirs: tuple[str, ...]) -> Store:
    return preloaded_store(path) or Store(path)


def _run_changed() -> None:
    for k in list(st.session_state):
        if isinstance(k, str) and k.startswith(RUN_SCOPED_PREFIXES):
            del st.session_state[k]


def open_run(path: str | Path) -> None:
    """Make ``path`` the open run (a widget callback: it runs before the next rerun)."""
    st.session_state[RUN_KEY] = str(path)
    _run_changed()


def _open_sample() -> None:
    sample = runs.default_run()
    if sample is None:
        st.session_state["pk_error"] = f"No bundled sample run under {runs.samples_dir()}"
    else:
        open_run(sample)


def _open_typed() -> None:
    typed = str(st.session_state.get("pk_path", "")).strip()
    if typed:
        open_run(typed)


def sidebar() -> None:
    """The run box (initially the URL's ``run``, else the command line's, else empty: the picker)."""
    if RUN_KEY not in st.session_state:
        first = runs.initial_runs(sys.argv)
        st.session_state[RUN_KEY] = st.query_params.get("run") or (first[0] if first else "")
        st.session_state.setdefault(OTHER_RUNS_KEY, "\n".join(first[1:]))
    st.sidebar.text_input("Run directory", key=RUN_KEY, on_change=_run_changed,
                          help="A run directory: batches/step_<N>.parquet, metrics.jsonl, run.yaml")
    st.sidebar.text_area("Other runs to overlay (one per line)", key=OTHER_RUNS_KEY, height=80,
                         help="Their logged metrics and scenarios are drawn on the Training metrics page.")
    path = run_path()
    if path:
        st.query_params["run"] = path
    elif "run" in st.query_params:
        del st.query_params["run"]
    acc = gate.policy()
    if acc.shared:
        st.sidebar.caption(access.shared_note(acc))


def widget_key(name: str) -> str:
    """The key of the widget ``name`` now: ``name`` itself until the page gave it a value of its own
    (:func:`set_widget`), then ``name~<n>``."""
    gen = int(st.session_state.get(f"{name}~gen", 0))
    return f"{name}~{gen}" if gen else name


def set_widget(name: str, value: Any) -> str:
    """Give the widget ``name`` a value of the page's own (not its user's); the key to draw it with.

    The browser sends every widget's state with each of its requests, the fragments' timers
    included (the metrics page's panels ask every second), so a request it sent before it drew the
    page's last run carries the widget as it was. Streamlit applies that old value over the one the
    page set, and calls the widget's ``on_change`` as though its user had changed it: a baseline
    added to an overlay left it again, with the overlay marked as changed by hand, and a zoom
    went back to the whole run. A widget the browser already shows is therefore given a new value
    under a new key (a new widget): the old one's state, from an earlier request, no longer reaches
    it. A widget not drawn yet, or already holding ``value``, keeps its key."""
    key = widget_key(name)
    if key in st.session_state and st.session_state[key] != value:
        gen = int(st.session_state.get(f"{name}~gen", 0)) + 1
        st.session_state[f"{name}~gen"] = gen
        key = widget_key(name)
    st.session_state[key] = value
    return key


def by_hand(flag: str, name: str, key: str) -> None:
    """The ``on_change`` of the widget ``name`` drawn under ``key`` (``args=(flag, name, key)``):
    its user changed it, so ``flag`` (the page sets its value while it holds) goes False.
    Streamlit also calls an older key's ``on_change`` when a late request carries that widget's
    state (:func:`set_widget`): that one changes nothing."""
    if key == widget_key(name):
        st.session_state[flag] = False


def run_path() -> str:
    return str(st.session_state.get(RUN_KEY, "") or "").strip()


def other_run_paths() -> list[str]:
    text = str(st.session_state.get(OTHER_RUNS_KEY, "") or "")
    main = run_path()
    return list(dict.fromkeys(p.strip() for p in text.splitlines() if p.strip() and p.strip() != main))


def picker() -> None:
    """No run open: a path box, the recent runs, and the bundled sample (opened in place, mirrored)."""
    acc = gate.policy()
    st.info(access.SHARED_HOW_TO if acc.shared else runs.HOW_TO)
    c1, c2 = st.columns([4, 1], vertical_alignment="bottom")
    c1.text_input("Run directory", key="pk_path", placeholder="/path/to/RUN")
    c2.button("Open", key="pk_open", on_click=_open_typed, type="primary")
    if acc.shared:  # the runs it serves, never the server's recent runs nor its install's sample
        served = acc.served_runs()
        if served:
            st.markdown("**Runs served here**")
            for i, p in enumerate(served):
                st.button(p, key=f"pk_served_{i}", on_click=open_run, args=(p,))
    else:
        recent = runs.recent_runs()
        if recent:
            st.markdown("**Recent runs**")
            for i, p in enumerate(recent):
                st.button(p, key=f"pk_recent_{i}", on_click=open_run, args=(p,))
    if not acc.shared and runs.default_run() is not None:
        st.button("Open the bundled sample", key="pk_sample", on_click=_open_sample,
                  help=f"A real GRPO run with tool calls. It lives inside the install, which rldiag never writes: what "
                       f"rldiag computes for it goes to {runs.user_dir() / 'runs'}.")
    if st.session_state.get("pk_error"):
        st.error(st.session_state.pop("pk_error"))


def store_or_stop() -> Store:
    """The open run's store; without a run the picker, with a broken one the error; then stop."""
    path = run_path()
    if not path:
        picker()
        st.stop()
    acc = gate.policy()
    if not acc.allows(path):
        st.error(acc.refusal(path))
        picker()
        st.stop()
    try:
        store = _store(path)
    except RldiagError as exc:
        show_error(exc)
        st.stop()
    if not acc.shared and not runs.is_bundled(store.run):
        runs.remember_run(store.run)
    note = runs.output_note(store.run)
    if note:
        st.sidebar.caption(note)
    baseline_status(store)
    return store


# -- the background baseline (rldiag.app.worker) -------------------------------------------------


def _worker(store: Store) -> worker.BaselineWorker | None:
    """The run's baseline worker, None when the app computes nothing on open (``off``, or a run
    rldiag may write nowhere for)."""
    if worker.MODE == "off" or not runs.writable(store.run):
        return None
    return worker.worker_for(store)


def baseline_state(store: Store) -> worker.Snapshot | None:
    """Where the run's background baseline stands (None: there is none)."""
    w = _worker(store)
    return w.snapshot() if w is not None else None


@contextlib.contextmanager
def baseline_lock(store: Store):
    """Around a write of the baseline scenario from a page: never at the same time as the worker."""
    w = _worker(store)
    with w.exclusive() if w is not None else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def tokens_lock(store: Store):
    """Around a write of the run's token cache (one session at a time)."""
    w = _worker(store)
    with w.tokens_lock() if w is not None else contextlib.nullcontext():
        yield


def baseline_status(store: Store) -> worker.Snapshot | None:
    """Start the run's background baseline (first open), and show where it stands: a progress bar
    while it computes, refreshed every second; the page is drawn again whenever the worker wrote
    (the pages show the steps done so far). Synchronous workers (tests) have done their work
    by the time this returns."""
    w = _worker(store)
    if w is None:
        return None
    snap = w.ensure()
    if w.synchronous:
        _draw_baseline(snap)
    else:
        live = _baseline_live if snap.busy else _baseline_idle
        live(worker.key_of(store), _generation(snap))
    return w.snapshot()


def _generation(snap: worker.Snapshot) -> tuple[int, int, bool]:
    """What, when it moves, has the page drawn again: a write, a pass ended, a pass started."""
    return snap.version, snap.passes, snap.busy


def _draw_baseline(snap: worker.Snapshot) -> None:
    if snap.busy:
        frac, text = progress_text(snap.done, snap.total, snap.what, snap.covered, snap.steps, snap.large,
                                   snap.chunk, snap.chunks)
        st.progress(frac, text=text)
        if snap.large:
            st.caption(large_note(snap.steps, snap.total_bytes, snap.chunk_size))
    elif snap.error:
        st.warning(f"The baseline (the run's own settings) could not be computed: {snap.error}")
    elif snap.failed:
        bad = sorted(snap.failed.items())
        st.caption(f"The baseline left out {len(bad)} step(s) that could not be recomputed: "
                   + "; ".join(f"step {k}: {v}" for k, v in bad[:3]) + ("; ..." if len(bad) > 3 else ""))


def _look(key: tuple[str, str], seen: tuple[int, int, bool]) -> None:
    w = worker.lookup(key)
    if w is None:
        return
    snap = w.ensure()  # a page still open keeps the worker going
    if _generation(snap) != seen:
        st.rerun()  # the whole page: it shows what the worker wrote (and the right fragment)
    _draw_baseline(snap)


@st.fragment(run_every=BASELINE_REFRESH_S)
def _baseline_live(key: tuple[str, str], seen: tuple[int, int, bool]) -> None:
    """While the baseline computes: its progress bar, every second."""
    _look(key, seen)


@st.fragment(run_every=BASELINE_IDLE_REFRESH_S)
def _baseline_idle(key: tuple[str, str], seen: tuple[int, int, bool]) -> None:
    """While the worker waits for the run's next step: a look now and then."""
    _look(key, seen)


def other_stores() -> dict[str, Store]:
    """The overlaid runs that open (label -> store); a broken one is shown as an error and left out."""
    out = {}
    acc = gate.policy()
    for p in other_run_paths():
        if not acc.allows(p):
            st.error(acc.refusal(p))
            continue
        try:
            out[p] = _store(p)
        except RldiagError as exc:
            show_error(exc)
    return out


def can_write(store: Store) -> bool:
    """Whether rldiag may write into the run; says why not when it may not."""
    if runs.writable(store.run):
        return True
    st.caption(runs.READ_ONLY)
    return False


def show_error(exc: RldiagError) -> None:
    st.error(f"{type(exc).__name__}: {exc}")


@contextlib.contextmanager
def guard():
    """Show an :class:`RldiagError` raised inside as an error box instead of a traceback."""
    try:
        yield
    except RldiagError as exc:
        show_error(exc)


@contextlib.contextmanager
def heavy_work():
    """Around a recompute or a compare: on the way out (finished, failed or cancelled) the memory
    its arrays took goes back to the system (:func:`rldiag.app.memory.release`)."""
    try:
        yield
    finally:
        memory.release()


def progress_callback(bar, label: str):
    """A ``progress(done, total, what)`` for :mod:`rldiag.api` that moves a ``st.progress`` bar."""

    def update(done: int, total: int, what: str) -> None:
        frac, text = progress_state(done, total, what, label)
        bar.progress(frac, text=text)

    return update
