"""The What-if page's reward function (rldiag rescore from the app): on loopback it re-scores the
run and the Rollouts page shows the captured score beside the new one; a shared app offers none."""

from __future__ import annotations

import os

import polars as pl
import pytest
from streamlit import config

from rldiag.app import access
from rldiag.io.run_layout import RunLayout
from rldiag.viz import transcript, whatif
from tests.app.helpers import fresh_sample, open_app

pytestmark = pytest.mark.slow  # worker processes

TAG_ONLY = "def tag(data_source, solution_str, ground_truth, extra_info=None):\n    return float('<eos>' in solution_str)\n"


def test_rescore_names_and_the_rollouts_columns():
    assert whatif.rescore_name("my.py:strict") == "reward=strict"
    assert whatif.rescore_name("pkg.mod:strict", "adv_estimator=rloo") == "reward=strict__adv_estimator=rloo"
    frame = pl.DataFrame({"row": [0], "uid": ["a"], "extra": [1], "score_captured": [0.5], "score": [1.0]})
    assert transcript.shown(frame).columns[:4] == ["row", "uid", "score", "score_captured"]


def test_the_whatif_page_rescores_with_a_reward_function(tmp_path):
    run = fresh_sample(tmp_path)
    fn = tmp_path / "tag.py"
    fn.write_text(TAG_ONLY)
    at = open_app(run, "views/whatif.py")
    at.text_input(key="wi_reward").input(f"{fn}:tag").run()
    assert any("reward=tag" in m.value for m in at.markdown)
    at.button(key="wi_run").click().run(timeout=600)
    assert not at.exception, [e.value for e in at.exception]
    rows = RunLayout(run).scenario("reward=tag").rows_file(1)
    assert rows.is_file() and RunLayout(run).scenario("reward=tag").tokens_file(1).is_file()


def test_a_shared_app_offers_no_reward_function(tmp_path, monkeypatch):
    run = fresh_sample(tmp_path)
    config.set_option("server.address", "0.0.0.0")
    monkeypatch.setenv(access.TOKEN_VAR, "t0ken")
    monkeypatch.setenv(access.ROOTS_VAR, "")
    monkeypatch.setenv("RLDIAG_RUN", os.pathsep.join([str(run)]))  # conftest's loopback_app restores all of it
    at = open_app(run, "views/whatif.py", access_granted=True)
    assert not [t for t in at.text_input if t.key == "wi_reward"]
    assert any("Re-scoring with a reward function is off" in c.value for c in at.caption)
