"""docs/notebook.ipynb: committed without outputs, and run end to end (a Jupyter kernel) on a copy
of the bundled sample, given to its first cell as ``RLDIAG_RUN``."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "docs" / "notebook.ipynb"
SAMPLE = ROOT / "samples" / "grpo-tool"


def test_the_notebook_is_committed_clean():
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    assert "RLDIAG_RUN" in "".join(code[0]["source"])


@pytest.mark.slow  # starts a Jupyter kernel
def test_the_notebook_runs_on_a_copy_of_the_sample(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("plotly")
    pytest.importorskip("kaleido", reason="the notebook saves a PNG (kaleido is in the app extra)")
    from rldiag.viz.export import browser_path

    if browser_path() is None:
        pytest.skip("chromium is not installed (apt-get install chromium); CI installs it")
    run = tmp_path / "grpo-tool"
    shutil.copytree(SAMPLE, run, ignore=shutil.ignore_patterns("rldiag"))
    monkeypatch.setenv("RLDIAG_RUN", str(run))
    monkeypatch.setenv("RLDIAG_HOME", str(tmp_path / "home"))  # never the user's rldiag directory
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    # the what-if, the compare and the doctor's recompute went into the copy
    scenarios = run / "rldiag" / "scenarios"
    assert (scenarios / "baseline" / "scenario.json").is_file()
    assert (scenarios / "adv_estimator=rloo" / "scenario.json").is_file()
    assert (run / "rldiag" / "comparisons" / "baseline__vs__adv_estimator=rloo" / "comparison.json").is_file()
    assert not (tmp_path / "home").exists()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert str(run) in text and "baseline adv_estimator=rloo 30 steps" in text
    assert "step 30 (30/30)" in text  # the compare's progress
    assert any("application/vnd.plotly.v1+json" in o.get("data", {}) or "plotly" in o.get("data", {}).get("text/html", "")
               for o in outputs if o.output_type in ("execute_result", "display_data"))
    # the figure saved as a PNG (kaleido driving the installed chromium, offline), 900 x 450
    png = (tmp_path / "pg_loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (900, 450)
    assert f"pg_loss.png {len(png)} bytes" in text
