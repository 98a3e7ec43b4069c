"""bench/bench_kernels.py runs on the CPU at a tiny size and reports each estimator against its
bandwidth floor (the numbers are the machine's; what is asserted is that they were measured)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs a subprocess / a cluster: `make test-fast` leaves it out

ROOT = Path(__file__).resolve().parents[1]


def test_kernel_report_on_cpu(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_kernels.py"), "--dir", str(tmp_path), "--steps", "2",
         "--rows", "16", "--tokens", "64", "--estimators", "grpo,gae", "--repeat", "2", "--copy-mib", "16"],
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    lines = [line for line in out.splitlines() if not line.startswith("USDT")]
    assert any("copy bandwidth" in line for line in lines)
    header = next(i for i, line in enumerate(lines) if line.startswith("estimator"))
    rows = {line.split()[0]: line.split()[1:] for line in lines[header + 1:] if line.strip()}
    assert set(rows) == {"grpo", "gae"}
    for cells in rows.values():
        wall, kernel, kernels, floor, ratio, moved, rate = (float(x) for x in cells)
        assert wall > 0 and kernel > 0 and kernels > 10 and floor > 0 and rate > 0
        # 2 steps x 16 rows x 64 tokens, float32: at least the mask and the scores read and the
        # advantages written, 3 x 8 kB
        assert moved >= 0.02
        # the ratio to the floor is a measurement (timed on a shared machine), not asserted here
        assert ratio > 0
