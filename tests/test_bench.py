"""The benchmark script runs end to end at a tiny size and prints its table (its numbers are
machine-dependent and not asserted; what is asserted is that every workload ran)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs a subprocess / a cluster: `make test-fast` leaves it out

ROOT = Path(__file__).resolve().parents[1]


def _ratio_of_printed(ratio: float, num: float, den: float, half_ulp: float = 0.005) -> bool:
    """Whether a printed `ratio` is num/den for some num and den that print as the given values.

    The table prints seconds with two decimals, so 0.24 stands for anything in [0.235, 0.245):
    a ratio of about 11 may then differ by 2% from the quotient of the printed cells."""
    lo = (num - half_ulp) / (den + half_ulp)
    hi = (num + half_ulp) / max(den - half_ulp, 1e-12)
    return lo - half_ulp <= ratio <= hi + half_ulp


def test_bench_prints_a_row_per_estimator(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_recompute.py"), "--dir", str(tmp_path), "--steps", "2",
         "--rows", "16", "--tokens", "32", "--estimators", "grpo,gae", "--repeat", "1",
         "--workloads", "uniform,tail16k", "--scale", "0.02", "--process-repeat", "1"],
        check=True, capture_output=True, text=True, timeout=600,
    ).stdout
    lines = out.splitlines()
    # the whole-process table: one row per workload, both processes ran, ratios are theirs
    top = next(i for i, line in enumerate(lines) if line.startswith("workload"))
    work = {line.split()[0]: line.split() for line in lines[top + 2: top + 4]}
    assert set(work) == {"uniform", "tail16k"}
    for name, cells in work.items():
        r_s, d_s, ratio = float(cells[6]), float(cells[7]), float(cells[8])
        assert r_s > 0 and d_s > 0 and _ratio_of_printed(ratio, r_s, d_s), (name, cells)
        assert not _ratio_of_printed(ratio * 1.5, r_s, d_s), (name, cells)  # the bound is not vacuous
        assert float(cells[9]) > 0 and float(cells[10]) > 0  # peak RSS of both processes
        assert float(cells[12]) >= 0 and float(cells[13]) >= 0  # the ratios less the fixed costs
    assert any(line.startswith("fixed cost of a process") for line in lines[:top])  # measured first
    assert work["uniform"][5] == "100%" and int(work["tail16k"][5].rstrip("%")) < 100  # rows x longest row filled
    header = next(i for i, line in enumerate(lines) if line.startswith("estimator"))
    assert "(b') known s" in lines[header] and "b/a" in lines[header]
    rows = {line.split()[0]: line.split()[1:] for line in lines[header + 2:] if line.strip()}
    assert set(rows) == {"grpo", "gae"}
    for est, cells in rows.items():
        seconds = [float(x) for x in cells[:4]]  # (a), (b), (b'), (c)
        assert all(s > 0 for s in seconds), (est, cells)
        assert float(cells[8]) > 0  # the resident set of (a) was measured (Mtok/s prints 0.00 at this size)
    # (b) is cold: it left its scenario, and (b') a new one next to the scenario it took hashes from
    scen = tmp_path / "run-2-16-32" / "rldiag" / "scenarios"
    assert {"bench-grpo", "bench-known-grpo", "bench-hashes"} <= {p.name for p in scen.iterdir()}


def test_bench_mismatch_prints_a_row_per_workload(tmp_path):
    """bench/bench_mismatch.py: the mismatch stage on and off, whole processes, at the smallest size."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_mismatch.py"), "--dir", str(tmp_path), "--steps", "2",
         "--rows", "16", "--tokens", "32", "--workloads", "uniform,step8k32k", "--scale", "0.02", "--repeat", "1",
         "--in-process"],
        check=True, capture_output=True, text=True, timeout=600,
    ).stdout
    lines = out.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("workload"))
    assert "CPU ratio" in lines[top] and "without MB" in lines[top]
    work = {line.split()[0]: line.split() for line in lines[top + 2: top + 4]}
    assert set(work) == {"uniform", "step8k32k"}
    for name, cells in work.items():
        on, off, ratio = float(cells[5]), float(cells[6]), float(cells[7])
        assert on > 0 and off > 0 and _ratio_of_printed(ratio, on, off), (name, cells)
        assert float(cells[8]) > 0 and float(cells[9]) > 0 and float(cells[10]) > 0  # CPU seconds and ratio
        assert float(cells[11]) > 0 and float(cells[12]) > 0  # peak RSS with and without
        with_cols, without_cols = cells[13].split("/")
        assert int(with_cols) > 0 and int(without_cols) == 0, (name, cells)  # the stage ran, and only when on
    assert any(line.strip().startswith("recompute_batch with the stage") for line in lines[top:])


def test_bench_doctor_follow_prints_the_fired_delay_and_the_evaluation_cost(tmp_path):
    """bench/bench_doctor_follow.py at the smallest size: the follower printed entropy_collapse's
    fired line at the step the rule first holds, and both evaluation costs were measured."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_doctor_follow.py"), "--dir", str(tmp_path), "--steps", "12",
         "--collapse-at", "5", "--rate", "5", "--prompts", "2", "--n", "4", "--eval-steps", "60", "--eval-repeat", "3",
         "--idle-timeout", "8", "--warmup", "2"],
        check=True, capture_output=True, text=True, timeout=600,
    ).stdout
    lines = out.splitlines()
    fired = next(line for line in lines if line.startswith("entropy_collapse fired")).split()
    assert fired[2] == fired[-1] and float(fired[3]) >= 0, fired  # fired at the step it first holds
    assert any(line.startswith("changed (counterfactual)") for line in lines)
    top = next(i for i, line in enumerate(lines) if line.split()[:2] == ["steps", "columns"])
    rows = [line.split() for line in lines[top + 2:] if line.strip()]
    assert [int(r[0]) for r in rows] == [6, 60]
    assert all(float(x) > 0 for r in rows for x in r[1:]), rows


def test_bench_capture_faults_prints_a_row_per_fault_and_the_follow_delay(tmp_path):
    """bench/bench_capture_faults.py at the smallest size: every fault trained every step, each
    disk fault was counted and warned once, and the follower fired at the step the rule holds."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_capture_faults.py"), "--dir", str(tmp_path), "--steps", "4",
         "--rounds", "1", "--follow-steps", "12", "--collapse-at", "5", "--rate", "5", "--prompts", "2", "--n", "4",
         "--idle-timeout", "8", "--follow-warmup", "2"],
        check=True, capture_output=True, text=True, timeout=600,
    ).stdout
    lines = out.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("fault"))
    rows = {line[:28].strip(): line[28:].split() for line in lines[top + 2: top + 12]}
    assert len(rows) == 10 and all(cells[0] == "4" for cells in rows.values()), rows
    for name in ("ENOSPC on batch files", "EACCES on batch files"):
        assert rows[name][3:] == ["2", "2", "1"], rows[name]  # steps 3-4 dropped, counted, one warning
    assert rows["ENOSPC on metrics.jsonl"][3:] == ["0", "2", "1"]
    assert rows["none"][3:] == ["0", "0", "0"]
    fired = next(line for line in lines if line.startswith("entropy_collapse fired")).split()
    assert fired[3] == fired[-1].rstrip(")"), fired  # fired at the step it first holds
    assert any(line.startswith("follower resident memory") for line in lines)


def test_bench_stages_prints_every_stage_with_shares_that_add_up(tmp_path):
    from rldiag.engine.stages import STAGES

    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_stages.py"), "--dir", str(tmp_path), "--scale", "0.02",
         "--repeat", "1", "--workloads", "uniform,tail16k"],
        check=True, capture_output=True, text=True, timeout=600,
    ).stdout
    lines = out.splitlines()
    for name in ("uniform", "tail16k"):
        top = next(i for i, line in enumerate(lines) if line.startswith(f"{name}:"))
        body = lines[top + 2: top + 2 + len(STAGES)]
        rows = {line[1:].split()[0]: line[1:].split()[1:] for line in body}
        assert list(rows) == [s.name for s in STAGES]
        assert {line[1:].split()[0] for line in body if line.startswith("*")} == {
            "diag_is", "turns", "turns_loss", "health", "mismatch", "rows", "rows_loss"}
        seconds = {k: float(v[0]) for k, v in rows.items()}
        total = float(lines[top + 2 + len(STAGES)].split()[2])
        assert abs(sum(seconds.values()) - total) <= 0.00005 * len(STAGES) + 1e-9, (name, total)
        assert sum(float(v[1].rstrip("%")) for v in rows.values()) == pytest.approx(100, abs=0.05 * len(STAGES))
        assert seconds["mismatch"] > 0 and seconds["actor_loss"] > 0  # the stages ran


def test_bench_capture_prints_bytes_per_token_and_the_tuned_layout_is_smaller(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_capture.py"), "--dir", str(tmp_path), "--steps", "1",
         "--rows", "32", "--cap", "256", "--median", "64", "--vocab", "64", "--layouts", "legacy,tuned",
         "--text", "no"],
        check=True, capture_output=True, text=True, timeout=600,
    ).stdout
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("column"))
    assert lines[header].split()[1:] == ["legacy", "tuned"]
    cells = {line.split()[0]: line.split()[1:] for line in lines[header + 1:] if line.strip()}
    assert {"old_log_probs", "ref_log_prob", "rollout_log_probs", "response_mask", "advantages"} <= set(cells)
    legacy, tuned = (float(x) for x in next(line for line in lines if line.startswith("file (all)")).split()[2:])
    assert 0 < tuned < legacy  # the same table in fewer bytes (the log-probs' dictionary pages gone)
    columns = sum(float(v[0]) for k, v in cells.items() if k not in ("file", "training", "writer"))
    assert columns < legacy  # the column chunks are part of the file (the rest: footer, page headers)


def bench_output(script: str, tmp_path, *args: str) -> str:
    """What ``bench/<script> --dir tmp_path ARGS`` prints."""
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), "--dir", str(tmp_path), *args], check=True,
                          capture_output=True, text=True, timeout=600).stdout


def test_bench_capture_policy_prints_the_share_of_the_whole_capture(tmp_path):
    out = bench_output("bench_capture.py", tmp_path, "--steps", "1", "--rows", "32", "--cap", "256", "--median", "64",
                       "--vocab", "64", "--policy", "5,0.25", "--policy-steps", "10")
    whole = next(line for line in out.splitlines() if line.startswith("10 steps, whole:"))
    part = next(line for line in out.splitlines() if line.startswith("every=5 groups=0.25:"))
    assert "in 10 files" in whole and "in 3 files" in part  # steps 1, 5, 10
    share = float(part.split("; ")[-1].split(" %")[0])
    assert 0 < share < 30  # 3 of 10 steps, a quarter of their groups (plus each file's footer)


def test_bench_memory_prints_bytes_per_token_and_where_the_high_water_rose(tmp_path):
    out = bench_output("bench_memory.py", tmp_path, "--workloads", "tail16k", "--scale", "0.02", "--repeat", "1",
                       "--stages")
    row = next(line for line in out.splitlines() if line.startswith("tail16k"))
    cells = row.split()
    assert cells[1:4] == ["10", "x", "8"] and float(cells[4]) > 0  # steps x rows (one prompt of 8), Mtokens
    assert float(cells[7]) > 0 and float(cells[8]) > 0  # recompute and floor seconds
    assert "bytes a token above the RSS before the recompute" in out


def test_bench_memory_makes_the_16m_step_at_a_scale(tmp_path):
    """step16m (issue 38 item 5): one step of lognormal lengths with 3.5 % of the rows at the 32k cap."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    out = bench_output("bench_memory.py", tmp_path, "--workloads", "step16m", "--scale", "0.0625", "--repeat", "1")
    row = next(line for line in out.splitlines() if line.startswith("step16m "))
    cells = row.split()
    assert cells[1:4] == ["1", "x", "512"] and float(cells[5]) == float(cells[4]) > 0  # one step: the largest
    (f,) = (tmp_path / "step16m-512" / "batches").iterdir()
    lengths = pc.list_value_length(pq.read_table(f, columns=["response_mask"])["response_mask"]).to_numpy()
    assert 6 <= int((lengths == 32768).sum()) <= 36  # about 3.5 % of 512 rows at the cap (18), drawn
    assert 1_000 < float(lengths.sum()) / len(lengths) < 3_000  # about 1,950 tokens a row: 16 M for 8,192 rows


def test_bench_rescore_prints_its_row_and_the_timeout_case(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_rescore.py"), "--dir", str(tmp_path), "--rows", "400",
         "--steps", "2", "--sleep-rows", "200", "--workers", "2"],
        check=True, capture_output=True, text=True, timeout=600,
    ).stdout
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rows", "calls"])
    rows, calls, rc_s, rs_s, ratio = lines[head + 1].split()
    assert (int(rows), int(calls)) == (400, 400) and float(rc_s) > 0 and float(rs_s) > 0
    assert _ratio_of_printed(float(ratio), float(rs_s), float(rc_s))
    # 1% of the first 200 rows sleep past the timeout: exactly those reported, no worker left
    assert "2 rows reported, 0 workers left" in lines[-1]


def test_bench_stage_peaks_prints_each_stage_against_its_own_start(tmp_path):
    """bench/bench_stage_peaks.py on a small synthetic run: one row per stage that allocated, each a
    stage of the engine, with its peak at least what it kept."""
    from rldiag.engine.stages import STAGES
    from rldiag.synth import SynthSpec, write_synth_run

    run = write_synth_run(tmp_path / "run", SynthSpec(steps=1, prompts=32, n=8, max_len=512, extra_columns=True))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_stage_peaks.py"), str(run)], check=True,
                         capture_output=True, text=True, timeout=600).stdout
    lines = out.splitlines()
    assert "bytes per token of each stage" in lines[0] and lines[1].split() == ["stage", "peak", "kept"]
    rows = [line.split() for line in lines[2:]]
    assert rows and {r[0] for r in rows} <= {s.name for s in STAGES}
    assert all(float(peak) >= float(kept) for _, peak, kept in rows)


def _assert_head_extracted_with_kernels(tmp_path) -> None:
    """The baseline HEAD's package, extracted under ``tmp_path`` by commit, with the compiled
    kernels built there as this tree's install built its own."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    native = tmp_path / f"rev-{head}" / "rldiag" / "engine" / "native"
    assert (native.parent / "pipeline.py").is_file()
    ours = sorted(p.name for p in (ROOT / "rldiag" / "engine" / "native").glob("*.so"))
    assert sorted(p.name for p in native.glob("*.so")) == ours


def test_bench_whole_measures_this_tree_a_baseline_and_both_floors_side_by_side(tmp_path):
    """bench/bench_whole.py at the smallest size, with this commit's own rldiag as the baseline:
    one row per workload, every process measured, the ratios those of the medians printed."""
    out = bench_output("bench_whole.py", str(tmp_path), "--baseline", "HEAD", "--workloads", "uniform,tail32k",
                       "--steps", "2", "--rows", "16", "--tokens", "32", "--scale", "0.01", "--repeat", "1")
    lines = out.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("workload"))
    rows = {line.split()[0]: line.split() for line in lines[top + 2:] if line and not line.startswith(" ")}
    assert set(rows) == {"uniform", "tail32k"}
    for cells in rows.values():
        assert len(cells) == 20  # name, steps x rows (3 cells), Mtok, then 15 numbers
        this, base, torch_floor, arrow = (float(c) for c in cells[5:9])  # wall seconds
        assert min(this, base, torch_floor, arrow) > 0
        assert _ratio_of_printed(float(cells[9]), this, torch_floor) and _ratio_of_printed(float(cells[10]), this, base)
        assert all(float(c) > 0 for c in cells[11:14] + cells[16:20])  # CPU seconds, peak MB of each process
    _assert_head_extracted_with_kernels(tmp_path)
    scen = tmp_path / "run-2-16-32-twin" / "rldiag" / "scenarios" / "bench-whole"
    assert (scen / "scenario.json").is_file()  # the baseline wrote into the run's twin, not the run
    assert "load average" in out


def test_bench_memory_slope_fits_a_line_per_process(tmp_path):
    out = bench_output("bench_memory.py", str(tmp_path), "--workloads", "none", "--slope", "8,16", "--repeat", "1")
    fits = {line.split()[0]: line.split() for line in out.splitlines() if "bytes a token, intercept" in line}
    assert set(fits) == {"this", "torch", "arrow"}
    for cells in fits.values():
        float(cells[2]), float(cells[7])  # the slope and the intercept, numbers
    sizes = [line.split() for line in out.splitlines() if line.split()[:1] in (["8"], ["16"])]
    assert [int(c[0]) for c in sizes] == [8, 16] and all(float(c[3]) > 0 for c in sizes)  # this tree's peak MB


def test_bench_ab_pairs_the_rounds_of_each_revision(tmp_path):
    """bench/bench_ab.py at the smallest size, this commit against this tree: one row per
    revision, the reference's own ratios exactly 1, every process timed, the commit extracted with
    the kernels this tree built, and no scenario left behind."""
    out = bench_output("bench_ab.py", str(tmp_path), "--revisions", "HEAD,this", "--rounds", "3", "--steps", "2",
                       "--rows", "16", "--tokens", "32")
    lines = out.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("revision"))
    rows = {line.split()[0]: line.split() for line in lines[top + 1:top + 3]}
    assert set(rows) == {"HEAD", "this"}
    assert rows["HEAD"][3] == "1.000" and rows["HEAD"][5] == "1.000"
    assert all(float(c) > 0 for cells in rows.values() for c in (cells[1], cells[2], cells[3], cells[5]))
    _assert_head_extracted_with_kernels(tmp_path)
    assert not list((tmp_path / "run-2-16-32" / "rldiag" / "scenarios").glob("bench-ab-*"))
    out = bench_output("bench_ab.py", str(tmp_path), "--revisions", "HEAD,this", "--rounds", "1", "--steps", "2",
                       "--rows", "16", "--tokens", "32", "--engine", "2")
    head_row = next(line.split() for line in out.splitlines() if line.startswith("HEAD"))
    this_row = next(line.split() for line in out.splitlines() if line.startswith("this"))
    assert "engine ms" in out and head_row[3] == "1.000" and float(this_row[1]) > 0 and float(this_row[2]) > 0
