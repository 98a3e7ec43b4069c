"""Shaping data for the app's charts and tables: pure functions over the store's frames.

No SQL here (that is :mod:`rldiag.store`), no Streamlit (that is :mod:`rldiag.app`), no maths of the
algorithms (that is :mod:`rldiag.engine`): metric grouping and search, EMA smoothing for display,
plotly figures, the step debugging checklist, the what-if widgets' options, and
adapters to the compare command and the doctor.
"""
