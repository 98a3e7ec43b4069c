"""The run the app shows, its :class:`~rldiag.store.Store`, and errors shown in the page."""

from __future__ import annotations

import contextlib
import sys

import streamlit as st

from rldiag.errors import RldiagError
from rldiag.store import Db, Store
from rldiag.viz.progress import progress_state
from rldiag.viz.runs import HOW_TO, initial_run

RUN_KEY = "run_path"
#: widget keys that belong to one run and are dropped when the run changes
RUN_SCOPED_PREFIXES = ("m_", "wi_", "st_", "op_", "he_")


@st.cache_resource(show_spinner=False)
def _db() -> Db:
    """The app's one DuckDB connection."""
    return Db()


@st.cache_resource(show_spinner=False, max_entries=8)
def _store(path: str) -> Store:
    return Store(path, db=_db())


def _run_changed() -> None:
    for k in list(st.session_state):
        if isinstance(k, str) and k.startswith(RUN_SCOPED_PREFIXES):
            del st.session_state[k]


def sidebar() -> None:
    """The run picker (initially the command line's run, else the bundled sample)."""
    if RUN_KEY not in st.session_state:
        st.session_state[RUN_KEY] = initial_run(sys.argv)
    st.sidebar.text_input("Run directory", key=RUN_KEY, on_change=_run_changed,
                          help="A run directory: batches/step_<N>.parquet, metrics.jsonl, run.yaml")


def run_path() -> str:
    return str(st.session_state.get(RUN_KEY, "") or "").strip()


def store_or_stop() -> Store:
    """The open run's store; without a run (or with a broken one) the page says why and stops."""
    path = run_path()
    if not path:
        st.info(HOW_TO)
        st.stop()
    try:
        return _store(path)
    except RldiagError as exc:
        show_error(exc)
        st.stop()


def show_error(exc: RldiagError) -> None:
    st.error(f"{type(exc).__name__}: {exc}")


@contextlib.contextmanager
def guard():
    """Show an :class:`RldiagError` raised inside as an error box instead of a traceback."""
    try:
        yield
    except RldiagError as exc:
        show_error(exc)


def progress_callback(bar, label: str):
    """A ``progress(done, total, step)`` for rldiag that moves a ``st.progress`` bar."""

    def update(done: int, total: int, step: int) -> None:
        frac, text = progress_state(done, total, step, label)
        bar.progress(frac, text=text)

    return update
