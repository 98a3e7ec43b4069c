"""rldiag's app: ``rldiag app [RUN ...]`` (or ``streamlit run app/main.py -- RUN`` in a checkout).

Five pages over one run directory: the logged training metrics (live) beside recomputed ones,
what-if recomputes, one step's groups and tokens, off-policy diagnostics, and the doctor's
health findings. Every number comes from rldiag (:mod:`rldiag.store`, :mod:`rldiag.viz`).
Pages are given by absolute path, so the app runs from any entry script and any directory.
"""

from __future__ import annotations

from pathlib import Path

VIEWS = Path(__file__).resolve().parent / "views"

#: (file, title, icon, url path) of each page, the first the default
PAGES = (
    ("metrics.py", "Training metrics", ":material/monitoring:", "metrics"),
    ("whatif.py", "What-if", ":material/science:", "whatif"),
    ("step.py", "Step", ":material/biotech:", "step"),
    ("rollouts.py", "Rollouts", ":material/table_rows:", "rollouts"),
    ("offpolicy.py", "Off-policy", ":material/alt_route:", "offpolicy"),
    ("health.py", "Health", ":material/health_and_safety:", "health"),
)


def page_path(name: str) -> str:
    """Absolute path of a page file (for ``st.page_link`` and ``st.switch_page``)."""
    return str(VIEWS / name)


def render() -> None:
    import streamlit as st

    from rldiag.app import gate, session

    st.set_page_config(page_title="rldiag", page_icon=":material/monitor_heart:", layout="wide")
    gate.door()  # the token, and in shared mode the runs it serves (rldiag.app.access)
    pages = [st.Page(page_path(f), title=t, icon=i, url_path=u, default=k == 0)
             for k, (f, t, i, u) in enumerate(PAGES)]
    nav = st.navigation(pages)
    session.sidebar()
    nav.run()


if __name__ == "__main__":
    render()
