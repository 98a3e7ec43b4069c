"""A wheel install: the app's files ship in the package, and ``rldiag app`` works from any
directory on the bundled sample (built, installed into a throwaway venv, run there)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("install")]  # one wheel and venv per run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # built from a copy of the sources: pip builds in the source tree (build/, *.egg-info), and the
    # checkout is shared with the other test processes of a parallel run
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "rldiag")  # never a sample's outputs
    shutil.copytree(ROOT / "samples", src / "samples", ignore=ignore)
    shutil.copytree(ROOT / "rldiag", src / "rldiag", symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, cwd=out)
    (whl,) = out.glob("rldiag-*.whl")
    return whl


def test_the_wheel_holds_the_app_and_the_sample(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for page in ("main.py", "session.py", "views/metrics.py", "views/whatif.py", "views/step.py",
                 "views/offpolicy.py", "views/health.py"):
        assert f"rldiag/app/{page}" in names
    sample = [n for n in names if n.startswith("rldiag/app/samples/grpo-tool/")]
    assert "rldiag/app/samples/grpo-tool/run.yaml" in sample and "rldiag/app/samples/grpo-tool/metrics.jsonl" in sample
    assert sum(n.endswith(".parquet") for n in sample) >= 10
    assert not any("/rldiag/app/samples/grpo-tool/rldiag/" in "/" + n for n in names)  # never a sample's outputs
    # the compiled kernels, built by the wheel's own build (no .so was copied)
    for kernel in ("_mismatch_chunk", "_rollout_probs", "_kl_sums", "_grad_weight", "_ppo_clip", "_tis_counts", "_span_sums",
                   "_row_sums"):
        assert any(n.startswith(f"rldiag/engine/native/{kernel}") and n.endswith(".so") for n in names), names
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "rldiag = rldiag.cli.main:main" in entry


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> tuple[Path, Path]:
    """(python, site-packages) of a throwaway venv holding the wheel (``--no-deps``)."""
    venv = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # the dependencies come from this interpreter's site-packages (a path line: its .pth files, the
    # editable install among them, are not processed, so rldiag itself comes from the wheel)
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True)
    return py, site


def test_rldiag_app_from_a_wheel_install_on_the_bundled_sample(installed, tmp_path):
    py, site = installed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, RLDIAG_HOME=str(tmp_path / "home"), PYTHONPATH="")
    probe = """
import json, shlex, subprocess, sys
import rldiag, rldiag.app
from rldiag.viz import runs
from rldiag.cli.cmd_app import app_command
import argparse
# the command `rldiag app` runs (on loopback, as by default; no token: AppTest has no URL to carry one)
cmd = app_command(argparse.Namespace(runs=[], port=None, address="127.0.0.1", headless=True, token=None,
                                     no_token=True, root=[], print_command=False))
from streamlit import config
config.set_option("server.address", "127.0.0.1")
from streamlit.testing.v1 import AppTest
from rldiag.app import worker
from rldiag.io.run_layout import RunLayout
worker.MODE = "sync"  # the baseline computed on open, before the page is drawn
sample = runs.default_run()
at = AppTest.from_file(cmd[4], default_timeout=120)
at.session_state["run_path"] = str(sample)
at.run()
out = RunLayout(sample).output_dir
print(json.dumps(dict(rldiag=rldiag.__file__, script=cmd[4], sample=str(sample), out=str(out),
                      baseline=(out / "scenarios" / "baseline" / "scenario.json").is_file(),
                      bundled=runs.is_bundled(sample), writable=runs.writable(sample),
                      errors=[str(e.value) for e in at.exception], charts=len(at.get("echarts_chart")))))
"""
    got = subprocess.run([str(py), "-c", probe], check=True, capture_output=True, text=True, cwd=elsewhere, env=env)
    info = json.loads(got.stdout.strip().splitlines()[-1])
    assert info["rldiag"].startswith(str(site)), info  # the wheel's rldiag, not the checkout's
    assert info["script"].startswith(str(site)) and Path(info["script"]).is_file()
    assert info["sample"].startswith(str(site)) and info["bundled"]
    # the install is never written: the sample's outputs go to its mirror under $RLDIAG_HOME
    assert info["out"].startswith(str(tmp_path / "home" / "runs")) and info["writable"] and info["baseline"]
    assert not (Path(info["sample"]) / "rldiag").exists()
    assert info["errors"] == [] and info["charts"] >= 1
    # the console script resolves the packaged script too
    script = py.parent / "rldiag"
    if not script.exists():  # pip --target writes no scripts: call the entry point
        out = subprocess.run([str(py), "-m", "rldiag.cli.main", "app", "--print-command"], check=True,
                             capture_output=True, text=True, cwd=elsewhere, env=env).stdout
    else:
        out = subprocess.run([str(script), "app", "--print-command"], check=True, capture_output=True, text=True,
                             cwd=elsewhere, env=env).stdout
    assert str(site / "rldiag" / "app" / "main.py") in out


def test_rldiag_app_serves_from_a_wheel_install(installed, tmp_path):
    """``rldiag app`` (in its own process, the app preloaded) answers on its port from any directory."""
    import time
    import urllib.request

    from rldiag.viz.serve import free_port

    py, site = installed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    port = free_port()
    sample = site / "rldiag" / "app" / "samples" / "grpo-tool"
    env = dict(os.environ, RLDIAG_HOME=str(tmp_path / "home"), PYTHONPATH="")
    proc = subprocess.Popen([str(py), "-m", "rldiag.cli.main", "app", str(sample), "--headless", "--port", str(port),
                             "--address", "127.0.0.1"], cwd=elsewhere, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "rldiag app did not answer"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=20)
    assert not (sample / "rldiag").exists()  # nothing written into the install
