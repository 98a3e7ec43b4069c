"""Streamlit glue shared by the pages: the open run, its store, and error display."""
