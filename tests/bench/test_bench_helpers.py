"""The benchmarks' own arithmetic (bench/bench_memory.py's slope, bench/bench_whole.py's table),
on numbers given here: no process is started."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from bench_memory import least_squares  # noqa: E402
from bench_whole import COLUMNS, header, medians, ratio, row  # noqa: E402


def test_least_squares_recovers_a_line_and_fits_noise_by_its_mean():
    xs = [0.3e6, 0.6e6, 1.2e6, 2.4e6]
    slope, intercept = least_squares(xs, [120.0 * x + 5e6 for x in xs])
    assert slope == pytest.approx(120.0) and intercept == pytest.approx(5e6)
    # points off the line, worked by hand: mean x 1.125e6, mean y 250, Sxx 2.5875e12, Sxy 2.85e8
    slope, intercept = least_squares(xs, [100.0, 300.0, 200.0, 400.0])
    assert slope == pytest.approx(2.85e8 / 2.5875e12) and intercept == pytest.approx(250.0 - 2.85e8 / 2.5875e12 * 1.125e6)


def test_least_squares_refuses_what_has_no_slope():
    with pytest.raises(ValueError, match="two points"):
        least_squares([1.0], [2.0])
    with pytest.raises(ValueError, match="same"):
        least_squares([3.0, 3.0], [1.0, 2.0])


def test_whole_process_table_row_and_ratios():
    samples = [{"seconds": s, "cpu_seconds": c, "peak_rss_mb": m} for s, c, m in
               [(5.0, 6.0, 800.0), (4.0, 5.5, 820.0), (9.0, 6.5, 790.0)]]
    med = medians(samples)
    assert (med["seconds"], med["cpu_seconds"], med["peak_rss_mb"], med["n"], med["min_seconds"]) == (
        5.0, 6.0, 800.0, 3, 4.0)
    floor = {"seconds": 2.0, "cpu_seconds": 3.0, "peak_rss_mb": 400.0}
    base = {"seconds": 4.0, "cpu_seconds": 4.0, "peak_rss_mb": 1000.0}
    assert ratio(med, floor, "seconds") == "2.50" and ratio(med, None, "seconds") == "-"
    line = row("tail32k", "3x2048", 8.78, {"this": med, "base": base, "torch": floor})
    cells = dict(zip([name for name, _ in COLUMNS], line.split()))
    assert cells["this s"] == "5.00" and cells["base s"] == "4.00" and cells["arrow s"] == "-"
    assert cells["x floor"] == "2.50" and cells["x base"] == "1.25"
    assert cells["cpu x fl"] == "2.00" and cells["cpu x base"] == "1.50"
    assert cells["this MB"] == "800" and cells["arrow MB"] == "-"
    assert len(line) == len(header())  # every cell in its column
