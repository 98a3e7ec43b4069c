"""The app's door (Streamlit side of :mod:`rldiag.app.access`): the token asked for, and in shared
mode the paths refused, before any run data is drawn."""

from __future__ import annotations

import sys

import streamlit as st

from rldiag.app import access
from rldiag.viz import runs

#: the session's key set once the token was given (it then holds for the session)
GRANTED_KEY = "access_granted"
TOKEN_BOX_KEY = "access_token_box"


def policy() -> access.Access:
    """The serving policy of this server: its bound address (``server.address``), the runs of its
    command line and the token and roots of its environment."""
    address = st.get_option("server.address")
    return access.access_from(str(address) if address else None, runs.initial_runs(sys.argv))


def _check_typed(token: str) -> None:
    if access.token_matches(str(st.session_state.get(TOKEN_BOX_KEY, "")).strip(), token):
        st.session_state[GRANTED_KEY] = True
    else:
        st.session_state["access_wrong"] = True


def door() -> access.Access:
    """Let the session in or stop the script: in shared mode without a token, a page saying how to
    set one; with a token not yet given (``?token=T`` or the box), a page asking for it."""
    acc = policy()
    if acc.shared:
        access.make_read_only()
        if not acc.token:
            st.title("rldiag")
            st.error(access.NO_TOKEN)
            st.stop()
    if acc.token and not st.session_state.get(GRANTED_KEY):
        if access.token_matches(st.query_params.get(access.TOKEN_PARAM), acc.token):
            st.session_state[GRANTED_KEY] = True
        else:
            st.title("rldiag")
            st.info(access.ASK_TOKEN)
            st.text_input("Access token", key=TOKEN_BOX_KEY, type="password", on_change=_check_typed,
                          args=(acc.token,))
            if st.session_state.pop("access_wrong", False):
                st.error("That is not this app's token.")
            st.stop()
    return acc
