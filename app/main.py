"""rldiag's app from a checkout: ``streamlit run app/main.py [-- RUN ...]``.

The app itself ships inside the package (:mod:`rldiag.app`); ``rldiag app [RUN ...]`` is the
same app for an installed rldiag.
"""

from rldiag.app.main import render

render()
