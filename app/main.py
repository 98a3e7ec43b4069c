"""rldiag's app: ``streamlit run app/main.py [-- RUN]``.

Five pages over one run directory: the logged training metrics (live) beside recomputed ones,
what-if recomputes, one step's groups and tokens, off-policy diagnostics, and the doctor's
health findings. Every number comes from rldiag (:mod:`rldiag.store`, :mod:`rldiag.viz`).
"""

import sys
from pathlib import Path

import streamlit as st

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rlapp import session  # noqa: E402

st.set_page_config(page_title="rldiag", page_icon=":material/monitor_heart:", layout="wide")

PAGES = [
    st.Page("views/metrics.py", title="Training metrics", icon=":material/monitoring:", url_path="metrics", default=True),
    st.Page("views/whatif.py", title="What-if", icon=":material/science:", url_path="whatif"),
    st.Page("views/step.py", title="Step", icon=":material/biotech:", url_path="step"),
    st.Page("views/offpolicy.py", title="Off-policy", icon=":material/alt_route:", url_path="offpolicy"),
    st.Page("views/health.py", title="Health", icon=":material/health_and_safety:", url_path="health"),
]

nav = st.navigation(PAGES)
session.sidebar()
nav.run()
