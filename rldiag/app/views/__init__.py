"""The app's pages, one module each (Streamlit runs them as scripts)."""
