"""What the CLI tests that run a command in a process of its own share: a small run, and the
child process's standard output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture
def small_run(tmp_path: Path) -> Path:
    """A synthetic run of two steps."""
    from rldiag.synth import SynthSpec, write_synth_run

    return write_synth_run(tmp_path / "run", SynthSpec(steps=2, seed=1))


def child_output(code: str) -> str:
    """The standard output of ``python -c code`` (it must exit 0)."""
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
